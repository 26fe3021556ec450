"""The stack quarantine: what verify_env runs on a node whose software stack differs from the
promoted run's (nightly.on_stack_change: quarantine; the decision is llmft.core.quarantine's).

Four checks, in a child process (`python -m llmft.env.quarantine`), before any training:

1. accumulation parity: LLaMA-Factory's SFT trainer (CustomSeq2SeqTrainer over transformers'
   Trainer, as sft runs it) trains the same rows of unequal lengths as one micro-batch of N, as N
   micro-batches of 1 with gradient accumulation, and, where the plan trains on several processes
   per node, spread over that many ranks (torchrun, DDP): every optimizer step's loss and gradient
   norm must agree within ACCUMULATION_TOLERANCE (per-token loss normalisation across micro-batches
   and ranks, the gradients of every micro-batch summed);
2. resume parity: K steps, a checkpoint, a new trainer resumed from it for K more, against 2K
   steps straight: the same loss and learning rate at every step, and the optimizer's step count;
3. the numerics canary (llmft.env.canary) for every precision the plan uses (its bf16/fp32 leg and
   the FP8 leg where FP8 is planned) against the golden curves: verify_env's own canary result
   when it ran, else the canary here;
4. evaluation drift: the promoted model scores the first EVAL_ROWS rows of its held-out split again,
   through `python -m llmft evaluate` with the settings it was scored with, and must match its
   recorded predictions on those rows (mean loss within EVAL_LOSS_TOLERANCE, exact match within
   EVAL_EXACT_TOLERANCE).

Checks 1-2 train a tiny Llama (the canary's shape) in fp32 for a few steps: they test the trainer's
mechanics under the new stack, the canary tests its numerics per precision.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from llmft.core import quarantine as decisions
from llmft.core import stack as stack_fp
from llmft.core.io import read_json, write_json

if TYPE_CHECKING:
    from llmft.core.settings import Config, Hardware, Sft

# Relative difference of a step's loss / gradient norm between 1 x N and N x 1 micro-batches. fp32
# on one device differs in the last bits (summation order); a dropped micro-batch moves the gradient
# norm by tens of percent and a per-micro-batch mean moves the loss by percents.
ACCUMULATION_TOLERANCE = 1e-3
# Relative difference of a step's loss / learning rate between resumed and straight training: the
# same computation, in the same order, so only rounding may differ.
RESUME_TOLERANCE = 1e-4
ACCUMULATION_ROWS, ACCUMULATION_STEPS = 4, 2  # N rows per optimizer step, steps compared
RESUME_STEPS = 3  # K
# tries of the ranks' run of accumulation parity before a crash fails the check: a busy node can tear
# down one run's collectives, rarely two in a row
RANKS_ATTEMPTS = 3
EVAL_ROWS = 32
EVAL_LOSS_TOLERANCE = 0.02  # relative, of the slice's mean per-row loss
EVAL_EXACT_TOLERANCE = 0.0625  # absolute, of the slice's exact match (2 of 32 rows)
# Environment a quarantine child must not inherit: it trains on one process, never a rank.
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")


def _rows(n: int, seed: int) -> list[dict]:
    """`n` rows of unequal lengths (labels -100 on the padding), padded to one length, so the loss
    of a micro-batch of several rows is per token, not per row."""
    import torch
    from llmft.env.canary import VOCAB

    g = torch.Generator().manual_seed(seed)
    longest = 8 + 6 * (n - 1)
    rows = []
    for i in range(n):
        length = 8 + 6 * (i % n)
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        pad = longest - length
        rows.append(
            {
                "input_ids": ids + [2] * pad,
                "attention_mask": [1] * length + [0] * pad,
                "labels": ids + [-100] * pad,
            }
        )
    return rows


def _trainer(out: Path, rows: list[dict], device: str, **args):
    """LLaMA-Factory's SFT trainer on the canary's tiny Llama (same seed, same weights every time)."""
    import torch
    from llamafactory.hparams import FinetuningArguments, TrainingArguments
    from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer
    from llmft.env.canary import MODEL, SEED
    from transformers import LlamaConfig, LlamaForCausalLM, default_data_collator

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    model.set_attn_implementation("sdpa")
    settings = dict(
        output_dir=str(out),
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        logging_steps=1,
        max_grad_norm=1.0,
        optim="adamw_torch",
        report_to=[],
        seed=SEED,
        data_seed=SEED,
        disable_tqdm=True,
        dataloader_num_workers=0,
        save_strategy="no",
        use_cpu=device == "cpu",
        # the rows in order: a step's rows are the same however they are split into micro-batches
        # and ranks (a random sampler and a distributed one shuffle differently)
        train_sampling_strategy="sequential",
    )
    settings.update(args)
    return CustomSeq2SeqTrainer(
        finetuning_args=FinetuningArguments(),
        processor=None,
        model=model,
        args=TrainingArguments(**settings),
        train_dataset=rows,
        data_collator=default_data_collator,
        tokenizer=None,
    )


def _steps(trainer) -> list[dict]:
    """Every optimizer step's logged loss, gradient norm and learning rate."""
    return [
        {k: float(h[k]) for k in ("loss", "grad_norm", "learning_rate") if k in h} | {"step": h["step"]}
        for h in trainer.state.log_history
        if "loss" in h
    ]


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def plan_ranks(hw: Hardware) -> int:
    """The training processes per node the plan uses (hardware.processes_per_node; 0: one per GPU)."""
    return max(1, int(hw.processes_per_node or hw.gpus_per_node or 1))


def accumulation_rows(ranks: int) -> int:
    """N, the rows of one optimizer step: at least ACCUMULATION_ROWS, a multiple of the ranks."""
    return ranks * -(-ACCUMULATION_ROWS // ranks)


def _ranks_run(scratch: Path, device: str, ranks: int, n: int, env: dict, timeout_s: float) -> list[dict]:
    """The N rows of each step spread over `ranks` processes (torchrun, as sft launches its ranks; gloo
    on CPU, NCCL/RCCL on GPUs), each accumulating N / ranks micro-batches of 1; rank 0's steps."""
    out = scratch / "accumulation_ranks.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd += ["--monitor_interval=0.1", "-m", "llmft.env.quarantine", "--ranks-part", str(out)]
    cmd += ["--device", device, "--rows", str(n)]
    deadline, crashes = time.monotonic() + timeout_s, []
    # A run that crashes (no steps written: a rank killed, a collective torn down on a busy node) is
    # not a parity result: it is tried again (RANKS_ATTEMPTS in all); a difference in the numbers is
    # never retried.
    for _ in range(RANKS_ATTEMPTS):
        out.unlink(missing_ok=True)
        left = max(deadline - time.monotonic(), 1.0)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left)
        if proc.returncode == 0 and out.exists():
            return read_json(out)
        crashes.append(f"torchrun exit {proc.returncode}: {crash_words(proc.stderr)}")
    raise RuntimeError(f"{ranks} ranks crashed {len(crashes)} times; " + " | ".join(crashes))


_CRASH_LINE = re.compile(r"Error|error:|terminate called|what\(\)|Abort|Killed")


def crash_words(stderr: str) -> str:
    """What a crashed torchrun run says: the ranks' own last error lines (before torchrun's summary,
    which only names the signal) and the summary's root cause."""
    own, _, summary = stderr.partition("ChildFailedError")
    errors = [line.strip() for line in own.splitlines() if _CRASH_LINE.search(line)]
    root = summary.partition("Root Cause")[2].splitlines()
    cause = " ".join(w.strip() for w in root if w.strip().startswith(("rank", "exitcode")))
    said = "; ".join(errors[-3:])[-500:] or stderr.strip()[-300:]
    return f"{said} (root cause: {cause})" if cause else said


def ranks_part(out: str, device: str, n: int) -> None:
    """One rank of _ranks_run: N / world size micro-batches of 1 per step; rank 0 writes its steps."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows = _rows(n * ACCUMULATION_STEPS, seed=1)
    trainer = _trainer(
        Path(out).parent / "accumulation_ranks",
        rows,
        device,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=n // world,
        max_steps=ACCUMULATION_STEPS,
        ddp_backend="gloo" if device == "cpu" else "nccl",
    )
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        write_json(out, _steps(trainer))


def _worst(runs: dict, keys=("loss", "grad_norm")) -> dict:
    """The largest relative difference of each key between every run and the first, step by step."""
    ref, *others = runs.values()
    worst = dict.fromkeys(keys, 0.0)
    for other in others:
        if len(other) != len(ref):
            return dict.fromkeys(keys, math.inf)
        for a, b in zip(other, ref, strict=True):
            for key in keys:
                worst[key] = max(worst[key], _rel(a.get(key, math.nan), b.get(key, math.nan)))
    return worst


def accumulation_parity(scratch: Path, device: str, ranks: int = 1, env: dict | None = None) -> dict:
    """Check 1: the same rows as one micro-batch of N, as N micro-batches of 1 (gradient accumulation
    N), and, when the plan trains on several ranks, spread over them (N / ranks micro-batches of 1
    each): every step's loss and gradient norm."""
    t0 = time.monotonic()
    n, steps = accumulation_rows(ranks), ACCUMULATION_STEPS
    rows = _rows(n * steps, seed=1)
    runs = {}
    for name, batch, accumulate in (("one_batch", n, 1), ("accumulated", 1, n)):
        trainer = _trainer(
            scratch / f"accumulation_{name}",
            rows,
            device,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulate,
            max_steps=steps,
        )
        trainer.train()
        runs[name] = _steps(trainer)
    if ranks > 1:
        runs[f"{ranks}_ranks"] = _ranks_run(scratch, device, ranks, n, env or dict(os.environ), 600)
    worst = _worst(runs)
    ok = len(runs["one_batch"]) == steps and max(worst.values()) <= ACCUMULATION_TOLERANCE
    shown = "; ".join(
        f"{name}: "
        + ", ".join(
            f"step {s['step']} loss {s['loss']:.6f} gradient norm {s.get('grad_norm', math.nan):.6f}"
            for s in r
        )
        for name, r in runs.items()
    )
    spread = f", and over {ranks} ranks ({n // ranks} micro-batches of 1 each)" if ranks > 1 else ""
    return {
        "ok": ok,
        "message": (
            f"{n} micro-batches of 1{spread} vs 1 micro-batch of {n} over {steps} steps: loss off by "
            f"{worst['loss']:.2e}, gradient norm by {worst['grad_norm']:.2e} at most "
            f"(tolerance {ACCUMULATION_TOLERANCE:.0e} relative); {shown}"
        ),
        "tolerance": ACCUMULATION_TOLERANCE,
        "ranks": ranks,
        "worst": worst,
        "runs": runs,
        "seconds": round(time.monotonic() - t0, 2),
    }


def _adam_steps(trainer) -> int | None:
    """The optimizer's own step count (AdamW's per-parameter `step`)."""
    for state in trainer.optimizer.state.values():
        if "step" in state:
            return int(float(state["step"]))
    return None


def _stop_at(k: int):
    """A trainer callback that saves a checkpoint at step k and stops the training there."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == k:
                control.should_save = True
                control.should_training_stop = True
            return control

    return StopAt()


def resume_parity(scratch: Path, device: str) -> dict:
    """Check 2: K steps, checkpoint, resume in a new trainer for K more, against 2K straight."""
    t0 = time.monotonic()
    k = RESUME_STEPS
    rows = _rows(4 * 2 * k, seed=2)
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2 * k)
    straight = _trainer(scratch / "resume_straight", rows, device, **common)
    straight.train()
    # the same training, stopped after K steps with a checkpoint (as a preempted sft saves and stops)
    first = _trainer(scratch / "resume", rows, device, **common)
    first.add_callback(_stop_at(k))
    first.train()
    resumed = _trainer(scratch / "resume", rows, device, **common)
    resumed.train(resume_from_checkpoint=str(scratch / "resume" / f"checkpoint-{k}"))
    b = _steps(straight)
    # steps 1..K from the stopped training, K+1..2K from the resumed one (whose history repeats 1..K)
    a_by_step = {s["step"]: s for s in _steps(first) if s["step"] <= k}
    a_by_step.update({s["step"]: s for s in _steps(resumed) if s["step"] > k})
    worst = {"loss": 0.0, "learning_rate": 0.0}
    for s in b:
        mine = a_by_step.get(s["step"], {})
        for key in worst:
            worst[key] = max(worst[key], _rel(mine.get(key, math.nan), s.get(key, math.nan)))
    count = {"resumed": _adam_steps(resumed), "straight": _adam_steps(straight)}
    global_steps = {"resumed": resumed.state.global_step, "straight": straight.state.global_step}
    ok = (
        max(worst.values()) <= RESUME_TOLERANCE
        and count["resumed"] == count["straight"] == 2 * k
        and global_steps["resumed"] == global_steps["straight"] == 2 * k
    )
    mine = {s["step"]: a_by_step.get(s["step"], {}) for s in b}
    after = ", ".join(
        f"step {s['step']}: loss {mine[s['step']].get('loss', math.nan):.6f} vs {s['loss']:.6f}, "
        f"lr {mine[s['step']].get('learning_rate', math.nan):.3e} vs {s['learning_rate']:.3e}"
        for s in b[k:]
    )
    return {
        "ok": ok,
        "message": (
            f"{k} steps, checkpoint, {k} resumed vs {2 * k} straight: loss off by {worst['loss']:.2e}, "
            f"learning rate by {worst['learning_rate']:.2e} at most (tolerance {RESUME_TOLERANCE:.0e} "
            f"relative); optimizer step count {count['resumed']} vs {count['straight']}, trainer steps "
            f"{global_steps['resumed']} vs {global_steps['straight']}; after the resume: {after}"
        ),
        "tolerance": RESUME_TOLERANCE,
        "worst": worst,
        "optimizer_steps": count,
        "global_steps": global_steps,
        "runs": {"resumed": [a_by_step[i] for i in sorted(a_by_step)], "straight": b},
        "seconds": round(time.monotonic() - t0, 2),
    }


def canary_check(facts: dict, sft: Sft, device: str) -> dict:
    """Check 3: the canary's legs (the planned precision's, and FP8's where planned) against the
    golden curves: verify_env's own result on this node when it ran, else a run here for the config's
    sft section."""
    from llmft.env.canary import run_canary

    t0 = time.monotonic()
    canary = facts.get("canary")
    reused = isinstance(canary, dict)
    if not reused:
        canary = run_canary(facts, sft, device=device)
    legs = [f"{canary.get('path', {}).get('precision', '?')}: {canary.get('message')}"]
    ok = canary.get("ok") is True
    if "fp8" in canary:
        legs.append(f"fp8: {canary['fp8'].get('message')}")
        ok = ok and canary["fp8"].get("ok") is True
    diagnosis = f"; {canary['diagnosis']}" if canary.get("diagnosis") and not ok else ""
    return {
        "ok": ok,
        "message": "; ".join(legs) + diagnosis + (" (verify_env's canary)" if reused else ""),
        "legs": ["fp8" if leg.startswith("fp8") else leg.split(":")[0] for leg in legs],
        "seconds": round(time.monotonic() - t0, 2),
    }


def _recorded_slice(promoted: Path) -> tuple[dict, list[dict]]:
    """The promoted run's tuned evaluation (metrics.json) and its first EVAL_ROWS predictions."""
    metrics = read_json(promoted / "eval" / "tuned" / "metrics.json")
    with open(promoted / "eval" / "tuned" / "predictions.jsonl", encoding="utf-8") as fh:
        rows = [json.loads(line) for _, line in zip(range(EVAL_ROWS), fh, strict=False)]
    return metrics, rows


def _scores(rows: list[dict]) -> dict:
    n = max(1, len(rows))
    return {
        "rows": len(rows),
        "loss": sum(float(r["loss"]) for r in rows) / n,
        "exact_match": sum(float(r["exact_match"]) for r in rows) / n,
    }


def compare_scores(recorded: list[dict], now: list[dict]) -> dict:
    """Check 4's verdict: the promoted model's per-row scores now against the ones it recorded on the
    same rows (predictions.jsonl records: prompt, loss, exact_match)."""
    old, new = _scores(recorded), _scores(now)
    same_rows = [r["prompt"] for r in recorded] == [r["prompt"] for r in now]
    loss_off = _rel(new["loss"], old["loss"])
    em_off = abs(new["exact_match"] - old["exact_match"])
    ok = same_rows and loss_off <= EVAL_LOSS_TOLERANCE and em_off <= EVAL_EXACT_TOLERANCE
    rows_note = "" if same_rows else "; NOT the rows it was scored on (its held-out split changed)"
    return {
        "ok": ok,
        "message": (
            f"promoted model on {old['rows']} of its held-out rows: mean loss {new['loss']:.4f} vs recorded "
            f"{old['loss']:.4f} ({loss_off:.2%}, tolerance {EVAL_LOSS_TOLERANCE:.0%}), exact match "
            f"{new['exact_match']:.4f} vs {old['exact_match']:.4f} "
            f"(tolerance {EVAL_EXACT_TOLERANCE}){rows_note}"
        ),
        "recorded": old,
        "now": new,
        "same_rows": same_rows,
    }


def eval_drift(promoted: Path, scratch: Path, env: dict, timeout_s: float) -> dict:
    """Check 4: the promoted model on the first EVAL_ROWS of its held-out rows, scored again under this
    stack (`python -m llmft evaluate`, the settings it was scored with), against its recorded scores."""
    t0 = time.monotonic()
    metrics, recorded = _recorded_slice(promoted)
    template = read_json(promoted / "sft" / "config.json")["model"]["template"]
    keys = ("batch_size", "max_new_tokens", "decoding")
    cfg = {"run": promoted.name, "model": {"template": template}, "eval": {k: metrics[k] for k in keys}}
    out = scratch / "eval_drift"
    model = metrics.get("model") or str(promoted / "sft" / "model")
    cmd = [sys.executable, "-m", "llmft", "evaluate", "--config-json", json.dumps(cfg), "--model", model]
    cmd += ["--heldout", str(promoted / "data" / "heldout.jsonl"), "--out-dir", str(out)]
    cmd += [
        "--label",
        "quarantine",
        "--max-rows",
        str(len(recorded)),
        "--threads",
        str(len(os.sched_getaffinity(0))),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or not (out / "predictions.jsonl").exists():
        return {
            "ok": False,
            "message": f"the evaluation failed (exit {proc.returncode}): {proc.stderr[-500:]}",
        }
    with open(out / "predictions.jsonl", encoding="utf-8") as fh:
        now = [json.loads(line) for line in fh]
    return {**compare_scores(recorded, now), "seconds": round(time.monotonic() - t0, 2)}


def run_checks(facts: dict, cfg: Config, promoted: Path, scratch: Path, step=lambda name: None) -> dict:
    """Every check in order, each reported even when one fails ({check: result})."""
    device = "cuda" if facts.get("devices") else "cpu"
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    checks: dict[str, dict] = {}
    parts = {
        "accumulation": lambda: accumulation_parity(scratch, device, plan_ranks(cfg.hardware), env),
        "resume": lambda: resume_parity(scratch, device),
        "canary": lambda: canary_check(facts, cfg.sft, device),
        "eval_drift": lambda: eval_drift(promoted, scratch, env, float(cfg.verify.probe_timeout_seconds)),
    }
    for name, part in parts.items():
        step(decisions.CHECKS[name])
        try:
            checks[name] = part()
        except Exception as exc:  # a check that crashes is a failed check, named, not a lost report
            checks[name] = {"ok": False, "message": f"crashed: {type(exc).__name__}: {exc}"[:800]}
        mark = "ok  " if checks[name]["ok"] else "FAIL"
        print(f"[quarantine] {mark} {decisions.CHECKS[name]}: {checks[name]['message'][:400]}", flush=True)
    return checks


def node_quarantine(
    env: dict, scratch: Path, facts: dict, cfg: Config, budget_s: float, t0: float
) -> dict | None:
    """verify_env's part on one node (after its facts and canary): the decision against the promoted
    run's recorded stack and, for a quarantine, the checks in a child within what the probe's budget
    (`budget_s` from `t0`) leaves. None when the night asked for none (no nightly.compare_with)."""
    night = cfg.nightly
    if not night.compare_with:
        return None
    promoted = Path(night.compare_with)
    node_fp = stack_fp.fingerprint(facts)
    decision = decisions.decide(
        node_fp, decisions.promoted_stack(promoted), night.on_stack_change, night.quarantine_passed
    )
    node = {**decision, "promoted": str(promoted)}
    if decision["action"] != "quarantine":
        node["status"] = decisions.node_status(decision, None)
        return node
    print(f"[verify_env] stack changed: {stack_fp.diff_text(decision['changes'])}; quarantine", flush=True)
    t = time.monotonic()
    facts_path, out, progress = (
        scratch / "quarantine_facts.json",
        scratch / "quarantine.json",
        scratch / "quarantine.steps",
    )
    write_json(facts_path, facts)
    cmd = [sys.executable, "-m", "llmft.env.quarantine", "--facts", str(facts_path), "--out", str(out)]
    config_json = json.dumps(cfg.to_dict())
    cmd += ["--promoted", str(promoted), "--progress", str(progress), "--config-json", config_json]
    child_env = {k: v for k, v in env.items() if k not in RANK_ENV}
    left_s = max(budget_s - (t - t0), 0.1)
    try:
        proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=left_s)
        print(proc.stdout, end="", flush=True)
        checks = read_json(out) if out.exists() else None
        if checks is None:
            why = f"the quarantine crashed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
            checks = {"accumulation": {"ok": False, "message": why}}
    except subprocess.TimeoutExpired:
        steps = progress.read_text().split("\n") if progress.exists() else []
        last = next((x for x in reversed(steps) if x), "start")
        why = f"did not finish within verify.probe_timeout_seconds ({budget_s:g} s), in {last}"
        checks = {"accumulation": {"ok": False, "message": why}}
    node.update(checks=checks, seconds=round(time.monotonic() - t, 1))
    node["status"] = decisions.node_status(decision, checks)
    print(f"[verify_env] quarantine {node['status']} in {node['seconds']} s", flush=True)
    return node


def main(argv: list[str] | None = None) -> int:
    """`python -m llmft.env.quarantine --facts F --promoted RUN_DIR --config-json C --out O`."""
    ap = argparse.ArgumentParser(prog="python -m llmft.env.quarantine")
    ap.add_argument("--facts")
    ap.add_argument("--promoted", help="the promoted run's folder (results/<run>)")
    ap.add_argument("--config-json")
    ap.add_argument("--out")
    ap.add_argument("--progress", help="append each check's name here before it runs")
    ap.add_argument("--ranks-part", help="one rank of accumulation parity across ranks (torchrun)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=ACCUMULATION_ROWS)
    args = ap.parse_args(argv)
    from llmft.core.config import validate
    from llmft.core.imports import UNUSED, hidden
    from llmft.core.settings import Config

    if args.ranks_part:
        with hidden(*UNUSED):
            ranks_part(args.ranks_part, args.device, args.rows)
        return 0

    def step(name: str) -> None:
        if args.progress:
            with open(args.progress, "a", encoding="utf-8") as fh:
                fh.write(name + "\n")

    facts = read_json(args.facts)
    cfg = Config.from_dict(validate(json.loads(args.config_json)))
    with hidden(*UNUSED), tempfile.TemporaryDirectory(prefix="llmft-quarantine-") as tmp:
        checks = run_checks(facts, cfg, Path(args.promoted), Path(tmp), step)
    write_json(args.out, checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
