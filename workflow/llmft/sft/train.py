"""One torchrun worker: LLaMA-Factory's `run_exp` with llmft's callbacks and attention.

`llamafactory-cli train` takes no callbacks, so `llmft sft` launches torchrun on this module
instead (the same torchrun command LLaMA-Factory's launcher builds from FORCE_TORCHRUN, NNODES,
NODE_RANK, MASTER_ADDR, MASTER_PORT). The rendered YAML is LLaMA-Factory's, plus one `llmft:`
block read here and removed before LLaMA-Factory parses the rest:

    llmft:
      attention: varlen | sdpa | ...    # varlen = llmft.core.varlen for neat packing
      divergence_factor: 100
      precision: bf16
      finetuning_type: full
      cutoff_len: 2048
      compile_layers: false             # torch.compile each decoder layer (CompileLayers)
      static_tokens: 16384              # when planned: every flattened micro-batch padded to this
      compile_tuning: true              # when planned: Inductor's coordinate-descent kernel tuning
      fp8: {recipe: tensorwise, frozen_cast_once: true}  # only when FP8 is planned (llmft.core.fp8)
      decay_ratio: 0.2                  # lr_scheduler_type warmup_stable_decay: its decay's share
                                        # of the steps (llmft.core.schedule)
      liger_loss_only: false            # Liger's fused linear + cross-entropy alone
                                        # (with Liger, its fused loss runs through llmft.sft.fusedce)
      padding_free: true                # when planned: the objective's padding-free forward, a patch
                                        # the worker is given (llmft.worker: llmft.preference.padfree)
      reference_logps: results/<run>/preference/reference/reference.json  # when planned: the reference's
                                        # cached log-probabilities (llmft.worker: preference.refpatch)
      tracking: {backends: [tensorboard], dir: results/<run>/tracking, run: <run>}  # tracking.py

Exit codes: 0 done, EXIT_DIVERGED (with llmft_divergence.json), EXIT_PREEMPTED (after saving a
checkpoint), anything else is a crash.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import yaml
from llmft.core.imports import UNUSED, hidden
from llmft.sft import faults, tracking

# A training process never calls scikit-learn, and torchao only for FP8 (llmft.core.fp8 imports it
# itself): transformers, peft, trl and nltk would import them for nothing (llmft.core.imports).
# Hidden from these imports and, in main, from the whole run (torchao only when FP8 is not planned).
with hidden(*UNUSED, "torchao"):
    from llmft.sft.callbacks import (
        PROFILE_ENV,
        CastFrozenFloat8,
        CheckpointSeal,
        CompileLayers,
        Diverged,
        DivergenceGuard,
        HeartbeatCallback,
        ParamCount,
        Preempted,
        PreemptionSaver,
        ProfileWindow,
        StartWeights,
        StepClock,
        profile_window,
    )
from llmft.sft.markers import EXIT_DIVERGED, EXIT_PREEMPTED, STOP_REQUEST_FILE

log = logging.getLogger("llmft.sft.train")


def split_args(yaml_path: str) -> tuple[dict, dict]:
    """(LLaMA-Factory arguments, llmft launcher settings) from a rendered YAML."""
    args = yaml.safe_load(Path(yaml_path).read_text())
    ours = args.pop("llmft", None) or {}
    return args, ours


def cpu_resume_fix() -> None:
    """Let a multi-process CPU run resume: transformers 5.6 loads the optimizer state with
    map_location=args.device, which is "cpu:0" on CPU processes, and torch.load only knows "cpu" (the
    same memory). Only a CPU place's name changes (GPU places pass untouched); nothing else does."""
    import functools

    import torch

    if getattr(torch.load, "_llmft_cpu_fix", False):
        return
    original = torch.load

    @functools.wraps(original)
    def load(*args, map_location=None, **kwargs):
        if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type == "cpu":
            map_location = "cpu"
        return original(*args, map_location=map_location, **kwargs)

    load._llmft_cpu_fix = True
    torch.load = load


def liger_loss_only(model_path: str) -> None:
    """Patch the model family's causal-LM forward with Liger's fused linear + cross-entropy (no
    materialised logits) and nothing else: RMSNorm, SwiGLU and RoPE stay transformers' own, for
    torch.compile to fuse (Liger's Triton kernels fail to compile under dynamo)."""
    import inspect

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(model_path).model_type
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise RuntimeError(
            f"liger-kernel has no patch for model type {model_type!r}; set sft.liger_kernel: false"
        )
    wanted = {"fused_linear_cross_entropy": True, "cross_entropy": False, "rope": False, "rms_norm": False}
    wanted.update(swiglu=False, geglu=False, layer_norm=False)
    params = inspect.signature(apply).parameters
    apply(**{k: v for k, v in wanted.items() if k in params})
    log.info("liger: fused linear + cross-entropy only (%s); the decoder layers are compiled", model_type)


class FP8NotApplied(RuntimeError):
    """FP8 was planned but no linear layer of the loaded model became float8."""


def install_fp8(recipe: str, output_dir: Path, rank: int, frozen_cast_once: bool = False) -> None:
    """Convert the model LLaMA-Factory's SFT workflow loads (adapters attached) to float8 before its
    trainer wraps it (DeepSpeed, DDP) and before CompileLayers compiles its layers; rank 0 writes what
    was converted, counted on the model (fp8.FP8_FILE). Nothing converted is an error, not bf16.
    `frozen_cast_once`: frozen layers become FrozenFloat8Linear, whose weights CastFrozenFloat8 casts
    once the trainer has moved the model to its GPU."""
    from llamafactory.train.sft import workflow
    from llmft.core import fp8

    original = workflow.load_model

    def load_model(*args, **kwargs):
        model = original(*args, **kwargs)
        report = fp8.convert(model, recipe, frozen_cast_once)
        if report["float8_layers"] == 0:
            raise FP8NotApplied(
                f"FP8 was planned (sft.fp8) but {report['summary']}: no decoder linear layer was converted; "
                "set sft.fp8: false to train in bf16, or rerun verify_env (its canary's FP8 leg)"
            )
        log.info("fp8: %s", report["summary"])
        if rank == 0:
            fp8.write_report(output_dir, report)
        return model

    workflow.load_model = load_model


# `llmft:` keys whose trainer patch another stage supplies (llmft.worker passes them to main).
PATCHED_KEYS = ("padding_free", "reference_logps")


def main(argv: list[str] | None = None, patches: dict[str, Callable[[object], None]] | None = None) -> int:
    """Train the rendered YAML `argv[0]`; `patches`: for a key of the `llmft:` block, what installs it
    (another stage's trainer patch, e.g. the preference stage's padding-free forward)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m llmft.sft.train <rendered llamafactory.yaml>", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    args, ours = split_args(argv[0])
    patches = patches or {}
    missing = [key for key in PATCHED_KEYS if ours.get(key) and key not in patches]
    if missing:
        print(f"llmft: {argv[0]} asks for {missing} (llmft:), which only `python -m llmft.worker` installs",
              file=sys.stderr)  # fmt: skip
        return 2
    with hidden(*UNUSED, *(() if ours.get("fp8") else ("torchao",))):
        return _train(args, ours, patches)


def _train(args: dict, ours: dict, patches: dict[str, Callable[[object], None]]) -> int:
    output_dir = Path(args["output_dir"])
    saver = PreemptionSaver(output_dir / STOP_REQUEST_FILE)
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: saver.request(signal.Signals(signum).name))

    _install(args, ours, output_dir, patches)
    cpu_resume_fix()
    try:
        tracking.set_up(ours.get("tracking") or {}, output_dir, int(os.environ.get("RANK", "0")))
    except tracking.TrackingError as exc:
        print(f"[llmft] {exc}", file=sys.stderr, flush=True)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    heartbeat = faults.Heartbeat(output_dir, rank).start()
    callbacks = _callbacks(args, ours, saver, heartbeat)
    from llamafactory.train.tuner import run_exp

    try:
        run_exp(args=args, callbacks=callbacks)
    except Diverged as exc:
        print(f"[llmft] {exc}", file=sys.stderr, flush=True)
        return _finish(callbacks, EXIT_DIVERGED)
    except Preempted as exc:
        print(f"[llmft] {exc}", file=sys.stderr, flush=True)
        return _finish(callbacks, EXIT_PREEMPTED)
    except FP8NotApplied as exc:
        print(f"[llmft] {exc}", file=sys.stderr, flush=True)
        return _finish(callbacks, 2)
    return _finish(callbacks, 0)


def _install(args: dict, ours: dict, output_dir: Path, patches: dict[str, Callable[[object], None]]) -> None:
    """What the rendered llmft block asks for, patched into LLaMA-Factory, transformers and torch
    before run_exp: varlen attention, other stages' `patches` (llmft.worker), Liger's loss, FP8, the
    schedule's decay."""
    if ours.get("attention") == "varlen":
        import torch
        from llmft.core import varlen

        if torch.cuda.is_available() and not varlen.available():
            # An older torch: LLaMA-Factory's own neat packing (SDPA with a 4-D mask) still works.
            log.warning("torch has no varlen FlashAttention: neat packing falls back to SDPA + 4-D mask")
            args["include_num_input_tokens_seen"] = "all"  # that mask holds sample indices, not 0/1
        else:
            varlen.install()
            if ours.get("static_tokens"):  # the collator reads it, in this process or its workers
                os.environ[varlen.PAD_TO_ENV] = str(int(ours["static_tokens"]))
    for key, install in patches.items():  # other stages' trainer patches (llmft.worker), given the value
        if ours.get(key):
            install(ours[key])
    if ours.get("liger_loss_only"):
        liger_loss_only(args["model_name_or_path"])
    if ours.get("liger_loss_only") or args.get("enable_liger_kernel"):
        from llmft.sft import fusedce

        fusedce.install()  # Liger's fused loss without its per-step host read
    if ours.get("fp8"):
        install_fp8(
            ours["fp8"]["recipe"],
            output_dir,
            int(os.environ.get("RANK", "0")),
            bool(ours["fp8"].get("frozen_cast_once")),
        )
    if ours.get("decay_ratio") is not None:  # warmup_stable_decay's decay as a share of the steps
        from llmft.core import schedule

        schedule.install(float(ours["decay_ratio"]))


def _callbacks(args: dict, ours: dict, saver: PreemptionSaver, heartbeat: faults.Heartbeat) -> list:
    """The trainer callbacks, in the order they must run."""
    callbacks = [
        CheckpointSeal(),  # before the saver: a checkpoint saved for a stop is sealed first
        HeartbeatCallback(heartbeat),
        DivergenceGuard(
            factor=float(ours.get("divergence_factor", 100)),
            precision=ours.get("precision", "bf16"),
            finetuning_type=ours.get("finetuning_type", "full"),
            cutoff_len=int(ours.get("cutoff_len", args.get("cutoff_len", 0))),
        ),
        saver,
        StepClock(),
        ParamCount(),
        StartWeights(),
    ]
    if ours.get("fp8", {}).get("frozen_cast_once"):
        callbacks.append(CastFrozenFloat8())  # before the compiled layers' first trace
    if ours.get("compile_layers"):
        callbacks.append(CompileLayers(tuning=bool(ours.get("compile_tuning"))))
    window = profile_window(os.environ.get(PROFILE_ENV))
    if window:
        callbacks.append(ProfileWindow(*window))
    return callbacks


def _finish(callbacks: list, code: int) -> int:
    """Flush what LLaMA-Factory still writes, then leave without interpreter teardown.

    Everything is on disk by now; tearing down the collective library's threads at interpreter exit
    occasionally aborts ("terminate called without an active exception") under CPU load, which
    torchrun would report as a failed run.
    """
    tracking.flush(code)
    for cb in callbacks:
        close = getattr(cb, "_close_thread_pool", None)  # LLaMA-Factory's trainer_log.jsonl writer
        if close:
            close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
