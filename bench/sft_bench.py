"""GPU SFT benchmark: the by-hand recipe (LLaMA-Factory's ZeRO-3 example), the best hand-tuned
LLaMA-Factory config and llmft's own choices, side by side on the same data, each through llmft's
render path and launcher.

    python bench/sft_bench.py lengths DATA_DIR TOKENIZER           # here: token length per train row
    python bench/sft_bench.py run NAME --out OUT [--max-steps N]   # on the GPU machine, one variant
    python bench/sft_bench.py check-varlen --out OUT               # varlen kernel vs reference
    python bench/sft_bench.py check-fusedce --out OUT              # llmft's fused loss vs float64
    python bench/sft_bench.py triton-compiles --out OUT/triton_compiles.json  # kernels compiled, when
    python bench/sft_bench.py report OUT --json RESULT.json        # table + JSON of all variants

Each run renders an llmft config (`python -m llmft render-sft`), launches `python -m llmft sft
launch` (torchrun over llmft.sft.train on 2 GPUs) and is stopped once its last step is logged,
so the final model save is not timed. Throughput is steady state: tokens seen (without padding)
between a warm-up step and the last step, over wall time, per GPU. MFU counts llmft.core.flops's training
FLOPs per token (6 x matrix weights, the output head once, no embedding lookup, plus causal attention
over the span each token attends to: its own sample for unpacked rows and neat packing, the whole
2048-token pack for plain packing), against 989 TFLOP/s (H200 bf16 dense; hardware.py). Peak memory
is LLaMA-Factory's RECORD_VRAM (torch's max allocated, rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from llmft.core import flops, hardware  # noqa: E402
from llmft.core.shape import model_shape  # noqa: E402
from llmft.sft.run import worker_pids  # noqa: E402

WORK = REPO / "bench/work/sft"
MODELS = Path(os.environ.get("BENCH_MODELS", "/tmp/models"))
RUNS = Path(os.environ.get("BENCH_RUNS", "/tmp/bench_runs"))
SEQ = 2048

# What LLaMA-Factory cannot do is pinned off in every baseline: llmft's per-layer compile and FP8
# (left on auto, later plans would hand them to the plain tool's runs: LORA_HAND below)
NOT_THE_TOOLS = {"torch_compile": False, "fp8": False}
RECIPE = {  # the by-hand recipe: LLaMA-Factory's ZeRO-3 example config, as its users run it
    "zero_stage": 3,
    "offload": False,
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 4,
    "gradient_checkpointing": True,
    "packing": "off",
    "flash_attn": "sdpa",
    "liger_kernel": False,
    "zero_bucket_size": "hf",
    **NOT_THE_TOOLS,
}
PLAIN = {
    "packing": "plain",
    "flash_attn": "sdpa",
    "liger_kernel": False,
    "gradient_checkpointing": False,
    **NOT_THE_TOOLS,
}
# the best hand-tuned LLaMA-Factory configs measured on these GPUs before llmft: 1 B plain DDP,
# 8 B ZeRO-2 with 5e8 buckets
HAND_1B = {**PLAIN, "zero_stage": 0, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}
HAND_8B = {**PLAIN, "zero_stage": 2, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 4,
           "zero_bucket_size": 500000000, "offload": False}  # fmt: skip
# LoRA (rank 8 on every linear layer, LLaMA-Factory's defaults), LR 1e-4 as its LoRA examples use.
# lora_recipe: LLaMA-Factory's examples/train_lora/llama3_lora_sft.yaml settings (no DeepSpeed, batch
# 1 x accumulation 8, gradient checkpointing on, no packing); lora_hand: the hand-tuned LoRA (plain
# packing, batch 8 (1 B) / 4 (8 B), no checkpointing, Liger, SDPA); lora_ours: every throughput key
# auto, at the hand-tuned run's tokens per step so the loss curves compare step by step.
LORA = {"finetuning_type": "lora", "learning_rate": 1.0e-4}
LORA_RECIPE = {
    **LORA,
    "zero_stage": 0,
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 8,
    "gradient_checkpointing": True,
    "packing": "off",
    "flash_attn": "sdpa",
    "liger_kernel": False,
    **NOT_THE_TOOLS,
}
# The hand-tuned LoRA is the plain tool's: LLaMA-Factory's own Liger kernels (`enable_liger_kernel`,
# with Liger's fused loss: PLAIN_TOOL_ENV) and no compiled layers, which LLaMA-Factory has no key
# for. Until 856be52 (2026-12-04) it left sft.torch_compile on auto, so it ran llmft's per-layer compile (with
# Liger's loss alone) as ours did; those hand-tuned LoRA rows in bench/README.md say so.
LORA_HAND = {
    **LORA,
    "zero_stage": 0,
    "packing": "plain",
    "flash_attn": "sdpa",
    "liger_kernel": True,
    "gradient_checkpointing": False,
    "gradient_accumulation_steps": 1,
    **NOT_THE_TOOLS,  # the *_lf_* runs add LLaMA-Factory's own fp8 flag to the YAML
}
# FP8 (bench/sft_fp8_bench.py reports these; one H200: BENCH_GPUS=1). llmft's FP8 run
# (fp8_lora_auto_1b pins sft.fp8: true, from when `auto` kept FP8 off at 1.24 B; `auto` now turns it
# on for LoRA where the canary's FP8 leg passed and the measured step ratio (llmft.core.fp8
# PIPELINE_RATIO) is over 1, which it is at 1.24 B and 8 B, so the pin is what `auto` picks) against
# the hand-tuned bf16 run, LLaMA-Factory's own `fp8: true` on the hand-tuned settings (LF_YAML) and, for
# full fine-tuning, llmft's own bf16 plan. Every baseline pins sft.fp8: false.
BF16 = {"fp8": False}
EVAL = {"eval_strategy": "steps", "eval_steps": 100}  # held-out loss at steps 100, 200, 300
FP8_VARIANTS = {
    "fp8_lora_auto_1b": ("1b", {**LORA, "tokens_per_step": 16384, "fp8": True}, 24, 5),
    "fp8_lora_hand_1b": ("1b", {**LORA_HAND, **BF16, "per_device_train_batch_size": 8}, 24, 5),
    "fp8_lora_lf_1b": ("1b", {**LORA_HAND, **BF16, "per_device_train_batch_size": 8}, 24, 5),
    # every key auto (at 8 B `auto` turns FP8 on since levers8b measured it faster than llmft's bf16
    # plan) at the hand-tuned run's tokens per step, with lora_compile_8b's steps and warm-up (the
    # compiled layers recompile for the first packed shapes). Until 0119963 it pinned sft.fp8: true
    # and ran 12 steps, 3 of them warm-up.
    "fp8_lora_auto_8b": ("8b", {**LORA, "tokens_per_step": 8192}, 16, 6),
    # the same without DeepSpeed (ZeRO stage 0, no per-parameter ZeRO-2 gradient hooks), FP8 pinned
    "fp8_lora_z0_8b": ("8b", {**LORA, "tokens_per_step": 8192, "fp8": True, "zero_stage": 0}, 16, 6),
    "fp8_lora_hand_8b": ("8b", {**LORA_HAND, **BF16, "per_device_train_batch_size": 4}, 16, 6),
    # llmft's bf16 LoRA plan, every other key auto (since 2312bd4, 2026-12-04: no DeepSpeed, compiled layers)
    "fp8_lora_bf16_8b": ("8b", {**LORA, **BF16, "tokens_per_step": 8192}, 16, 6),
    "fp8_lora_lf_8b": ("8b", {**LORA_HAND, **BF16, "per_device_train_batch_size": 4}, 16, 6),
    # where a LoRA step's GPU time goes at 8 B, FP8 and llmft's bf16 plan (torch.profiler, steps 6-7)
    "fp8_lora_prof_8b": ("8b", {**LORA, "tokens_per_step": 8192, "fp8": True}, 8, 3),
    "lora_prof_8b": ("8b", {**LORA, "tokens_per_step": 8192}, 8, 3),
    # the launch-overhead levers of the profile above, with lora_compile_8b's steps and warm-up (the
    # compiled layers recompile for the first packed shapes): Inductor's Python wrapper (as
    # fp8_lora_auto_8b pinned FP8) against its C++ wrapper (the compiled layers' kernels launched from
    # C++; torch 2.11's C++ wrapper cannot call the varlen attention op: levers8b)
    "fp8_lora_py_8b": ("8b", {**LORA, "tokens_per_step": 8192, "fp8": True}, 16, 6),
    # the same with torchao's Float8Linear on the frozen base weights too (their float8 casts redone in
    # every forward and backward), as every FP8 LoRA run was before llmft cast frozen weights once
    "fp8_lora_ao_8b": ("8b", {**LORA, "tokens_per_step": 8192, "fp8": True}, 16, 6),
    "fp8_lora_cpp_8b": ("8b", {**LORA, "tokens_per_step": 8192, "fp8": True}, 16, 6),
    # fp8_lora_auto_8b with transformers' own token count (a GPU read after every backward) instead
    # of llmft's host count (varlen.DEVICE_COUNT_ENV): what the host count is worth
    "fp8_lora_devcount_8b": ("8b", {**LORA, "tokens_per_step": 8192}, 16, 6),
    # fp8_lora_auto_8b / _1b with Liger's own fused linear + cross-entropy (its host read of the
    # target count before every loss) instead of llmft.sft.fusedce: what leaving out that read is worth
    "fp8_lora_ligerce_8b": ("8b", {**LORA, "tokens_per_step": 8192}, 16, 6),
    # the same pair logging every 10 steps, the workflow's default (the bench logs every step, and
    # each log reads the loss back from the GPU: the one host read left in llmft's 8 B step)
    "fp8_lora_auto_8b_log10": ("8b", {**LORA, "tokens_per_step": 8192, "logging_steps": 10}, 30, 10),
    "fp8_lora_hand_8b_log10": (
        "8b",
        {**LORA_HAND, **BF16, "per_device_train_batch_size": 4, "logging_steps": 10},
        30,
        10,
    ),
    "fp8_lora_ligerce_1b": ("1b", {**LORA, "tokens_per_step": 16384, "fp8": True}, 24, 5),
    # every key auto (since 34f2112 `auto` turns FP8 on for full fine-tuning at hidden 2048 where the
    # canary's FP8 leg passed, compiles the layers to one shape and tunes their kernels); until then
    # it pinned sft.fp8: true and ran eager
    "fp8_full_auto_1b": ("1b", {}, 24, 5),
    "fp8_full_bf16_1b": ("1b", {**BF16}, 24, 5),
    # llmft's bf16 full plan with llmft.sft.fusedce on its trainable head too (LLMFT_LIGER_CROSS_ENTROPY=0)
    "fp8_full_fusedce_1b": ("1b", {**BF16}, 24, 5),
    "fp8_full_hand_1b": ("1b", {**HAND_1B, **BF16}, 24, 5),
    # the full FP8 plan with its decoder layers compiled (torchao's float8 casts and scales fused),
    # and llmft's bf16 plan compiled the same way: is it FP8 or the compile
    "fp8_full_compile_1b": ("1b", {"fp8": True, "torch_compile": True}, 24, 5),
    "fp8_full_bf16c_1b": ("1b", {**BF16, "torch_compile": True}, 24, 5),
    # the two above under torch.profiler (steps 10-11, after the compiled layers' recompiles): where the
    # FP8 step's time goes against bf16's, kernel by kernel
    "fp8_full_prof_1b": ("1b", {"fp8": True, "torch_compile": True}, 16, 5),
    "full_bf16c_prof_1b": ("1b", {**BF16, "torch_compile": True}, 16, 5),
    # the compiled pair with every micro-batch's flattened row padded to one length (8 x 2048 tokens,
    # the micro-batch's capacity; ~1 % padding here), so the compiled layers never go dynamic
    "fp8_full_static_1b": ("1b", {"fp8": True, "torch_compile": True}, 24, 5),
    "full_bf16c_static_1b": ("1b", {**BF16, "torch_compile": True}, 24, 5),
    # the FP8 one with Inductor tuning each generated kernel's block sizes (coordinate descent): the
    # float8 casts and scales fused around the GEMMs are most of what FP8 adds to a step
    "fp8_full_static_cdt_1b": ("1b", {"fp8": True, "torch_compile": True}, 24, 5),
    # full 1.24 B at the hand-tuned run's tokens per step (8 rows x 2048 = 16 384): every key auto, and
    # llmft's bf16 plan; the hand-tuned run again with Liger's kernels and fused loss (its best kernels)
    "full_auto_1b": ("1b", {"tokens_per_step": 16384}, 24, 5),
    "full_bf16_1b": ("1b", {**BF16, "tokens_per_step": 16384}, 24, 5),
    "full_handliger_1b": ("1b", {**HAND_1B, **BF16, "liger_kernel": True}, 24, 5),
    # LoRA with the compiled layers kept to one shape and their kernels tuned (auto leaves both off for
    # LoRA), against the LoRA plan auto makes (fp8_lora_auto_1b / _8b)
    "lora_static_1b": ("1b", {**LORA, "tokens_per_step": 16384, "fp8": True, "static_shapes": True,
                              "compile_tuning": True}, 24, 5),
    "lora_static_8b": ("8b", {**LORA, "tokens_per_step": 8192, "static_shapes": True, "compile_tuning": True},
                       16, 6),
    # accuracy with every key auto (FP8, one shape, tuned kernels for full) against the bf16 runs below
    "acc_full_auto_1b": ("1b", {"tokens_per_step": 16384, "extra": EVAL}, 300, 5),
    "acc_lora_auto_1b": ("1b", {**LORA, "tokens_per_step": 16384, "extra": EVAL}, 300, 5),
    # accuracy: 300 steps, the same data order and tokens per step, FP8 (true) against bf16
    "acc_full_bf16_1b": ("1b", {**BF16, "tokens_per_step": 16384, "extra": EVAL}, 300, 5),
    "acc_full_fp8_1b": ("1b", {"fp8": True, "tokens_per_step": 16384, "extra": EVAL}, 300, 5),
    "acc_lora_bf16_1b": ("1b", {**LORA, **BF16, "tokens_per_step": 16384, "extra": EVAL}, 300, 5),
    "acc_lora_fp8_1b": ("1b", {**LORA, "fp8": True, "tokens_per_step": 16384, "extra": EVAL}, 300, 5),
}  # fmt: skip
# LLaMA-Factory arguments written into a variant's rendered YAML after render (llmft refuses them in
# sft.extra): LLaMA-Factory's own FP8, as a user would turn it on.
LF_YAML = {n: {"fp8": True, "fp8_backend": "torchao"} for n in FP8_VARIANTS if "_lf_" in n}
# keys of the rendered YAML's llmft block, replaced after render (llmft.sft.train reads them)
LLMFT_YAML = {"fp8_lora_ao_8b": {"fp8": {"recipe": "tensorwise", "frozen_cast_once": False}}}
# Variants that train to their end (held-out evaluation, the final save) instead of being stopped
# once their last step is logged: their throughput comes from the step times all the same.
RUN_TO_END = {n for n in FP8_VARIANTS if n.startswith("acc_")}
VARIANTS = {
    "lora_recipe_1b": ("1b", LORA_RECIPE, 8, 3),
    "lora_hand_1b": ("1b", {**LORA_HAND, "per_device_train_batch_size": 8}, 24, 5),
    "lora_ours_1b": ("1b", {**LORA, "tokens_per_step": 16384}, 24, 5),
    "lora_warm_1b": ("1b", {**LORA, "tokens_per_step": 16384}, 12, 5),
    "lora_recipe_8b": ("8b", LORA_RECIPE, 6, 2),
    "lora_hand_8b": ("8b", {**LORA_HAND, "per_device_train_batch_size": 4}, 12, 3),
    "lora_ours_8b": ("8b", {**LORA, "tokens_per_step": 8192}, 12, 3),
    "lora_warm_8b": ("8b", {**LORA, "tokens_per_step": 8192}, 6, 3),
    # ours with each decoder layer compiled (regional torch.compile: the adapters' dropout, scaling
    # and add fused with the frozen matmuls' neighbours); recompiles for new packed shapes: warm-up 8
    "lora_compile_1b": ("1b", {**LORA, "tokens_per_step": 16384, "torch_compile": True}, 30, 8),
    # the same without DeepSpeed (ZeRO stage 0), bf16 and FP8 (frozen weights cast once)
    "lora_compile0_1b": (
        "1b",
        {**LORA, "tokens_per_step": 16384, "torch_compile": True, "zero_stage": 0},
        30,
        8,
    ),
    "fp8_lora_z0_1b": ("1b", {**LORA, "tokens_per_step": 16384, "fp8": True, "zero_stage": 0}, 30, 8),
    "lora_compile_8b": ("8b", {**LORA, "tokens_per_step": 8192, "torch_compile": True}, 16, 6),
    # ours with compilation off: the eager run against which the compiled one is measured
    "lora_eager_1b": ("1b", {**LORA, "tokens_per_step": 16384, "torch_compile": False}, 24, 5),
    "lora_eager_8b": ("8b", {**LORA, "tokens_per_step": 8192, "torch_compile": False}, 12, 3),
    # compiled, without DeepSpeed (ZeRO stage 0), as the hand-tuned run trains
    "lora_compile0_8b": (
        "8b",
        {**LORA, "tokens_per_step": 8192, "torch_compile": True, "zero_stage": 0},
        16,
        6,
    ),
    # ours without DeepSpeed (ZeRO stage 0): what the engine costs a LoRA step on one GPU
    "lora_ours0_1b": ("1b", {**LORA, "tokens_per_step": 16384, "zero_stage": 0}, 24, 5),
    # name: (model size, sft overrides, default max steps, warm-up steps left out of the timing)
    "recipe_1b": ("1b", RECIPE, 10, 3),
    "hand_1b": ("1b", HAND_1B, 24, 5),
    "ours_1b": ("1b", {}, 24, 5),
    # compiled decoder layers recompile for the first few packed shapes: more warm-up steps
    "ours_1b_rc": ("1b", {"torch_compile": True}, 30, 12),
    # logging every 10 steps (the config default) instead of every step: each log syncs host and GPU
    "ours_1b_log10": ("1b", {"logging_steps": 10, "torch_compile": True}, 30, 10),
    "hand_1b_log10": ("1b", {**HAND_1B, "logging_steps": 10}, 30, 10),
    "ours_1b_noliger": ("1b", {"liger_kernel": False}, 24, 5),
    "ours_1b_sdpamask": ("1b", {"flash_attn": "sdpa"}, 24, 5),
    "ours_1b_zero2": ("1b", {"zero_stage": 2}, 24, 5),
    "ours_1b_zero1": ("1b", {"zero_stage": 1}, 24, 5),
    # torch.compile recompiles for the first few packed shapes: more warm-up steps
    # Liger's Triton kernels fail under dynamo (liger-kernel 0.8.5, torch 2.11): compile without them
    "ours_1b_compile": ("1b", {"liger_kernel": False, "extra": {"torch_compile": True}}, 30, 12),
    "ours_1b_b500": ("1b", {"zero_bucket_size": 500000000}, 24, 5),
    "ours_1b_ddp": ("1b", {"zero_stage": 0}, 24, 5),
    "ours_1b_bucket100": ("1b", {"extra": {"ddp_bucket_cap_mb": 100}}, 24, 5),
    # ours_1b under torch.profiler (llmft_profile_rank*.txt): where a step's time goes
    "ours_1b_prof": ("1b", {}, 9, 5),
    "recipe_8b": ("8b", RECIPE, 5, 2),
    # the recipe as measured before 0424163: llmft's ZeRO-3 rendering (overlap_comm on), not LF's example
    "recipe_1b_ovl": ("1b", RECIPE, 10, 3),
    "recipe_8b_ovl": ("8b", RECIPE, 5, 2),
    "hand_8b": ("8b", HAND_8B, 10, 3),
    # the hand-tuned run's global batch (1 x 4 x 2 GPUs x 2048 tokens), so the losses compare step by step
    "ours_8b": ("8b", {"tokens_per_step": 16384}, 10, 3),
    # larger ZeRO-2 buckets than the planner's 5e8 elements (fewer, longer collectives)
    "ours_8b_b1e9": ("8b", {"tokens_per_step": 16384, "zero_bucket_size": 1000000000}, 10, 3),
    "ours_8b_b2e9": ("8b", {"tokens_per_step": 16384, "zero_bucket_size": 2000000000}, 10, 3),
    "ours_8b_rc": ("8b", {"tokens_per_step": 16384, "torch_compile": True}, 16, 8),
    "ours_1b_ovf": ("1b", {}, 24, 5),  # ours with DeepSpeed's bf16 overflow pass left on (DS_LF)
    # 2026-11-30, results/sft_h200x2_1b_20261130T2303.json: ours_1b again, second in its call, with
    # an experimental gc.freeze switched off (measured no effect and removed): the default path
    "ours_1b_nogc": ("1b", {}, 24, 5),
    # Untimed warm-ups: ours' first run in a device call compiles Liger's Triton kernels for new batch
    # shapes inside its window (1 B: steps 15 and 23; 8 B: steps 3-4). Run one first, on the same
    # data order, and the measured run finds the kernel cache warm.
    "warm_1b": ("1b", {}, 25, 5),
    "warm_8b": ("8b", {"tokens_per_step": 16384}, 6, 3),
    **FP8_VARIANTS,
}  # fmt: skip
# Where LLaMA-Factory 0.9.5's example DeepSpeed configs differ from llmft's rendering: the recipe and
# hand-tuned runs are LLaMA-Factory as its users run it. Every one keeps DeepSpeed's bf16 overflow
# pass; the recipe names `deepspeed: examples/deepspeed/ds_z3_config.json`, which also turns
# communication overlap off (llmft's ZeRO-3 rendering turns it on; results before 0424163 measured the recipe
# with it on). The hand-tuned 8 B run is ZeRO-2 with overlap_comm on, as rendered.
# Sections replace the rendered ones, except zero_optimization, whose keys are updated.
LF_BF16 = {"bf16": {"enabled": "auto"}}
LF_Z3_EXAMPLE = {**LF_BF16, "zero_optimization": {"overlap_comm": False}}
DS_LF = {n: LF_BF16 for n in VARIANTS if n.startswith(("recipe", "hand"))} | {"ours_1b_ovf": LF_BF16}
DS_LF |= {"recipe_1b": LF_Z3_EXAMPLE, "recipe_8b": LF_Z3_EXAMPLE}


def lf_deepspeed(name: str, ds: dict) -> dict:
    """The rendered DeepSpeed config of variant NAME with LLaMA-Factory's example settings put back."""
    for key, section in DS_LF.get(name, {}).items():
        ds[key] = {**ds.get(key, {}), **section} if key == "zero_optimization" else dict(section)
    return ds


# TORCH_LOGS=recompiles: the compiled runs log each recompilation (warm-up should end them)
# what keeps a hand-tuned run (LORA_HAND) on LLaMA-Factory's own code where llmft's would apply
PLAIN_TOOL_ENV = {"LLMFT_LIGER_CROSS_ENTROPY": "1"}
VARIANT_ENV = {
    "ours_1b_prof": {"LLMFT_PROFILE_STEPS": "6:8"},
    "fp8_lora_prof_8b": {"LLMFT_PROFILE_STEPS": "6:7"},
    "lora_prof_8b": {"LLMFT_PROFILE_STEPS": "6:7"},
    "fp8_full_prof_1b": {"LLMFT_PROFILE_STEPS": "10:11"},
    "fp8_full_static_1b": {"LLMFT_VARLEN_PAD_TO": "16384"},
    "full_bf16c_static_1b": {"LLMFT_VARLEN_PAD_TO": "16384"},
    "full_handliger_1b": {"LLMFT_LIGER_CROSS_ENTROPY": "1"},
    "fp8_full_static_cdt_1b": {
        "LLMFT_VARLEN_PAD_TO": "16384",
        "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1",
    },
    "full_bf16c_prof_1b": {"LLMFT_PROFILE_STEPS": "10:11"},
    "fp8_lora_cpp_8b": {"TORCHINDUCTOR_CPP_WRAPPER": "1"},
    "fp8_lora_devcount_8b": {"LLMFT_DEVICE_TOKEN_COUNT": "1"},
    "fp8_lora_ligerce_8b": {"LLMFT_LIGER_CROSS_ENTROPY": "1"},
    "fp8_lora_ligerce_1b": {"LLMFT_LIGER_CROSS_ENTROPY": "1"},
    "fp8_full_fusedce_1b": {"LLMFT_LIGER_CROSS_ENTROPY": "0"},
    "ours_1b_rc": {"TORCH_LOGS": "recompiles"},
    "ours_8b_rc": {"TORCH_LOGS": "recompiles"},
}


def variant_env(name: str) -> dict:
    """The environment variables variant NAME sets: PLAIN_TOOL_ENV for the hand-tuned LoRA runs
    (LORA_HAND's settings), then VARIANT_ENV's."""
    plain = PLAIN_TOOL_ENV if LORA_HAND.items() <= VARIANTS[name][1].items() else {}
    return {**plain, **VARIANT_ENV.get(name, {})}


def config_for(name: str, max_steps: int) -> dict:
    size, overrides, _, _ = VARIANTS[name]
    sft = {
        "precision": "bf16",
        "learning_rate": 1.0e-5,
        "lr_scheduler_type": "cosine",
        "warmup_ratio": 0.1,
        "logging_steps": 1,
        "save_steps": 100000,
        "max_steps": max_steps,
        "extra": {"eval_strategy": "no", "disable_tqdm": True, "preprocessing_num_workers": 16},
    }
    sft.update({k: v for k, v in overrides.items() if k != "extra"})
    sft["extra"].update(overrides.get("extra", {}))
    gpus = int(os.environ.get("BENCH_GPUS", 2))  # 1 for a diagnostic run on a one-GPU machine
    hw = {"vendor": "cuda", "nodes": 1, "gpus_per_node": gpus, "gpu_model": "h200"}
    if os.environ.get("BENCH_DRY_RUN"):
        # The same path on 2 CPU processes and a tiny model, to catch mistakes before device time;
        # neat packing + varlen are forced since auto keeps them for GPUs.
        hw = {"vendor": "cpu", "nodes": 1, "gpus_per_node": 0, "processes_per_node": 2}
        sft["precision"] = "fp32"
        if name.startswith(("ours", "warm")):
            sft = {"packing": "neat", "flash_attn": "varlen", **sft}
    return {
        "run": "bench",
        "hardware": hw,
        "model": {"name_or_path": str(MODELS / f"llama{size}"), "template": "default"},
        "data": {"sources": [{"path": str(WORK / "data/train.jsonl")}], "cutoff_len": SEQ},
        "sft": sft,
    }


def _smi_sampler(stop: threading.Event, peaks: dict) -> None:
    cmd = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
    while not stop.is_set():
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
            for line in out.strip().splitlines():
                i, used = (int(x) for x in line.split(","))
                peaks[i] = max(peaks.get(i, 0), used)
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
        stop.wait(0.5)


def _wait_gpus_free(limit: float = 30.0) -> None:
    """The next variant must start on idle GPUs: wait for (and end) any process still on them."""
    query = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
    end = time.time() + limit
    while time.time() < end:
        try:
            pids = [int(x) for x in subprocess.run(query, capture_output=True, text=True).stdout.split()]
        except (OSError, ValueError):
            return
        if not pids:
            return
        if time.time() > end - limit / 2:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(1)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def llmft_env(**extra) -> dict:
    """The environment the bench's llmft subprocesses run in: this checkout's llmft first."""
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO / "workflow"), os.environ.get("PYTHONPATH", "")]),
        **extra,
    )


def run_stage(cmd: list[str], rd: Path, stage: str, env: dict) -> dict | None:
    """One llmft stage of a variant, its output in rd/<stage>.log; the failed variant's result, or None."""
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    (rd / f"{stage}.log").write_text(r.stdout + r.stderr)
    if not r.returncode:
        return None
    result = {"name": rd.name, "status": f"{stage} failed", "error": (r.stdout + r.stderr)[-1500:]}
    (rd / "result.json").write_text(json.dumps(result, indent=2))
    return result


def node_facts(out: Path) -> Path:
    """This machine's facts (llmft.env.nodefacts, what verify_env records on each node), once per call:
    the plans are made from them, as the workflow makes them from verify.json. BENCH_FACTS names a
    recorded file instead (a render check on another machine)."""
    if os.environ.get("BENCH_FACTS"):
        return Path(os.environ["BENCH_FACTS"])
    path = out / "facts.json"
    if not path.exists():
        cmd = [sys.executable, "-m", "llmft.env.nodefacts", "--out", str(path)]  # imports all: Liger too
        subprocess.run(cmd, capture_output=True, text=True, env=llmft_env(), cwd=REPO, timeout=300)
        facts = json.loads(path.read_text())
        if os.environ.get("BENCH_CANARY"):
            facts["canary"] = _canary(out, path)
        if facts.get("devices"):
            # The device machine's memory is a balloon that grows as it is used: MemTotal reads low
            # at first. Its lent size (128 GiB) is what a job can fill.
            facts["host_memory_gib"] = max(facts.get("host_memory_gib") or 0, 125.0)
        path.write_text(json.dumps(facts))
    return path


def _canary(out: Path, facts: Path) -> dict:
    """The numerics canary verify_env runs on a node, with its FP8 leg (sft.fp8: auto), so that the
    plans' `auto` decides FP8 from it as the workflow does."""
    result = out / "canary.json"
    cfg = json.dumps({"hardware": {"gpus_per_node": 1}, "sft": {"fp8": "auto", "precision": "bf16"}})
    cmd = [sys.executable, "-m", "llmft.env.canary", "--facts", str(facts), "--config-json", cfg]
    proc = subprocess.run([*cmd, "--out", str(result)], capture_output=True, text=True, env=llmft_env(),
                          cwd=REPO, timeout=600)  # fmt: skip
    if proc.returncode != 0 or not result.exists():
        return {"ok": False, "message": f"canary failed: {proc.stderr[-800:]}"}
    return json.loads(result.read_text())


def render_cmd(cfg_path: Path, base_model: Path | str, facts: Path, data_dir: Path, rd: Path, *extra) -> list:
    """A variant's `llmft render-sft`: its YAML and DeepSpeed JSON in rd, its work folder under RUNS."""
    cmd = [sys.executable, "-m", "llmft", "render-sft", *extra, "--config", str(cfg_path)]
    cmd += ["--base-model", str(base_model), "--verify", str(facts), "--data-dir", str(data_dir)]
    cmd += ["--out-yaml", str(rd / "llamafactory.yaml"), "--out-deepspeed", str(rd / "deepspeed.json")]
    return cmd + ["--work-root", str(RUNS)]


def train_until(
    launch: list, rd: Path, work: Path, steps: int, env: dict, deadline: float, to_end=False
) -> str:
    """Run a variant's `sft launch` (output in rd/train.log) until step `steps`'s loss is in
    llmft_steps.jsonl, then stop it before the final save (not part of training throughput); to_end:
    let it finish. The status: ok, exited (finished first), failed rc=N, or timeout (past deadline)."""
    with open(rd / "train.log", "w") as log:
        proc = subprocess.Popen(
            launch, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
        status = "timeout"
        while time.time() < deadline:
            if proc.poll() is not None:
                status = "exited" if proc.returncode == 0 else f"failed rc={proc.returncode}"
                break
            done = [
                e for e in _read_jsonl(work / "llmft_steps.jsonl") if e.get("step") == steps and "loss" in e
            ]
            if done and not to_end:
                time.sleep(2)  # LLaMA-Factory's log thread writes trainer_log.jsonl
                status = "ok"
                break
            time.sleep(0.5)
        if proc.poll() is None:
            # torchrun puts its workers in sessions of their own: kill the whole tree, not the group.
            for pid in [*worker_pids(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            proc.wait()
    return status


def run_variant(name: str, out: Path, max_steps: int | None, timeout: int) -> dict:
    size, _, default_steps, _ = VARIANTS[name]
    steps = max_steps or int(os.environ.get("BENCH_MAX_STEPS", 0)) or default_steps
    rd = out / name
    rd.mkdir(parents=True, exist_ok=True)
    cfg_path = rd / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config_for(name, steps), sort_keys=False))
    py = sys.executable
    common = ["--config", str(cfg_path)]
    render = render_cmd(cfg_path, MODELS / f"llama{size}", node_facts(out), WORK / "data", rd)
    env = llmft_env(**variant_env(name))
    t0 = time.time()
    failed = run_stage(render, rd, "render", env)
    if failed:
        return failed
    # the pack_data stage: pack the tokenized rows for this YAML, as the workflow does before sft
    pack = [
        py,
        "-m",
        "llmft",
        "pack-data",
        "--yaml",
        str(rd / "llamafactory.yaml"),
        "--data-dir",
        str(WORK / "data"),
    ]
    pack += ["--tokenizer", str(WORK / "tok"), "--stamp-out", str(rd / "packed.json")]
    failed = run_stage(pack, rd, "pack", env)
    if failed:
        return failed
    args = yaml.safe_load((rd / "llamafactory.yaml").read_text())
    if name in LF_YAML or name in LLMFT_YAML:
        args.update(LF_YAML.get(name, {}))
        args["llmft"].update(LLMFT_YAML.get(name, {}))
        (rd / "llamafactory.yaml").write_text(yaml.safe_dump(args, sort_keys=False))
    if name in DS_LF and args.get("deepspeed"):
        ds = lf_deepspeed(name, json.loads(Path(args["deepspeed"]).read_text()))
        Path(args["deepspeed"]).write_text(json.dumps(ds, indent=2))
    work = Path(args["output_dir"])
    subprocess.run(["rm", "-rf", str(work)])
    launch = [py, "-m", "llmft", "sft", "launch", *common, "--yaml", str(rd / "llamafactory.yaml")]
    peaks: dict = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_smi_sampler, args=(stop, peaks), daemon=True)
    sampler.start()
    status = train_until(launch, rd, work, steps, env, t0 + timeout, to_end=name in RUN_TO_END)
    _wait_gpus_free()
    stop.set()
    sampler.join(timeout=5)
    profiles = [p.name for p in work.glob("llmft_profile_rank*.txt")]
    for f in ("llmft_steps.jsonl", "trainer_log.jsonl", "llmft_divergence.json", "llmft_fp8.json", *profiles):
        if (work / f).exists():
            (rd / f).write_text((work / f).read_text())
    for trace in work.glob("llmft_trace_rank*.json.gz"):
        shutil.copy(trace, rd / trace.name)
    subprocess.run(["rm", "-rf", str(work)])
    result = {"name": name, "status": status, "wall_s": round(time.time() - t0, 1), "smi_peak_mib": peaks}
    if status != "ok":
        result["error"] = (rd / "train.log").read_text()[-3000:]
    (rd / "result.json").write_text(json.dumps(result, indent=2))
    return result


def _throughput(steps: list[dict], skip: int) -> tuple[float, int, float]:
    timing = [e for e in steps if "time" in e]
    last = timing[-1]
    skip = min(skip, last["step"] - 1)
    first = next((e for e in timing if e["step"] == skip), timing[0])
    tokens = last["tokens"] - first["tokens"]
    seconds = last["time"] - first["time"]
    return tokens / seconds, last["step"] - first["step"], seconds


def step_stats(steps: list[dict], skip: int, world: int, tps_gpu: float, mfu: float) -> dict:
    """Per-step view of a run: each step's seconds, and the median step's tokens/s/GPU and MFU.

    The window mean (tokens_per_s_per_gpu) charges one-time costs inside the window to the run: the
    first run of a device call compiles Liger's Triton kernels for each new flattened batch shape
    (0.1-0.4 s at a few steps; later runs in the call find them in the kernel cache). The median
    step is what a long job runs at; both are reported."""
    timing = [e for e in steps if "time" in e]
    pairs = list(zip(timing, timing[1:], strict=False))
    window = [(a, b) for a, b in pairs if a["step"] >= skip]
    rates = [(b["tokens"] - a["tokens"]) / (b["time"] - a["time"]) / world for a, b in window]
    if not rates:
        return {}
    median = statistics.median(rates)
    return {
        "step_seconds": {b["step"]: round(b["time"] - a["time"], 3) for a, b in pairs},
        "median_step_tokens_per_s_per_gpu": round(median, 1),
        "median_step_mfu": round(mfu * median / tps_gpu, 4) if tps_gpu else None,
    }


def triton_compiles(cache: Path) -> list[dict]:
    """Every kernel in Triton's on-disk cache: when it was compiled (the metadata file's mtime), its
    name and its specialised signature (the `tt.func` line of its TTIR: which integer arguments were
    taken as divisible by 16 or equal to 1). A kernel compiled in a run sits between two of its steps."""
    found = []
    for meta in cache.glob("*/*.json"):
        if meta.name.startswith("__grp__"):
            continue
        ttir = meta.with_suffix(".ttir")
        sig = ""
        if ttir.exists():
            sig = next((ln.strip() for ln in ttir.read_text().splitlines() if "tt.func" in ln), "")
        found.append({"time": meta.stat().st_mtime, "kernel": meta.stem, "signature": sig})
    return sorted(found, key=lambda k: k["time"])


def compiles_by_step(steps: list[dict], compiles: list[dict]) -> dict:
    """{step: [kernel, ...]} for the kernels compiled while that step ran (after the previous one)."""
    timing = [e for e in steps if "time" in e]
    by_step: dict = {}
    for a, b in zip(timing, timing[1:], strict=False):
        names = [k["kernel"] for k in compiles if a["time"] < k["time"] <= b["time"]]
        if names:
            by_step[b["step"]] = names
    return by_step


def run_flops(args: dict, model_dir: Path, lengths: list[int]) -> flops.FlopCount:
    """Training FLOPs per token of a run from its model's config, its LLaMA-Factory arguments and its
    train rows' token lengths; the span each token attends over is its sample (unpacked, neat
    packing) or the whole pack (plain packing)."""
    shape = model_shape(model_dir)
    packed = args.get("packing") and not args.get("neat_packing")
    context = float(args.get("cutoff_len") or SEQ) if packed else flops.span_of_lengths(lengths)
    return flops.per_token(shape, context, flops.tuning_of(args, shape))


def summarise(out: Path, name: str, lengths: list[int], compiles: list[dict] | None = None) -> dict:
    rd = out / name
    size, _, _, skip = VARIANTS[name]
    base = (
        json.loads((rd / "result.json").read_text())
        if (rd / "result.json").exists()
        else {"status": "not run"}
    )
    res = {"name": name, "size": size, **base}
    steps = _read_jsonl(rd / "llmft_steps.jsonl")
    if sum("time" in e for e in steps) < 2:
        return res
    args = yaml.safe_load((rd / "llamafactory.yaml").read_text())
    plan = args["llmft"]["plan"]
    shape = model_shape(MODELS / f"llama{size}")
    tps, n_steps, seconds = _throughput(steps, skip)
    tps_gpu = tps / plan["world_size"]
    count = run_flops(args, MODELS / f"llama{size}", lengths)
    context = count.span
    peak = hardware.GPUS["h200"].peak_bf16_tflops
    log = _read_jsonl(rd / "trainer_log.jsonl")
    vram = max((e.get("vram_allocated", 0) for e in log), default=0) or None
    reserved = max((e.get("vram_reserved", 0) for e in log), default=0) or None
    predicted = plan["memory"]["peak"]
    res.update(
        {
            "params": shape.params,
            "settings": {
                "world_size": plan["world_size"],
                "zero_stage": plan["zero_stage"],
                "micro_batch": plan["micro_batch"],
                "gradient_accumulation": plan["gradient_accumulation"],
                "tokens_per_step": plan["tokens_per_step"],
                "gradient_checkpointing": plan["gradient_checkpointing"],
                "packing": plan["packing"],
                "attention": plan["attention"],
                "liger": plan["liger"],
                "buckets": plan["buckets"],
            },
            "measured_steps": n_steps,
            "measured_seconds": round(seconds, 2),
            "tokens_per_s_per_gpu": round(tps_gpu, 1),
            "attention_context_tokens": round(context, 1),
            "flops_per_token": round(count.total),
            "mfu": round(flops.mfu(tps_gpu, count.total, peak), 4),
            "peak_vram_allocated_gib": vram,
            "peak_vram_reserved_gib": reserved,
            "predicted_peak_gib": predicted,
            "prediction_error": round((predicted - vram) / vram, 3) if vram else None,
            "loss": {e["step"]: round(e["loss"], 4) for e in steps if "loss" in e},
        }
    )
    res.update(step_stats(steps, skip, plan["world_size"], tps_gpu, res["mfu"]))
    if compiles is not None:
        res["triton_compiles_by_step"] = compiles_by_step(steps, compiles)
    return res


def report(out: Path, json_path: Path | None, command: str) -> dict:
    def load(name):
        try:
            return json.loads((out / name).read_text())
        except (OSError, ValueError):
            return None

    lengths = json.loads((WORK / "lengths.json").read_text())
    compiles = load("triton_compiles.json")
    runs = {name: summarise(out, name, lengths, compiles) for name in VARIANTS if (out / name).exists()}
    for name, r in runs.items():
        size = r["size"]
        group = "lora_" if name.startswith("lora_") else ""  # LoRA runs compare with LoRA runs
        for ref in ("recipe", "hand"):
            other = runs.get(f"{group}{ref}_{size}", {})
            key = "speedup_vs_recipe" if ref == "recipe" else "speedup_vs_hand_tuned"
            for prefix in ("", "median_step_"):  # window mean, then median step
                rate, other_rate = (
                    r.get(prefix + "tokens_per_s_per_gpu"),
                    other.get(prefix + "tokens_per_s_per_gpu"),
                )
                if rate and other_rate:
                    r[prefix + key] = round(rate / other_rate, 2)
        hand = runs.get(f"{group}hand_{size}", {})
        if name.startswith(f"{group}ours") and r.get("loss") and hand.get("loss"):
            common = [s for s in r["loss"] if s in hand["loss"]]
            diffs = [abs(r["loss"][s] - hand["loss"][s]) / hand["loss"][s] for s in common]
            r["loss_vs_hand_tuned"] = {
                "steps": len(common),
                "max_rel_diff": round(max(diffs), 4) if diffs else None,
                "mean_rel_diff": round(sum(diffs) / len(diffs), 4) if diffs else None,
            }

    doc = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "machine": load("env.json"),
        "varlen_check": load("varlen_check.json"),
        "peak_tflops": hardware.GPUS["h200"].peak_bf16_tflops,
        "runs": runs,
    }
    cols = ["name", "status", "tokens_per_s_per_gpu", "mfu", "speedup_vs_recipe", "speedup_vs_hand_tuned"]
    cols += ["peak_vram_allocated_gib", "predicted_peak_gib", "prediction_error"]
    print(" | ".join(cols))
    for r in runs.values():
        print(" | ".join(str(r.get(c, "")) for c in cols))
    if json_path:
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def token_lengths(data_dir: Path, tokenizer: str, template: str = "default") -> list[int]:
    """Tokens of each train row as LLaMA-Factory's template encodes it (prompt + answer), row by row:
    not prepare_data's batched encoder, so the two counts check each other."""
    from llmft.core.lf.pretokenize import load_tokenizer_and_template, messages_of

    tok, tmpl = load_tokenizer_and_template(tokenizer, template)
    out = []
    for line in (data_dir / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        prompt, answer = tmpl.encode_oneturn(tok, messages_of(row), row.get("system") or None)
        out.append(len(prompt) + len(answer))
    return out


def _rel_err(got, ref) -> float:
    """|got - ref| / |ref|, with GOT taken to REF's dtype and device first."""
    return float((got.to(ref) - ref).norm() / ref.norm())


def _record(path: Path, res: dict) -> dict:
    """A GPU check's result: written to PATH and printed as one JSON line (the driver log's)."""
    path.write_text(json.dumps(res, indent=2))
    print(json.dumps(res))
    return res


def check_varlen(out: Path) -> dict:
    """The GPU kernel against the per-sample SDPA reference in fp32: outputs and gradients."""
    import torch
    from llmft.core import varlen

    torch.manual_seed(0)
    b, t, h, kv, d = 2, 1024, 32, 8, 64
    seg = torch.zeros(b, t, dtype=torch.long)
    for row in range(b):
        pos, idx = 0, 1
        while pos < t - 40:
            n = int(torch.randint(16, 400, ()).item())
            seg[row, pos : pos + n] = idx
            pos, idx = pos + n, idx + 1
    _, cu, max_len = varlen.segments_to_varlen(seg)
    q, k, v = (torch.randn(b, n, t, d, device="cuda", dtype=torch.bfloat16) for n in (h, kv, kv))
    kwargs = {"cu_seq_lens_q": cu.cuda(), "max_length_q": max_len}
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out_gpu, _ = varlen.attention(None, *leaves, None, scaling=d**-0.5, **kwargs)
    grad = torch.randn_like(out_gpu)
    out_gpu.backward(grad)
    ref_leaves = [x.detach().float().cpu().requires_grad_() for x in (q, k, v)]
    out_ref, _ = varlen.attention(None, *ref_leaves, None, scaling=d**-0.5, **{**kwargs, "cu_seq_lens_q": cu})
    out_ref.backward(grad.float().cpu())

    res = {
        "available": varlen.available(),
        "output_rel_err": _rel_err(out_gpu.detach(), out_ref.detach()),
        "grad_rel_err": [_rel_err(a.grad, r.grad) for a, r in zip(leaves, ref_leaves, strict=True)],
    }
    res["ok"] = res["output_rel_err"] < 2e-2 and max(res["grad_rel_err"]) < 2e-2
    return _record(out / "varlen_check.json", res)


def check_fusedce(out: Path) -> dict:
    """llmft.sft.fusedce's compiled GPU path in bf16 at the 8 B head's shape against float64 on the
    materialised logits: the loss and the gradients of the input and the weight."""
    import torch
    from llmft.sft import fusedce

    torch.manual_seed(0)
    rows, hidden, vocab = 2048, 4096, 128256
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device="cuda") / hidden**0.5).bfloat16()
    t = torch.randint(0, vocab, (rows,), device="cuda")
    t[::7] = -100
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    loss = fusedce.fused_linear_cross_entropy(*leaves, t, reduction="sum")
    (loss / 1000).backward()
    ref = [a.detach().double().requires_grad_() for a in (x, w)]
    want = torch.nn.functional.cross_entropy(ref[0] @ ref[1].t(), t, reduction="sum")
    (want / 1000).backward()

    res = {
        "loss_rel_err": abs(float(loss) - float(want)) / abs(float(want)),
        "grad_rel_err": [_rel_err(a.grad, r.grad) for a, r in zip(leaves, ref, strict=True)],
    }
    res["ok"] = res["loss_rel_err"] < 1e-3 and max(res["grad_rel_err"]) < 2e-2
    return _record(out / "fusedce_check.json", res)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("lengths")
    p.add_argument("data_dir")
    p.add_argument("tokenizer")
    p = sub.add_parser("run")
    p.add_argument("name", choices=sorted(VARIANTS))
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--timeout", type=int, default=300)
    p = sub.add_parser("check-varlen")
    p.add_argument("--out", required=True)
    p = sub.add_parser("check-fusedce")
    p.add_argument("--out", required=True)
    p = sub.add_parser("triton-compiles")
    p.add_argument("--out", required=True)
    p = sub.add_parser("report")
    p.add_argument("out")
    p.add_argument("--json", default=None)
    p.add_argument("--command", default="")
    args = parser.parse_args()
    if args.cmd == "lengths":
        lengths = token_lengths(Path(args.data_dir), args.tokenizer)
        (WORK / "lengths.json").write_text(json.dumps(lengths))
        print(f"{len(lengths)} rows, mean {sum(lengths) / len(lengths):.1f} tokens")
    elif args.cmd == "run":
        print(json.dumps(run_variant(args.name, Path(args.out), args.max_steps, args.timeout))[:2000])
    elif args.cmd == "triton-compiles":
        cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton/cache")
        found = triton_compiles(cache)
        Path(args.out).write_text(json.dumps(found, indent=1))
        print(f"{len(found)} Triton kernels in {cache}")
    elif args.cmd == "check-varlen":
        check_varlen(Path(args.out))
    elif args.cmd == "check-fusedce":
        check_fusedce(Path(args.out))
    else:
        report(Path(args.out), Path(args.json) if args.json else None, args.command or shlex.join(sys.argv))


if __name__ == "__main__":
    main()
