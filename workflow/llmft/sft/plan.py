"""Will it fit? Per-GPU memory for an SFT config, and the settings the pipeline picks for `auto`.

The estimate adds up what LLaMA-Factory + DeepSpeed keep on each GPU for full (or LoRA/freeze)
fine-tuning with AdamW, in two phases whose larger value is the peak:

- backward: weights, gradients, optimizer states (sharded by ZeRO), communication buckets, and the
  activations of one micro-batch (all layers, or only layer inputs plus one layer under gradient
  checkpointing), the loss over the vocabulary, and neat packing's 4-D mask where SDPA needs it;
- optimizer step: the same states with activations freed, plus the fp32 gradient copy that
  DeepSpeed makes for the step.

Byte counts per element follow what the code really holds: LLaMA-Factory upcasts trainable weights
to fp32 unless ZeRO-3 is on, DeepSpeed runs the model in 16 bit with fp32 master weights, and plain
DDP under autocast keeps an fp32 residual stream. The activation constants (bytes per token per
layer) were counted from transformers' Llama modules and checked against measured peaks
(bench/results/sft_*.json records prediction against measurement).

`resolve` turns the `auto` values of the `sft` config section into concrete settings, lowest
communication first (plain DDP, then ZeRO-2, then ZeRO-3, then ZeRO-3 with CPU offload; on several
GPUs in 16 bit ZeRO-2 comes first, being faster than DDP there), and
refuses a config that cannot fit with a ConfigError that names the keys to change.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llmft.core import flops, fp8
from llmft.core.config import ConfigError
from llmft.core.objective import PADFREE_CHUNK, SFT, Objective
from llmft.core.platform import Platform, choose_attention
from llmft.core.settings import Config, Sft, replace
from llmft.core.shape import ModelShape, model_shape
from llmft.sft.steptime import StepTime, offload_host_gib, step_time

GIB = 1024**3
# DeepSpeed ZeRO-3's sub_group_size, as llmft.sft writes it: elements per optimizer sub-group.
ZERO3_SUB_GROUP = 1_000_000_000
# Share of a GPU's memory a plan may fill: the rest is the CUDA/HIP context, NCCL buffers and the
# caching allocator's slack, none of which torch.cuda.max_memory_allocated() counts.
USABLE_FRACTION = 0.90
CONTEXT_GIB = 1.0
# Share of a node's host memory that ZeRO-3 CPU offload may fill: the rest is the OS, the data
# loaders and pinned-buffer slack.
HOST_USABLE_FRACTION = 0.8
# Model families whose modules Liger kernels replace (LLaMA-Factory's own list, the common part).
LIGER_MODEL_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "granite"}

# Saved activation bytes per token and layer, as (per hidden unit, per MLP unit, per KV unit).
# "half": DeepSpeed runs the whole model in bf16/fp16 (RMSNorm still saves fp32 copies);
# "autocast": plain DDP, fp32 weights and residual stream, bf16 copies saved for each matmul;
# "fp32": no mixed precision (the CPU demo). Liger's fused RMSNorm/SwiGLU/RoPE save less.
ACTIVATION_BYTES = {
    ("half", False): (32, 8, 8),
    ("half", True): (20, 4, 8),
    ("autocast", False): (44, 8, 8),
    ("autocast", True): (32, 4, 8),
    ("fp32", False): (64, 16, 16),
    ("fp32", True): (40, 8, 16),
}
# LoRA without DeepSpeed: LLaMA-Factory loads the frozen base in 16 bit, so the residual stream is
# 16 bit too and autocast's fp32 stream ("autocast" above) is not there: "half"'s bytes per hidden unit
# plus this many, fitted to the stage-0 LoRA peaks on one H200: llmft's compiled plans
# (bench/results/sft_fp8_h200x1_zero{1b,8b}.json, 1.24 B bf16 and FP8, 8 B FP8: planned +1.7 % to
# +6.4 % of measured, against +16 % to +19 % with autocast's table) and the eager hand-tuned runs
# (sft_lora_h200x1_1b.json: 1.24 B, SDPA, planned 3.3 % under; tests/unit/sft/test_plan.py).
LORA_AUTOCAST_EXTRA_PER_HIDDEN = 5
# Loss over the vocabulary per token: bf16 logits, their fp32 upcast and the fp32 gradient
# (LLaMA-Factory/transformers upcast before cross-entropy). Liger's fused linear cross-entropy
# never materialises logits: a chunk of the size of the hidden states instead. Under autocast (plain
# DDP) 6 fits the measured peaks of the hand-tuned 1.24 B DDP runs, where 10 over-predicted them
# (bench/results/sft_h200x2_{1b,compile}.json).
LOGIT_BYTES = {"half": 10, "autocast": 6, "fp32": 12}
# LLaMA-Factory's padded DPO forward keeps more per token and vocabulary entry than sft's loss: the
# fp32 log-softmax of every position (get_batch_logps) beside the upcast, and its gradient. On one H100
# 80 GB the 1.24 B DPO plan at 4 pairs (predicted 68.0 GiB with sft's 10 bytes) ran out of memory asking
# for 7.61 GiB with 71.78 GiB allocated: at least 11.4 GiB over, 5.8 bytes per token and vocabulary
# entry at its 16 k tokens (bench/README.md, DPO). 6 more bytes cover that lower bound.
PADDED_PREFERENCE_EXTRA_BYTES = 6
# LoRA keeps one more hidden-sized bf16 tensor per layer and token than the activation table: fitted
# to the 1.24 B LoRA peaks, which the table alone put up to 6.2 % under (ZeRO-2 23.56 / 23.73 GiB, the
# checkpointed recipe 4.70 GiB; bench/results/sft_lora_h200x1_1b{,_compile}.json). With it, no LoRA run
# of those files is under its measured peak by more than 3.5 % (the planner's rule: never more than
# 5 %); the 8 B ZeRO-2 peaks are over by at most 3.9 %, the hand-tuned DDP runs without checkpointing
# (which the table already over-predicted) by up to 25 %. Which tensor holds it is not traced.
LORA_BYTES_PER_HIDDEN = 2
# FP8 (llmft.core.fp8, torchao float8 tensorwise): while a linear layer computes, the float8 copies of
# its input and of the gradient flowing in (1 byte an element, widest at the MLP: hidden + intermediate
# per token) and of its weight and the weight's transpose (the MLP's, the largest) live beside the bf16
# tensors; the per-tensor scales are a few bytes. Eager, torchao saves the bf16 input for backward and
# casts again, so the saved activations do not change. Compiled (every FP8 plan below ZeRO-3), full
# fine-tuning measured 5.2-5.8 GiB under the bf16 plan at 1.24 B on one H200 (34.52 / 32.38 GiB
# against 40.29 / 37.62, bench/results/sft_fp8_h200x1_{full1b_compile,acc_full}.json), as if the weight
# gradients' saved inputs were their float8 copies: FP8_SAVED_INPUT_BYTES less per element of each
# trained linear layer's input (q/k/v share one, gate/up one; o and down their own: 3 x hidden +
# intermediate a token), 3.5 GiB of those 5.2-5.8 at 1.24 B; the rest is not traced, so the plan stays
# over. LoRA's frozen base weights need no saved input (peaks within 1 % of bf16). Checked against
# every measured FP8 peak by tests/unit/sft/test_plan.py.
FP8_CAST_BYTES = 1
FP8_SAVED_INPUT_BYTES = 1


@dataclass
class Memory:
    """Predicted per-GPU memory in GiB, by component, for both phases of a step."""

    weights: float
    gradients: float
    optimizer: float
    buckets: float
    activations: float
    loss: float
    mask: float
    step_transient: float
    reference: float = 0.0  # a preference stage's frozen reference model (16-bit weights, forward only)

    @property
    def states(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.buckets + self.reference

    @property
    def backward_peak(self) -> float:
        return self.states + self.activations + self.loss + self.mask

    @property
    def step_peak(self) -> float:
        return self.states + self.step_transient

    @property
    def peak(self) -> float:
        return max(self.backward_peak, self.step_peak)


def trainable_params(
    shape: ModelShape,
    finetuning_type: str,
    lora_rank: int = 8,
    lora_target: str | list[str] = "all",
    freeze_trainable_layers: int = 2,
) -> float:
    """Parameters that get gradients and AdamW states: LoRA's adapters (flops.lora_params), freeze's
    |n| whole decoder layers, else every parameter."""
    if finetuning_type == "lora":
        return flops.lora_params(shape, lora_rank, lora_target)
    if finetuning_type == "freeze":
        return min(abs(freeze_trainable_layers), shape.layers) * shape.layer_params
    return shape.params


def sft_trainable_params(shape: ModelShape, sft: Sft) -> float:
    """trainable_params for an sft config section."""
    return trainable_params(
        shape,
        sft.finetuning_type,
        lora_rank=sft.lora_rank,
        lora_target=sft.lora_target,
        freeze_trainable_layers=sft.freeze_trainable_layers,
    )


def _precision_mode(precision: str, stage: int) -> str:
    """How the model computes: fp32 throughout, autocast (plain DDP) or 16 bit (DeepSpeed)."""
    if precision == "fp32":
        return "fp32"
    if stage == 0:
        return "autocast"
    return "half"


def _autocast_states(p: float, t: float, w: int, finetuning_type: str) -> tuple[float, ...]:
    """(weights, grads, optimizer, buckets, step transient) bytes of plain DDP under autocast."""
    # fp32 trainable weights (frozen ones stay 16 bit) + the bf16 copies autocast keeps for
    # backward; fp32 grads, DDP's fp32 bucket copy of them, AdamW's two fp32 moments. Checked
    # against the LoRA runs without DeepSpeed on one H200 (bench/results/sft_lora_h200x1_1b.json).
    # LoRA / freeze: the frozen weights are loaded in 16 bit and autocast needs no copy of them.
    weights = 4 * t + 2 * (p - t) + (2 * p if finetuning_type == "full" else 2 * t)
    grads = 4 * t
    optim = 8 * t
    bucket = 4 * t if w > 1 else 0.0
    transient = 0.0  # fused AdamW updates in place
    return weights, grads, optim, bucket, transient


def _deepspeed_states(
    shape: ModelShape,
    mode: str,
    stage: int,
    p: float,
    t: float,
    w: int,
    offload: bool,
    buckets: tuple[float, float],
) -> tuple[float, ...]:
    """(weights, grads, optimizer, buckets, step transient) bytes under DeepSpeed (or fp32 DDP)."""
    reduce_b, gather_b = buckets
    unit = 4 if mode == "fp32" else 2
    weights = unit * p / (w if stage == 3 else 1)
    grads = unit * t / (w if stage >= 2 else 1)
    # fp32 master copy (only for 16-bit weights) + AdamW's two fp32 moments, sharded by ZeRO.
    optim = ((4 if unit == 2 else 0) + 8) * t / (w if stage >= 1 else 1)
    if offload:
        optim = 0.0
        weights = 0.0 if stage == 3 else weights
    if stage == 3:
        # gathered working set: the prefetch bucket plus the largest module being computed
        largest = max(shape.layer_params, shape.vocab * shape.hidden)
        bucket = unit * (reduce_b + gather_b + 2 * largest)
        # ZeRO-3 steps the optimizer one sub-group at a time: an fp32 gradient copy of at most
        # sub_group_size elements (checked against the 8 B recipe's ZeRO-3 peak, bench/results).
        transient = 0.0 if offload else 4 * min(t / w, ZERO3_SUB_GROUP)
    elif stage in (1, 2):
        # overlap_comm double-buffers the reduce bucket. The step converts the 16-bit gradient
        # partition to fp32 (4 bytes per sharded parameter): the measured 8 B ZeRO-2 step stays
        # under its backward peak (torch's max allocated;
        # bench/results/sft_h200x2_20261130T1715_recipe_vs_auto.json).
        bucket = unit * (2 * reduce_b + gather_b)
        transient = 0.0 if offload else 4 * t / w
    else:
        bucket = unit * t if w > 1 else 0.0
        transient = 0.0
    return weights, grads, optim, bucket, transient


def _activation_bytes(
    shape: ModelShape,
    mode: str,
    t: float,
    tokens: int,
    gradient_checkpointing: bool,
    liger: bool,
    finetuning_type: str,
) -> float:
    """Activations one micro-batch of `tokens` saves for backward."""
    per_d, per_f, per_kv = ACTIVATION_BYTES[(mode, liger)]
    if mode == "autocast" and finetuning_type == "lora":
        per_d = ACTIVATION_BYTES[("half", liger)][0] + LORA_AUTOCAST_EXTRA_PER_HIDDEN
    layer = per_d * shape.hidden + per_f * shape.intermediate + per_kv * shape.kv_dim
    # LoRA on every linear layer keeps every layer's activations: each adapter's input is the frozen
    # weight's input. Freeze (the last layers trainable) runs no backward below them, so the frozen
    # layers keep nothing for it.
    saving = shape.layers
    if finetuning_type == "freeze" and not gradient_checkpointing:
        saving = max(1, min(shape.layers, round(t / max(shape.layer_params, 1))))
    if gradient_checkpointing:
        residual = (2 if mode == "half" else 4) * shape.hidden
        return tokens * (shape.layers * residual + layer)
    return tokens * saving * layer


def estimate(
    shape: ModelShape,
    *,
    stage: int,
    world: int,
    micro_batch: int,
    seq_len: int,
    gradient_checkpointing: bool,
    precision: str = "bf16",
    offload: bool = False,
    liger: bool = False,
    finetuning_type: str = "full",
    neat_mask: bool = False,
    buckets: tuple[float, float] = (5e8, 5e8),
    trainable: float | None = None,
    fp8: bool = False,
    reference: str = "none",
    logits: bool = False,
    padding_free: bool = False,
    compiled: bool = False,
) -> Memory:
    """Per-GPU memory of one configuration (see the module docstring for the model); `trainable`
    overrides trainable_params' defaults (LoRA rank 8 on all linear layers, freeze 2 layers).
    `reference: copy` adds a preference stage's frozen reference model (`cached` adds nothing: its
    log-probabilities are read from the reference step): its weights in the compute
    precision (fp32 in fp32, else 16 bit), sharded by ZeRO-3 (trl's prepare_deepspeed keeps stage 3
    for it and runs any other stage as plain inference), and its fp32 log-probabilities' logits, which
    live beside the policy's. `logits`: the loss needs the logits themselves (a preference loss takes
    log-probabilities of every answer token), so Liger's fused loss saves nothing there.
    `padding_free` (dpo, llmft.preference.padfree): log-probabilities a chunk of PADFREE_CHUNK tokens at a
    time, recomputed in the backward pass: one chunk's logits at a time, the reference's included.
    `compiled`: the decoder layers run under torch.compile (with `fp8`, full fine-tuning saves its
    linear layers' inputs in float8)."""
    p = float(shape.params)
    t = float(trainable_params(shape, finetuning_type) if trainable is None else trainable)
    w = max(1, world)
    mode = _precision_mode(precision, stage)
    if mode == "autocast":
        weights, grads, optim, bucket, transient = _autocast_states(p, t, w, finetuning_type)
    else:
        weights, grads, optim, bucket, transient = _deepspeed_states(
            shape, mode, stage, p, t, w, offload, buckets
        )
    tokens = micro_batch * seq_len
    acts = _activation_bytes(shape, mode, t, tokens, gradient_checkpointing, liger, finetuning_type)
    if finetuning_type == "lora":
        acts += tokens * shape.layers * LORA_BYTES_PER_HIDDEN * shape.hidden
    if fp8:
        widest = shape.hidden + shape.intermediate
        acts += tokens * FP8_CAST_BYTES * widest + 2 * shape.hidden * shape.intermediate
        if compiled and finetuning_type == "full" and not gradient_checkpointing:
            inputs = 3 * shape.hidden + shape.intermediate
            acts -= tokens * shape.layers * FP8_SAVED_INPUT_BYTES * inputs
    loss = tokens * (8 * shape.hidden if liger and not logits else LOGIT_BYTES[mode] * shape.vocab)
    if padding_free:
        loss = min(tokens, PADFREE_CHUNK) * LOGIT_BYTES[mode] * shape.vocab
    elif logits:
        loss += tokens * PADDED_PREFERENCE_EXTRA_BYTES * shape.vocab
    mask = micro_batch * seq_len * seq_len * 2 if neat_mask else 0.0
    ref = 0.0
    if reference == "copy":
        ref = (4 if mode == "fp32" else 2) * p / (w if stage == 3 else 1)
    if reference not in ("none", "cached") and not padding_free:
        loss += tokens * 4 * shape.vocab  # the reference's logits (LoRA's adapter-free pass too)
    return Memory(
        weights=weights / GIB,
        gradients=grads / GIB,
        optimizer=optim / GIB,
        buckets=bucket / GIB,
        activations=acts / GIB,
        loss=loss / GIB,
        mask=mask / GIB,
        step_transient=transient / GIB,
        reference=ref / GIB,
    )


@dataclass
class Plan:
    """Concrete SFT settings for one config, with the memory they are predicted to take."""

    zero_stage: int
    offload: bool
    micro_batch: int
    gradient_accumulation: int
    gradient_checkpointing: bool
    packing: str  # neat | plain | off
    liger: bool
    attention: str  # LLaMA-Factory flash_attn value, or varlen (ours, for neat packing)
    buckets: dict
    gpu: str
    capacity_gib: float
    usable_gib: float
    memory: Memory
    world_size: int
    seq_len: int
    params: int
    reasons: list[str] = field(default_factory=list)
    compile: bool = False  # torch.compile each decoder layer (llmft.sft.train)
    step: StepTime | None = None  # the estimated step time of this plan (steptime.py)
    fp8: bool = False  # torchao float8 on the decoder's linear layers (llmft.core.fp8)
    objective: Objective = SFT  # what a row holds and what LLaMA-Factory trains (llmft.core.objective)
    static_tokens: int = 0  # every micro-batch's flattened row padded to this many tokens (0: off)
    compile_tuning: bool = False  # Inductor tunes each compiled kernel's block sizes (coordinate descent)

    @property
    def predicted_peak_gib(self) -> float:
        return self.memory.peak

    @property
    def sequences_per_row(self) -> int:
        return self.objective.sequences_per_row

    @property
    def reference(self) -> str:
        """The reference model's weights on each GPU: none | forward | copy | cached."""
        return self.objective.reference

    @property
    def group_by_length(self) -> bool:
        return self.objective.group_by_length

    @property
    def padding_free(self) -> bool:
        return self.objective.padding_free

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.sequences_per_row * self.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.tokens_per_micro_batch * self.gradient_accumulation * self.world_size

    def to_json(self) -> dict:
        out: dict = {}
        for key, value in asdict(self).items():
            if key != "objective":
                out[key] = value
            elif self.objective.in_plan:  # what a row holds, where it is not one sft sequence
                out.update(
                    sequences_per_row=self.sequences_per_row,
                    reference=self.reference,
                    group_by_length=self.group_by_length,
                    padding_free=self.padding_free,
                )
        out["memory"] = {k: round(v, 3) for k, v in asdict(self.memory).items()}
        out["memory"].update(
            backward_peak=round(self.memory.backward_peak, 3),
            step_peak=round(self.memory.step_peak, 3),
            peak=round(self.memory.peak, 3),
        )
        out["tokens_per_step"] = self.tokens_per_step
        out["step"] = self.step.to_json() if self.step else None
        if not self.objective.in_plan:  # no reference model to count
            out["memory"].pop("reference")
        return out


def _buckets(setting, shape: ModelShape, stage: int, on_gpu: bool = True) -> dict:
    """DeepSpeed bucket sizes in elements. HF's `auto` sizes them h^2: tiny for big models."""
    if setting == "hf":
        return {"reduce": "auto", "gather": "auto", "persistence": "auto"}
    if setting != "auto":
        size = float(setting)
        return {"reduce": size, "gather": size, "persistence": 10 * shape.hidden}
    if not on_gpu:
        # gloo: no side stream to overlap with, and each message costs ~1 ms however small, so one
        # bucket holds the whole model (h^2 buckets sent the demo's gradients as 20 messages a step,
        # a third of its training time; same losses to the bit).
        size = float(min(5e8, max(1e6, math.ceil(shape.params / 1e6) * 1e6)))
        return {"reduce": size, "gather": size, "persistence": 10 * shape.hidden}
    # ~1/8 of the model per bucket, between 50 M (bandwidth-efficient messages) and 500 M elements
    # (1 GB in bf16: enough to hide behind compute, small enough not to crowd activations).
    size = float(min(5e8, max(5e7, round(shape.params / 8, -6))))
    gather = size if stage != 3 else float(min(5e8, max(5e7, round(shape.params / 16, -6))))
    return {"reduce": size, "gather": gather, "persistence": 10 * shape.hidden}


def _bucket_elems(b: dict) -> tuple[float, float]:
    num = [v if isinstance(v, (int, float)) else 0.0 for v in (b["reduce"], b["gather"])]
    return num[0], num[1]


# A candidate setting: (zero stage, offload, micro-batch rows, gradient checkpointing).
Candidate = tuple[int, bool, int, bool]


def _packing_and_attention(sft: Sft, platform: Platform) -> tuple[str, str, list[str]]:
    """sft's packing and attention kernel, with the reasons for what `auto` chose."""
    on_gpu = platform.on_gpu
    reasons: list[str] = []
    packing = sft.packing_on(on_gpu)
    if sft.packing == "auto":
        reasons.append(
            "packing neat: packed rows without cross-sample attention"
            if on_gpu
            else "packing off: the CPU demo trains row by row"
        )
    attention, why = choose_attention(
        sft.flash_attn, packing, platform.attention, on_gpu, platform.torch, sft.precision
    )
    if why:
        reasons.append(why)
    return packing, attention, reasons


def _zero2_first(sft: Sft, on_gpu: bool) -> bool:
    # GPUs in 16 bit: ZeRO-2 before plain (DDP) training. DeepSpeed runs the model in 16 bit with
    # fp32 master weights in the optimizer (DDP under autocast keeps fp32 weights and residual
    # stream), each GPU updates only its share of the AdamW states, and reduce-scatter + all-gather
    # of 16-bit tensors move half the bytes of DDP's fp32 all-reduce. It is faster than DDP and
    # needs less memory, on one GPU too, where it has nothing to shard (bench/README.md, SFT).
    # Not LoRA: LLaMA-Factory loads its frozen base in 16 bit either way, its adapters are too small
    # to be worth sharding, and DeepSpeed's per-parameter gradient hooks and bucket copies for each
    # small adapter tensor cost more than autocast: compiled, plain training measured 1.15x ZeRO-2 at
    # 1.24 B in bf16 and 1.05x at 8 B in FP8 on one H200 (bench/results/sft_fp8_h200x1_zero{1b,8b}.json).
    return on_gpu and sft.precision in ("bf16", "fp16") and sft.finetuning_type != "lora"


def _stage_options(sft: Sft, on_gpu: bool, world: int) -> list[int]:
    """The ZeRO stages to try, in preference order."""
    if sft.zero_stage != "auto":
        stages = [sft.zero_stage]
    elif _zero2_first(sft, on_gpu):
        stages = [2, 3]
    else:
        stages = [0, 2, 3] if world > 1 else [0, 3]
    if sft.quantization_bit != "none" and not on_gpu:
        # bitsandbytes' CPU backend trains a quantized model only without DeepSpeed.
        stages = [0]
    elif sft.quantization_bit == 8:
        # LLaMA-Factory trains only 4-bit bitsandbytes models under ZeRO-3.
        stages = [s for s in stages if s != 3] or [2]
    return stages


def _offload_options(sft: Sft, on_gpu: bool) -> list[bool]:
    if sft.offload == "auto":
        # On a CPU the "devices" are host memory already: nothing to offload to.
        return [False, True] if on_gpu else [False]
    return [bool(sft.offload)]


def _rows_options(sft: Sft, seq: int, world: int) -> list[int]:
    """Micro-batch sizes (rows of `seq` tokens) to try, largest first."""
    budget_rows = max(1, sft.micro_batch_tokens // seq)
    if sft.per_device_train_batch_size != "auto":
        return [sft.per_device_train_batch_size]
    if sft.gradient_accumulation_steps == "auto":
        # Divisors of the rows each process needs per optimizer step: micro-batch x accumulation
        # then hits sft.tokens_per_step exactly, whatever the hardware.
        per_proc = max(1, sft.tokens_per_step // (seq * world))
        return [r for r in range(min(budget_rows, per_proc), 0, -1) if per_proc % r == 0]
    return list(range(budget_rows, 0, -1))


@dataclass(frozen=True)
class _Space:
    """The settings one config allows on one platform, and how each is costed."""

    sft: Sft
    shape: ModelShape
    platform: Platform
    seq: int
    neat_mask: bool
    bucket_setting: object
    trainable: float
    tuning: flops.Tuning
    fp8: bool = False
    # what a row holds: its sequences, a reference model (none | forward | copy: see estimate and
    # step_time), the logits its loss keeps
    objective: Objective = SFT

    @property
    def seqs(self) -> int:
        return self.objective.sequences_per_row

    @property
    def world(self) -> int:
        return self.platform.world_size

    def candidates(self):
        """Every setting allowed by the config, in the order that breaks ties (less first)."""
        on_gpu = self.platform.on_gpu
        gcs = [self.sft.gradient_checkpointing]
        if self.sft.gradient_checkpointing == "auto":
            gcs = [False, True]
        for gc in gcs:
            for stage in _stage_options(self.sft, on_gpu, self.world):
                for offload in _offload_options(self.sft, on_gpu):
                    if offload and stage != 3:
                        continue
                    for rows in _rows_options(self.sft, self.seq * self.seqs, self.world):
                        yield stage, offload, rows, gc

    def liger(self, stage: int) -> bool:
        if self.sft.liger_kernel != "auto":
            return bool(self.sft.liger_kernel)
        # ZeRO-3 gathers weights in module hooks, which Liger's fused loss bypasses.
        return (
            self.platform.on_gpu
            and stage < 3
            and self.shape.model_type in LIGER_MODEL_TYPES
            and self.platform.liger
        )

    def buckets(self, stage: int) -> dict:
        return _buckets(self.bucket_setting, self.shape, stage, self.platform.on_gpu)

    def accumulation(self, rows: int) -> int:
        if self.sft.gradient_accumulation_steps != "auto":
            return self.sft.gradient_accumulation_steps
        return max(1, math.ceil(self.sft.tokens_per_step / (rows * self.seqs * self.seq * self.world)))

    def memory(self, cand: Candidate) -> Memory:
        stage, offload, rows, gc = cand
        return estimate(
            self.shape,
            stage=stage,
            world=self.world,
            micro_batch=rows * self.seqs,
            seq_len=self.seq,
            gradient_checkpointing=gc,
            precision=self.sft.precision,
            offload=offload,
            liger=self.liger(stage),
            finetuning_type=self.sft.finetuning_type,
            neat_mask=self.neat_mask,
            buckets=_bucket_elems(self.buckets(stage)),
            trainable=self.trainable,
            fp8=self.fp8,
            reference=self.objective.reference,
            logits=self.objective.logits,
            padding_free=self.objective.padding_free,
            compiled=_compiles(self.sft, stage, self.platform, self.fp8),
        )

    def step(self, cand: Candidate) -> StepTime:
        stage, offload, rows, gc = cand
        return step_time(
            self.shape,
            self.platform,
            stage=stage,
            offload=offload,
            micro_batch=rows * self.seqs,
            seq_len=self.seq,
            accumulation=self.accumulation(rows),
            gradient_checkpointing=gc,
            trainable=self.trainable,
            precision=self.sft.precision,
            tuning=self.tuning,
            fp8=self.fp8,
            reference=self.objective.reference,
        )

    def host_need(self, cand: Candidate) -> float | None:
        """Host memory per node the candidate's CPU offload holds, when it exceeds the usable share."""
        if cand[1] and self.platform.host_memory_gib:
            need = offload_host_gib(self.shape.params, self.trainable, self.platform.nodes)
            if need > HOST_USABLE_FRACTION * self.platform.host_memory_gib:
                return need
        return None


def _evaluate(space: _Space, usable: float) -> tuple[list, list[float], tuple[float, Candidate] | None]:
    """(fitting as (step time, candidate, memory) in candidate order, host memory of candidates
    refused for offload, the smallest peak of any candidate)."""
    smallest: tuple[float, Candidate] | None = None
    fitting, host_refused = [], []
    for cand in space.candidates():
        m = space.memory(cand)
        if smallest is None or m.peak < smallest[0]:
            smallest = (m.peak, cand)
        if m.peak > usable:
            continue
        need = space.host_need(cand)
        if need is not None:
            host_refused.append(need)
            continue
        fitting.append((space.step(cand), cand, m))
    return fitting, host_refused, smallest


def _fastest(fitting: list) -> tuple[StepTime, Candidate, Memory]:
    # Fastest first; among equals (within 1 %) the earlier candidate: less recompute, less sharding.
    best = max(est.tokens_per_s_per_gpu for est, _, _ in fitting)
    return next(f for f in fitting if f[0].tokens_per_s_per_gpu >= 0.99 * best)


def _stage_reason(stage: int, zero2_first: bool, world: int, lora_on_gpu: bool = False) -> str:
    if stage == 0 and lora_on_gpu:
        return (
            "zero_stage 0: LoRA's 16-bit base fits whole on each GPU and its adapters are too small to "
            "shard; plain training skips DeepSpeed's per-parameter hooks (1.15x ZeRO-2 at 1.24 B, "
            "1.05x at 8 B, one H200)"
        )
    if not zero2_first:
        why2 = "states need sharding, weights fit whole"
    elif world > 1:
        why2 = "16-bit compute with sharded AdamW states, faster than plain DDP on GPUs"
    else:
        why2 = "16-bit compute, fp32 master weights: faster than autocast on a GPU"
    return {
        0: "zero_stage 0: the whole model and its AdamW states fit on each GPU (plain DDP)",
        2: f"zero_stage 2: {why2}",
        3: "zero_stage 3: even the 16-bit weights need sharding",
    }[stage]


def _batch_reasons(sft: Sft, rows: int, accum: int, seq: int) -> list[str]:
    out = []
    if sft.gradient_accumulation_steps == "auto":
        out.append(f"gradient_accumulation {accum}: >= {sft.tokens_per_step} tokens per optimizer step")
    if sft.per_device_train_batch_size == "auto":
        out.append(f"micro-batch {rows} x {seq} tokens: the fastest estimate within the budget that fits")
    return out


def resolve(
    cfg: Config,
    model_dir: str | Path,
    platform: Platform,
    shape: ModelShape | None = None,
    objective: Objective = SFT,
) -> Plan:
    """Concrete settings for every `auto` in cfg.sft, checked against the devices' memory, for the
    stage's training `objective` (sft's by default): the sequences a row holds, a resident reference
    model, the logits its loss keeps."""
    sft = cfg.sft
    shape = shape or model_shape(model_dir)
    world = platform.world_size
    seq = cfg.data.cutoff_len
    gpu, capacity = platform.gpu, platform.device_memory_gib
    usable = capacity * USABLE_FRACTION - CONTEXT_GIB
    on_gpu = platform.on_gpu
    packing, attention, reasons = _packing_and_attention(sft, platform)
    use_fp8, fp8_why = fp8.decide(sft, platform, shape.hidden)
    reasons.append(fp8_why)
    reasons.extend(objective.reasons)
    space = _Space(
        sft=sft,
        shape=shape,
        platform=platform,
        seq=seq,
        neat_mask=packing == "neat" and attention in ("sdpa", "disabled", "auto"),
        bucket_setting=sft.zero_bucket_size,
        trainable=float(sft_trainable_params(shape, sft)),
        tuning=flops.tuning_of({"finetuning_type": sft.finetuning_type, **sft.finetuning_args}, shape),
        fp8=use_fp8,
        objective=objective,
    )
    fitting, host_refused, smallest = _evaluate(space, usable)
    if not fitting:
        if host_refused:
            raise ConfigError(_host_refusal(shape, platform, min(host_refused)))
        raise ConfigError(_refusal(cfg, shape, gpu, usable, smallest, seq, objective))
    estimate_, chosen, memory = _fastest(fitting)
    stage, offload, rows, gc = chosen
    if sft.zero_stage == "auto":
        lora_on_gpu = on_gpu and sft.finetuning_type == "lora"
        reasons.append(_stage_reason(stage, _zero2_first(sft, on_gpu), world, lora_on_gpu))
    reasons.extend(_tradeoffs(sft, fitting, chosen, estimate_, host_refused, platform))
    accum = space.accumulation(rows)
    reasons.extend(_batch_reasons(sft, rows, accum, seq))
    compiled = _use_compile(sft, stage, platform, use_fp8)
    if use_fp8 and sft.fp8 == "auto" and _full_weights(sft) and not compiled:
        return _eager_fp8_off(cfg, model_dir, platform, shape, objective, stage)
    static_tokens, static_why = _static_shapes(sft, compiled, use_fp8, packing, attention, rows * seq)
    tuning, tuning_why = _compile_tuning(sft, compiled, use_fp8)
    reasons.extend(r for r in (static_why, tuning_why) if r)
    return Plan(
        zero_stage=stage,
        offload=offload,
        micro_batch=rows,
        gradient_accumulation=accum,
        gradient_checkpointing=gc,
        packing=packing,
        liger=space.liger(stage),
        attention=attention,
        buckets=space.buckets(stage),
        gpu=gpu,
        capacity_gib=round(capacity, 2),
        usable_gib=round(usable, 2),
        memory=memory,
        world_size=world,
        seq_len=seq,
        params=shape.params,
        reasons=reasons,
        compile=compiled,
        step=estimate_,
        fp8=use_fp8,
        objective=objective,
        static_tokens=static_tokens,
        compile_tuning=tuning,
    )


def _eager_fp8_off(cfg: Config, model_dir, platform, shape, objective, stage: int) -> Plan:
    """sft.fp8 auto whose plan does not compile: trained float8 layers pay off compiled only (eager
    0.49x bf16), so the run is planned in bf16, saying why."""
    sft = cfg.sft
    plan = resolve(replace(cfg, "sft.fp8", False), model_dir, platform, shape, objective)
    plan.reasons = [r for r in plan.reasons if r != fp8.OFF_REASON] + [
        f"sft.fp8: auto -> off: the plan's decoder layers do not compile (ZeRO-{stage}, "
        f"sft.torch_compile {str(sft.torch_compile).lower()}), and eager float8 on trained "
        "weights measured 0.49x bf16 (full 1.24 B, one H200)"
    ]
    return plan


# Measured on one H200, full fine-tuning of the 1.24 B Llama with compiled decoder layers, ZeRO-2,
# micro-batch 8 x 2048, on one data set (bench/README.md, FP8, 2026-12-04, 34f2112): tokens/s over steps 13-16
# (llmft_steps.jsonl), FP8 63 492 with the rows' own lengths (the layers recompiled as dynamic-shape
# graphs; sft_fp8_h200x1_proffull1b, after its profiled steps) against 67 416 padded to one shape
# (sft_fp8_h200x1_static1b), and bf16 64 892 against 64 369: one shape pays off in FP8 only.
# Inductor's kernel tuning on top of FP8's one shape: 71 794 against 66 036 tokens/s (the bench's
# steady-state figures, sft_fp8_h200x1_cdt1b). LoRA was not measured with either.
STATIC_WHY = (
    "full 1.24 B FP8 on one H200, compiled: 67 416 tokens/s against 63 492 with the rows' own lengths"
)
TUNING_WHY = "full 1.24 B FP8 on one H200: 71 794 tokens/s against 66 036 untuned (1.09x)"


def _full_weights(sft: Sft) -> bool:
    return sft.finetuning_type in ("full", "freeze")


def _compiled_setting(sft: Sft, key: str, applies: bool, needs: str, auto_on: bool, auto_off: str = ""):
    """(on, how: "<key> auto -> on" | "<key> true" | why auto left it off, or "") for a setting of
    the compiled layers (sft.static_shapes, sft.compile_tuning): `true` where it cannot apply is
    refused naming the key and what it `needs`; `auto` follows `auto_on`."""
    setting = getattr(sft, key)
    if setting is True and not applies:
        raise ConfigError(f"config key sft.{key}: true needs {needs}; set sft.{key} to auto or false")
    if setting is False or not applies:
        return False, ""
    if setting == "auto" and not auto_on:
        return False, auto_off
    return True, f"{key} {'auto -> on' if setting == 'auto' else 'true'}"


def _static_shapes(
    sft: Sft, compiled: bool, use_fp8: bool, packing: str, attention: str, capacity: int
) -> tuple[int, str]:
    """(tokens every micro-batch's flattened row is padded to, or 0; why). Varlen packing flattens a
    micro-batch to its real tokens, so the length changes every step and the compiled layers become
    dynamic-shape graphs. Padding to the micro-batch's capacity (rows x cutoff_len; neat packs are
    nearly full) keeps one shape. auto: on for compiled FP8 full and freeze training (measured 1.06x;
    bf16 measured no faster), off for LoRA (not measured)."""
    on, how = _compiled_setting(
        sft,
        "static_shapes",
        applies=compiled and packing == "neat" and attention == "varlen",
        needs=(
            "compiled decoder layers (sft.torch_compile) and neat packing through varlen attention (the "
            f"plan: torch_compile {'on' if compiled else 'off'}, packing {packing}, attention {attention})"
        ),
        auto_on=_full_weights(sft) and use_fp8,  # bf16 full training compiled to one shape ran no faster
        auto_off=(
            ""
            if _full_weights(sft)
            else "static_shapes auto -> off: measured for full fine-tuning only, not LoRA"
        ),
    )
    if not on:
        return 0, how
    return capacity, (
        f"{how}: every micro-batch padded to {capacity} tokens, so the compiled layers keep one shape "
        f"({STATIC_WHY})"
    )


def _compile_tuning(sft: Sft, compiled: bool, use_fp8: bool) -> tuple[bool, str]:
    """(Inductor's coordinate-descent tuning of each generated kernel, why). auto: on for compiled FP8
    full and freeze training, whose fused float8 casts and scales it speeds up; the first steps
    compile for longer (about 100 s more at 1.24 B)."""
    on, how = _compiled_setting(
        sft,
        "compile_tuning",
        applies=compiled,
        needs="compiled decoder layers (sft.torch_compile, off in this plan)",
        auto_on=use_fp8 and _full_weights(sft),
    )
    if not on:
        return False, how
    return True, (
        f"{how}: Inductor tunes each compiled kernel's block sizes, the first steps compile longer "
        f"({TUNING_WHY})"
    )


def _tradeoffs(
    sft: Sft, fitting: list, chosen: tuple, est: StepTime, host_refused: list, platform: Platform
) -> list[str]:
    """Why the chosen plan beat the fastest fitting plan of the other kind (recompute, offload)."""
    out = []
    for key, index, name in (
        ("gradient_checkpointing", 3, "gradient checkpointing"),
        ("offload", 1, "offload"),
    ):
        if getattr(sft, key) != "auto":
            continue
        others = [f for f in fitting if f[1][index] != chosen[index]]
        state = "on" if chosen[index] else "off"
        if not others and key == "offload" and host_refused:
            out.append(
                f"offload off: its host-side states ({min(host_refused):.0f} GiB per node) do not fit "
                f"in {HOST_USABLE_FRACTION:.0%} of the nodes' {platform.host_memory_gib:.0f} GiB"
            )
            continue
        if not others:
            why = "the only way to fit" if chosen[index] else "fits without it"
            out.append(f"{name} {state}: {why}")
            continue
        alt = max(others, key=lambda f: f[0].tokens_per_s_per_gpu)
        a_stage, a_off, a_rows, a_gc = alt[1]
        out.append(
            f"{name} {state}: estimated {est.tokens_per_s_per_gpu:,.0f} tokens/s/GPU "
            f"({est.total_s:.2f} s/step) against {alt[0].tokens_per_s_per_gpu:,.0f} "
            f"({alt[0].total_s:.2f} s/step) with it {'off' if chosen[index] else 'on'} "
            f"(ZeRO-{a_stage}{' + offload' if a_off else ''}, micro-batch {a_rows})"
        )
    return out


def _host_refusal(shape: ModelShape, platform: Platform, need: float) -> str:
    return (
        f"sft does not fit: {shape.params / 1e9:.2f} B parameters need ZeRO-3 CPU offload, which holds "
        f"{need:.0f} GiB per node in host memory, but the nodes have {platform.host_memory_gib:.0f} GiB "
        f"({HOST_USABLE_FRACTION:.0%} usable). Change: more nodes (hardware.nodes), sft.finetuning_type: "
        "lora, or a shorter data.cutoff_len"
    )


def _use_compile(sft: Sft, stage: int, platform: Platform, use_fp8: bool = False) -> bool:
    """Regional torch.compile. auto: on for LoRA on GPUs below ZeRO-3, whose adapters (dropout,
    scaling, two low-rank matmuls and an add per layer) fuse into few kernels, and for any FP8 plan
    below ZeRO-3, whose float8 casts and scales run as separate kernels uncompiled (full 1.24 B on one
    H200: eager FP8 0.49x bf16, compiled 0.98x); bf16 full training measured no faster compiled in
    earlier calls (bench/README.md has both). ZeRO-3 gathers weights in module hooks that the compiled
    layers would have to trace: refused. 4-bit and 8-bit layers are left eager."""
    setting = sft.torch_compile
    if setting == "auto":
        return (
            (sft.finetuning_type == "lora" or use_fp8)
            and sft.quantization_bit == "none"
            and platform.vendor != "cpu"
            and stage < 3
        )
    if setting and stage == 3:
        raise ConfigError(
            "config key sft.torch_compile: true needs ZeRO-0/1/2 (the plan chose ZeRO-3, whose "
            "parameter gathering hooks do not compile); set sft.zero_stage to 2 or torch_compile to false"
        )
    return bool(setting)


def _compiles(sft: Sft, stage: int, platform: Platform, use_fp8: bool) -> bool:
    """Whether a candidate at this ZeRO stage would run compiled (an explicit `true` at ZeRO-3 is
    refused by _use_compile once the stage is chosen; as a candidate it simply does not compile)."""
    return stage < 3 and _use_compile(sft, stage, platform, use_fp8)


def _refusal(cfg: Config, shape, gpu, usable, smallest, seq, objective: Objective = SFT) -> str:
    """Why nothing fits, and which keys to change, most effective first."""
    sft = cfg.sft
    peak, (stage, offload, rows, gc) = smallest
    fixed = []
    if sft.per_device_train_batch_size != "auto":
        fixed.append(f"sft.per_device_train_batch_size: {rows}")
    if sft.gradient_checkpointing != "auto":
        fixed.append(f"sft.gradient_checkpointing: {str(gc).lower()}")
    if sft.zero_stage != "auto":
        fixed.append(f"sft.zero_stage: {stage}")
    if sft.offload != "auto":
        fixed.append(f"sft.offload: {str(offload).lower()}")
    tips = []
    if sft.gradient_checkpointing is False:
        tips.append("sft.gradient_checkpointing: true (or auto)")
    if sft.per_device_train_batch_size not in ("auto", 1):
        tips.append("a smaller sft.per_device_train_batch_size (or auto)")
    if sft.zero_stage not in ("auto", 3):
        tips.append("sft.zero_stage: 3 (or auto)")
    if sft.offload is False or (sft.offload == "auto" and stage != 3):
        tips.append("sft.offload: true (or auto)")
    tips += [
        "more GPUs (hardware.nodes / hardware.gpus_per_node: ZeRO-3 shards states over all of them)",
        f"a shorter data.cutoff_len (now {seq})",
        "sft.finetuning_type: lora",
    ]
    tips[:0] = objective.tips
    return (
        f"{objective.what} does not fit: {shape.params / 1e9:.2f} B parameters need at least {peak:.1f} "
        "GiB per device "
        f"(ZeRO-{stage}{' + offload' if offload else ''}, micro-batch {rows} x {seq} tokens, gradient "
        f"checkpointing {'on' if gc else 'off'}) but {gpu} leaves {usable:.1f} GiB usable"
        + (f" with {', '.join(fixed)}" if fixed else "")
        + ". Change: "
        + "; ".join(tips)
    )


def describe(plan: Plan) -> str:
    """Human-readable plan for the render log."""
    m = plan.memory
    lines = [
        f"plan: ZeRO-{plan.zero_stage}{' + offload' if plan.offload else ''}, micro-batch {plan.micro_batch} "
        f"x {plan.seq_len} tokens, accumulation {plan.gradient_accumulation}, world {plan.world_size} "
        f"({plan.tokens_per_step} tokens/step), gradient checkpointing "
        f"{'on' if plan.gradient_checkpointing else 'off'}, packing {plan.packing}, attention "
        f"{plan.attention}, liger {'on' if plan.liger else 'off'}"
        + (", torch.compile per decoder layer" if plan.compile else "")
        + (" (kernels tuned)" if plan.compile_tuning else "")
        + (f", every micro-batch padded to {plan.static_tokens} tokens" if plan.static_tokens else "")
        + (f", FP8 ({fp8.RECIPE} float8) on the decoder's linear layers" if plan.fp8 else "")
        + (", any frozen weights cast to float8 once" if plan.fp8 and fp8.cast_once(plan.zero_stage) else ""),
        f"memory per device on {plan.gpu} ({plan.capacity_gib:.0f} GiB, {plan.usable_gib:.0f} usable): "
        f"peak {m.peak:.1f} GiB = weights {m.weights:.1f} + grads {m.gradients:.1f} + optimizer "
        f"{m.optimizer:.1f} + buckets {m.buckets:.1f}"
        + (f" + reference {m.reference:.1f}" if m.reference else "")
        + f" + max(activations {m.activations:.1f} + loss "
        f"{m.loss:.1f} + mask {m.mask:.1f}, step {m.step_transient:.1f})",
    ]
    if plan.sequences_per_row > 1:
        lines.append(
            f"preference pairs: {plan.sequences_per_row} sequences per row in one batch, reference model "
            f"{plan.reference} (copy = frozen weights, forward = the policy with its adapter off, "
            "cached = its log-probabilities from the reference step, no model)"
            + (", batched by length" if plan.group_by_length else "")
            + (", padding-free" if plan.padding_free else "")
        )
    if plan.step:
        st = plan.step
        lines.append(
            f"estimated step {st.total_s:.2f} s = compute {st.compute_s:.2f} + exposed collectives "
            f"{st.comm_s:.2f} + offload {st.offload_s:.2f}: {st.tokens_per_s_per_gpu:,.0f} tokens/s/GPU"
        )
    lines += [f"  because {r}" for r in plan.reasons]
    return "\n".join(lines)
