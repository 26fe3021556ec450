"""Trainer callbacks that llmft's launcher adds to LLaMA-Factory's run (its CLI takes none).

- DivergenceGuard: a NaN/inf loss or gradient norm, or a gradient norm far above its running
  median, stops training before anything is saved, with a diagnosis (learning rate, precision,
  over-long rows), instead of burning GPU-hours and publishing a broken model.
- PreemptionSaver: after SIGUSR1/SIGTERM (Slurm's --signal before the time limit, preemption) or a
  stop-request file, every rank agrees at the next optimizer step to save a checkpoint, then stops;
  the requeued job resumes from it, losing nothing. The ranks agree on the host (llmft.core.hostcomm),
  so the check does not wait for the GPU after every step.
- StepClock: one line per optimizer step (wall time, tokens seen) for steady-state throughput.
- ProfileWindow: with LLMFT_PROFILE_STEPS=FIRST:LAST, torch.profiler records those optimizer steps
  on every rank and writes a table of the most expensive kernels and operators per rank
  (llmft_profile_rank<N>.txt), with the steps' wall time to compare GPU busy time against, and the
  timeline (llmft_trace_rank<N>.json.gz; bench/trace_gaps.py measures the GPU's idle time in it).
- ParamCount: the trainable and total parameter counts of the model as it trains (LoRA adapters,
  frozen layers, ZeRO-3's partitioned weights counted whole), for train_summary.json.
- StartWeights: the first trainable tensor as training starts (name, sum, sha256 of its float32
  bytes), so a continued run shows it started from its parent's weights or adapter.
- CompileLayers: torch.compile every decoder layer in place before the first step (regional
  compilation: one graph, reused by all layers; parameter names and checkpoints are unchanged).
- CheckpointSeal: once every rank has written checkpoint-N, rank 0 seals it (faults.seal); an
  unsealed checkpoint is never resumed from.
- HeartbeatCallback: each rank's heartbeat file (faults.Heartbeat) carries its last step.

Exceptions end the run from inside the training loop, on every rank at the same step (the values
they act on are global: the logged loss is averaged over ranks, the grad norm is the global norm,
the stop flag is all-reduced), so no rank is left waiting in a collective.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from pathlib import Path

from llmft.sft.markers import (
    DIVERGENCE_FILE,
    PARAMS_FILE,
    PREEMPTED_FILE,
    START_WEIGHTS_FILE,
    STEPS_FILE,
)
from transformers import TrainerCallback

PROFILE_ENV = "LLMFT_PROFILE_STEPS"

log = logging.getLogger("llmft.sft.callbacks")


class Diverged(RuntimeError):
    def __init__(self, diagnosis: dict):
        super().__init__(diagnosis["message"])
        self.diagnosis = diagnosis


class Preempted(RuntimeError):
    pass


def _finite(x) -> bool:
    return x is not None and math.isfinite(float(x))


def diagnose(
    event: dict,
    history: list[dict],
    *,
    precision: str,
    peak_lr: float,
    finetuning_type: str,
    cutoff_len: int,
    warmup_steps: int,
) -> dict:
    """Name the likely causes of a divergence, most likely first, each with the key to change."""
    step = event["step"]
    what = event["what"]
    lr = event.get("learning_rate") or peak_lr
    causes: list[str] = []
    norms = [h["grad_norm"] for h in history if _finite(h.get("grad_norm"))]
    rising = len(norms) >= 2 and norms[-1] > 10 * min(norms)
    high_lr = peak_lr > (1e-3 if finetuning_type != "full" else 1e-4)
    if precision == "fp16":
        causes.append(
            "precision: fp16 overflows (its range ends at 65504); set sft.precision: bf16 "
            "(MI300X, H100 and H200 all support bf16)"
        )
    if high_lr or rising or (not norms and step <= max(1, warmup_steps) * 2):
        causes.append(
            f"learning rate: sft.learning_rate={peak_lr:g} (at step {step}: {lr:.3g}) is likely too high "
            f"for {finetuning_type} fine-tuning; try {peak_lr / 10:g}"
            + ("; the gradient norm was already rising" if rising else "")
            + (
                f", or a longer warm-up (sft.warmup_ratio; {warmup_steps} warm-up steps now)"
                if warmup_steps < 10
                else ""
            )
        )
    causes.append(
        f"over-long rows: data.cutoff_len={cutoff_len}; a few very long rows (few answer tokens "
        "after a long prompt) give extreme losses: look at the length histogram in the data stage's "
        "stats.json and lower data.cutoff_len"
    )
    if precision != "fp16" and not (high_lr or rising):
        causes.append(
            "precision: if the loss was NaN from the first step, check the model's weights and dtype"
        )
    message = f"training stopped at step {step}: {what}. Likely causes, most likely first: " + " | ".join(
        f"({i}) {c}" for i, c in enumerate(causes, 1)
    )
    return {"step": step, "what": what, "causes": causes, "message": message, "recent": history[-10:]}


class DivergenceGuard(TrainerCallback):
    """Stops on a NaN/inf loss or grad norm, or on a grad norm `factor` x its running median whose
    loss confirms it.

    Adam scales each step by the gradients' running size, so one spike moves a weight by about three
    normal steps at most ((1 - beta1) / sqrt(1 - beta2)): a divergence shows in the loss. Near zero
    loss the running median of the grad norm is tiny, and one hard batch is hundreds of times it. So
    a spike is a suspect, and the next logged step judges it: a loss more than doubled from its
    running median before the spike, and up by over LOSS_RISE, stops the run. A spike at the last
    step, or one no logged step follows, is judged by its own logged loss (the final model is saved
    right after it). A checkpoint saved since a confirmed spike is moved aside
    (`diverged-checkpoint-N`): nothing resumes from or publishes it.
    """

    WINDOW = 20  # logged steps in the running medians
    LOSS_RISE = 0.1  # a loss doubled from near zero is noise until it has risen this much

    def __init__(self, factor: float, precision: str, finetuning_type: str, cutoff_len: int):
        self.factor = factor
        self.precision = precision
        self.finetuning_type = finetuning_type
        self.cutoff_len = cutoff_len
        self.history: list[dict] = []
        self.fp16_overflows = 0
        self.suspect: dict | None = None
        self.cleared: list[dict] = []  # spikes whose loss did not confirm them

    def on_step_end(self, args, state, control, **kwargs):
        # Log before every save (transformers logs, then saves): the loss and grad norm of the steps
        # a checkpoint holds pass through on_log first, so a diverged model is never saved.
        if control.should_save:
            control.should_log = True

    def _median(self, key: str) -> float | None:
        values = [h[key] for h in self.history[-self.WINDOW :] if _finite(h.get(key))]
        return statistics.median(values) if len(values) >= 5 else None

    def _judge(self, entry: dict, last: bool) -> str | None:
        """Why this log stops training, or None. Leaves a spike that is not the last step as a suspect."""
        loss, norm = entry["loss"], entry["grad_norm"]
        if not _finite(loss):
            return f"loss is {loss}"
        if norm is not None and not _finite(norm):
            # fp16's dynamic loss scaling skips steps whose gradients overflow: a few are normal.
            self.fp16_overflows += 1
            if self.precision != "fp16" or self.fp16_overflows >= 5:
                return f"gradient norm is {norm}"
            return None
        self.fp16_overflows = 0
        if self.suspect is not None:
            suspect, self.suspect = self.suspect, None
            what = self._confirm(suspect, entry)
            if what is None:  # cleared: the spike's log joins the history before this one
                self.history.append(suspect["entry"])
            return what
        median = self._median("grad_norm")
        if self.factor and _finite(norm) and median and norm > self.factor * median:
            suspect = {
                "entry": entry, "step": entry["step"], "grad_norm": norm, "median": median,
                "loss_median": self._median("loss"),
            }  # fmt: skip
            if last:  # nothing comes after it: its own logged loss judges it
                return self._confirm(suspect, entry)
            self.suspect = suspect
            log.warning(f"{self._spike(suspect)}: the next logged step's loss decides")
        return None

    @staticmethod
    def _spike(suspect: dict) -> str:
        return (
            f"gradient norm {suspect['grad_norm']:.4g} at step {suspect['step']} was "
            f"{suspect['grad_norm'] / suspect['median']:.0f}x its running median {suspect['median']:.4g}"
        )

    def _confirm(self, suspect: dict, entry: dict) -> str | None:
        """Why `entry`'s loss confirms the spike `suspect` as a divergence, or None (the spike cleared)."""
        loss, base = entry["loss"], suspect["loss_median"]
        at = f"at step {entry['step']}"
        if base is not None and loss > 2 * base and loss - base > self.LOSS_RISE:
            rose = f"the loss rose to {loss:.4g} from a running median {base:.4g}"
            return f"{self._spike(suspect)}, and {at} {rose}"
        self.cleared.append({k: suspect[k] for k in ("step", "grad_norm", "median")})
        log.warning(f"{self._spike(suspect)}; {at} the loss is {loss:.4g}: not a divergence")
        return None

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs:
            return
        entry = {k: logs.get(k) for k in ("loss", "grad_norm", "learning_rate")}
        entry["step"] = state.global_step
        suspect = self.suspect
        what = self._judge(entry, last=bool(state.max_steps) and state.global_step >= state.max_steps)
        if what is not None:
            self._stop(args, state, entry, what, suspect)
        if self.suspect is None:
            self.history.append(entry)

    def on_train_end(self, args, state, control, **kwargs):
        # A spike no logged step came after (the final model is saved next): its own loss judges it.
        suspect, self.suspect = self.suspect, None
        if suspect is not None and (what := self._confirm(suspect, suspect["entry"])):
            self._stop(args, state, suspect["entry"], what, suspect)

    def _stop(self, args, state, entry: dict, what: str, suspect: dict | None):
        diagnosis = diagnose(
            {**entry, "what": what},
            self.history,
            precision=self.precision,
            peak_lr=args.learning_rate,
            finetuning_type=self.finetuning_type,
            cutoff_len=self.cutoff_len,
            warmup_steps=args.get_warmup_steps(state.max_steps) if state.max_steps else 0,
        )
        if self.cleared:
            diagnosis["cleared_spikes"] = self.cleared
        if state.is_world_process_zero:
            work = Path(args.output_dir)
            work.mkdir(parents=True, exist_ok=True)
            if suspect is not None:  # what was saved since the spike holds the diverging weights
                from llmft.sft.faults import DIVERGED_PREFIX, checkpoints, set_aside

                diagnosis["set_aside"] = [
                    set_aside(path, DIVERGED_PREFIX).name
                    for step, path in checkpoints(work)
                    if step >= suspect["step"]
                ]
            (work / DIVERGENCE_FILE).write_text(json.dumps(diagnosis, indent=2, default=str))
        raise Diverged(diagnosis)


class CheckpointSeal(TrainerCallback):
    """Seal checkpoint-N after every rank returned from saving it. Listed before PreemptionSaver,
    whose on_save ends the run: a checkpoint saved for a stop is sealed first."""

    def on_save(self, args, state, control, **kwargs):
        import torch.distributed as dist
        from llmft.sft.faults import seal

        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's shards, optimizer states and RNG states are on disk
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and checkpoint.is_dir():
            seal(checkpoint)


class HeartbeatCallback(TrainerCallback):
    def __init__(self, heartbeat):
        self.heartbeat = heartbeat

    def on_step_end(self, args, state, control, **kwargs):
        self.heartbeat.step(state.global_step)


class PreemptionSaver(TrainerCallback):
    """Save a checkpoint at the next step after a stop request, then end the run (Preempted)."""

    def __init__(self, stop_file: Path):
        self.stop_file = stop_file
        self.requested: str | None = None
        self.stopping = False

    def request(self, why: str) -> None:
        """Called from a signal handler: only set a flag, the training loop acts on it."""
        self.requested = self.requested or why

    def on_step_end(self, args, state, control, **kwargs):
        local = self.requested is not None or self.stop_file.exists()
        from llmft.core import hostcomm

        if hostcomm.any_rank(local):  # on the host: no GPU read after every step
            self.stopping = True
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        if not self.stopping:
            return
        if state.is_world_process_zero:
            info = {
                "step": state.global_step,
                "why": self.requested or "stop-request file",
                "time": time.time(),
            }
            (Path(args.output_dir) / PREEMPTED_FILE).write_text(json.dumps(info))
        raise Preempted(f"checkpoint saved at step {state.global_step} after a stop request")


class StepClock(TrainerCallback):
    """Rank 0 appends {step, time, tokens} per optimizer step to llmft_steps.jsonl (kept on resume),
    and an {attempt_start: step} line when an attempt begins (the step it resumed from), so a
    summary can tell this attempt's steps from the ones it resumed."""

    @staticmethod
    def _append(args, state, record: dict) -> None:
        if not state.is_world_process_zero:
            return
        path = Path(args.output_dir) / STEPS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        # "started", not "time": readers take every line with a "time" for a step
        record = {
            "attempt_start": state.global_step,
            "started": time.time(),
            "tokens": state.num_input_tokens_seen,
        }
        self._append(args, state, record)

    def on_step_end(self, args, state, control, **kwargs):
        record = {"step": state.global_step, "time": time.time(), "tokens": state.num_input_tokens_seen}
        self._append(args, state, record)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._append(args, state, {"step": state.global_step, "loss": logs["loss"]})


def profile_window(spec: str | None) -> tuple[int, int] | None:
    """'6:8' -> (6, 8): the optimizer steps to profile; None when unset. A bad value is an error."""
    if not spec:
        return None
    try:
        first, last = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"{PROFILE_ENV}={spec!r}: expected FIRST:LAST optimizer steps, e.g. 6:8") from None
    if not 1 <= first <= last:
        raise ValueError(f"{PROFILE_ENV}={spec!r}: need 1 <= FIRST <= LAST")
    return first, last


class ProfileWindow(TrainerCallback):
    """torch.profiler over optimizer steps FIRST..LAST (1-based, inclusive); on each rank a table
    (llmft_profile_rank<R>.txt) and the timeline (llmft_trace_rank<R>.json.gz, chrome://tracing or
    Perfetto), which shows where the GPU waits on the host."""

    def __init__(self, first: int, last: int):
        self.first, self.last = first, last
        self.prof = None
        self.done = False

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.done and self.prof is None and state.global_step + 1 == self.first:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=False)
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is None or state.global_step < self.last:
            return
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.done = True
        rank = args.process_index
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        steps = self.last - self.first + 1
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90)
        (out / f"llmft_profile_rank{rank}.txt").write_text(
            f"optimizer steps {self.first}-{self.last} ({steps}): {wall:.3f} s wall, sorted by {sort}\n"
            f"{table}\n"
        )
        prof.export_chrome_trace(str(out / f"llmft_trace_rank{rank}.json.gz"))


# Packed batches vary the number of samples and the longest one: dynamo recompiles for the first few
# shapes before it treats them as dynamic; leave room for that on every layer.
RECOMPILE_LIMIT = 64


def compile_layers(model, tuning: bool = False) -> int:
    """Compile each repeated block (the model's `_no_split_modules`, e.g. LlamaDecoderLayer) in
    place; the embedding, final norm and loss stay eager. `tuning`: Inductor tunes the block sizes of
    each kernel it generates (coordinate descent; sft.compile_tuning). Returns the number of blocks
    compiled."""
    import torch

    blocks = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in blocks]
    if not layers:
        raise RuntimeError(
            f"sft.torch_compile: {type(model).__name__} names no repeated blocks (_no_split_modules) "
            "to compile; set sft.torch_compile to false"
        )
    cfg = torch._dynamo.config
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, key):
            setattr(cfg, key, max(getattr(cfg, key), RECOMPILE_LIMIT))
    if tuning:
        import torch._inductor.config as inductor

        inductor.coordinate_descent_tuning = True
    for layer in layers:
        layer.compile()
    return len(layers)


class CompileLayers(TrainerCallback):
    def __init__(self, tuning: bool = False):
        self.compiled = 0
        self.tuning = tuning

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and not self.compiled:
            self.compiled = compile_layers(model, self.tuning)


class CastFrozenFloat8(TrainerCallback):
    """Casts the FrozenFloat8Linear layers' weights to float8 once (llmft.core.fp8.cast_frozen), where
    the trainer put them (its GPU, DeepSpeed / DDP wrapped), after ParamCount counted the 16-bit
    weights and before the first step traces the compiled layers."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        from llmft.core import fp8

        done = fp8.cast_frozen(model)
        if done:
            log.info("fp8: %d frozen weights cast to float8 once", done)


class ParamCount(TrainerCallback):
    """Rank 0 writes PARAMS_FILE at the start of training: trainable and total parameters, counted
    as LLaMA-Factory counts them (ZeRO-3's partitioned weights whole, 4-bit weights unpacked)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None or not state.is_world_process_zero:
            return
        from llamafactory.extras.misc import count_parameters

        trainable, total = count_parameters(model)
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.output_dir) / PARAMS_FILE).write_text(
            json.dumps({"trainable_params": trainable, "total_params": total})
        )


def tensor_digest(tensor) -> dict:
    """sum and sha256 of a tensor's float32 bytes: equal digests, equal values."""
    import hashlib

    data = tensor.detach().float().cpu().contiguous()
    return {
        "shape": list(data.shape),
        "sum": float(data.sum()),
        "sha256": hashlib.sha256(data.numpy().tobytes()).hexdigest(),
    }


class StartWeights(TrainerCallback):
    """Rank 0 writes START_WEIGHTS_FILE at the start of the first attempt: the first trainable tensor's
    digest (tensor_digest). Every rank enters ZeRO-3's gather of the partitioned tensor (a collective)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None or state.global_step:  # a resumed attempt starts from a checkpoint, not the parent
            return
        name, param = next(((n, p) for n, p in model.named_parameters() if p.requires_grad), (None, None))
        if param is None:
            return
        if hasattr(param, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param]):
                digest = tensor_digest(param.data)
        else:
            digest = tensor_digest(param.data)
        if state.is_world_process_zero:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.output_dir) / START_WEIGHTS_FILE).write_text(json.dumps({"name": name, **digest}))
