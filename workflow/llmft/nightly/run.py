"""Nightly retrains that are safe to leave unattended.

`python -m llmft nightly` = lock → skip when nothing changed → `snakemake` for a run named by date →
promotion gate → retention. State lives in `results/nightly/state.json`; the promoted run is the
symlink `results/current` (and `results/current.json`, which says why).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from llmft.core.config import BUILTIN_DATA
from llmft.core.io import read_json, write_json

LOWER_IS_BETTER = {"eval_loss"}


class NightlyLocked(RuntimeError):
    """Another nightly run holds the lock."""


def _hash_file(path: Path, h) -> None:
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)


def data_fingerprint(cfg: dict, base_dir: Path = Path(".")) -> str:
    """Hash of every data source's bytes (a folder: every file in it, sorted)."""
    h = hashlib.sha256()
    for src in cfg["data"]["sources"]:
        h.update(json.dumps(src, sort_keys=True).encode())
        if src.get("dataset_info"):  # a LLaMA-Factory dataset entry: the entry's file, and the entry
            from llmft.core.lfdataset import resolve

            entry = resolve(src, base_dir)
            h.update(json.dumps(entry["attr"], sort_keys=True).encode())
            src = {"path": entry["path"]}
        if src["path"] == BUILTIN_DATA:
            continue
        path = Path(src["path"])
        path = path if path.is_absolute() else base_dir / path
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
            _hash_file(f, h)
    return h.hexdigest()[:16]


def config_fingerprint(cfg: dict) -> str:
    """Hash of the validated config, without the run name and the nightly settings."""
    relevant = {k: v for k, v in cfg.items() if k not in ("run", "nightly")}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


class Lock:
    """An exclusive, non-blocking flock on results/nightly/lock; released when the process dies."""

    def __init__(self, path: Path):
        self.path = path
        self.fh = None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.path, "a+")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.fh.seek(0)
            holder = self.fh.read().strip() or "unknown"
            self.fh.close()
            raise NightlyLocked(
                f"another nightly run holds {self.path} ({holder}); not starting a second one"
            ) from None
        self.fh.seek(0)
        self.fh.truncate()
        self.fh.write(f"pid {os.getpid()} since {datetime.now(timezone.utc).isoformat(timespec='seconds')}")
        self.fh.flush()
        return self

    def __exit__(self, *exc):
        self.fh.close()


def gate(new: dict, current: dict | None, metric: str, tolerance: float) -> tuple[bool, str]:
    """Promote unless the new model is worse than the current one by more than `tolerance`."""
    value = new["tuned"][metric]
    if current is None:
        return True, f"first promoted model ({metric} {value:.4f})"
    ref = current["tuned"][metric]
    if metric in LOWER_IS_BETTER:
        ok, worse = value <= ref + tolerance, value - ref
    else:
        ok, worse = value >= ref - tolerance, ref - value
    verdict = "promoted" if ok else "rejected"
    return ok, (
        f"{verdict}: {metric} {value:.4f} vs current {ref:.4f} (run {current['run']}); "
        f"worse by {max(worse, 0):.4f}, tolerance {tolerance}"
    )


def benchmark_gate(new: dict, current: dict | None, budget: dict) -> tuple[bool, str]:
    """Refuse a model whose benchmark score fell below the promoted model's by more than the task's
    budget (nightly.max_benchmark_drop); a task the promoted model was not scored on is not gated."""
    if not budget or current is None:
        return True, ""
    ours = (new.get("benchmarks") or {}).get("tasks", {})
    theirs = current.get("benchmarks") or {}
    over, checked = [], 0
    for task, row in ours.items():
        limit = budget.get(task, budget.get("*"))
        ref = theirs.get(task)
        if limit is None or ref is None or ref.get("metric") != row["metric"]:
            continue
        checked += 1
        drop = (ref["tuned"] - row["tuned"]) if row["higher_is_better"] else (row["tuned"] - ref["tuned"])
        if drop > limit:
            over.append(
                f"{task} {row['metric']} {row['tuned']:.4f} vs current {ref['tuned']:.4f}: "
                f"dropped {drop:.4f}, budget {limit}"
            )
    if over:
        return False, f"rejected: benchmark forgetting (run {current['run']}): " + "; ".join(over)
    return True, f"benchmarks within budget ({checked} task(s))"


def _run_logged(cmd: list[str], log_path: Path) -> int:
    """Run a command, logged; forward SIGTERM as SIGINT (Snakemake ignores TERM while jobs run)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        previous = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGINT))
        try:
            return proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)


def _pages(cmd: list[str], results: Path, run: str, log_path: Path) -> int:
    """The run's page again through Snakemake's report job (it now shows the promotion), then the
    trend page across the runs retention kept (`llmft trend`). 0, or 1 when either fails."""
    page = str(results / run / "report" / "index.html")
    if _run_logged([*cmd, "--forcerun", "report", "--", page], log_path) != 0:
        print(f"[nightly] run {run}: re-rendering its page failed; see {log_path}", file=sys.stderr)
        return 1
    trend = [sys.executable, "-m", "llmft", "trend", "--results-dir", str(results)]
    if _run_logged([*trend, "--out", str(results / "trend.html")], log_path) != 0:
        print(f"[nightly] the trend page failed; see {log_path}", file=sys.stderr)
        return 1
    return 0


def promote(results: Path, run: str, summary: dict, reason: str) -> None:
    """Point results/current at the run (atomic symlink swap) and record why."""
    tmp = results / ".current.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run, target_is_directory=True)
    os.replace(tmp, results / "current")
    record = {"run": run, "reason": reason, "tuned": summary["tuned"]}
    if summary.get("benchmarks"):  # the promoted model's scores, for the next night's forgetting budget
        record["benchmarks"] = summary["benchmarks"]["tasks"]
    write_json(results / "current.json", record)


def retain(results: Path, state: dict, keep: int) -> list[str]:
    """Delete nightly runs beyond the newest `keep`; never the promoted one."""
    promoted = state.get("promoted")
    runs = [
        n["run"]
        for n in state["nights"]
        if n.get("status") in ("promoted", "rejected", "failed") and not n.get("deleted")
    ]
    deleted = []
    for run in runs[:-keep] if len(runs) > keep else []:
        if run == promoted:
            continue
        target = results / run
        if target.is_dir():
            shutil.rmtree(target)
        deleted.append(run)
    for night in state["nights"]:
        if night["run"] in deleted:
            night["deleted"] = True
    return deleted


def run_name(results: Path, today: str | None = None) -> str:
    """The night's run name: the date, with a suffix when that date already has a run."""
    base = today or datetime.now(timezone.utc).strftime("%Y-%m-%d")
    name, i = base, 1
    while (results / name).exists():
        i += 1
        name = f"{base}.{i}"
    return name


def nightly(
    cfg: dict,
    profile: str,
    run: str,
    results: Path = Path("results"),
    snakemake_args: list[str] | None = None,
    base_dir: Path = Path("."),
) -> int:
    """One scheduled retrain. Exit codes: 0 done or skipped, 1 failed, 3 locked."""
    state_path = results / "nightly" / "state.json"
    try:
        with Lock(results / "nightly" / "lock"):
            state = read_json(state_path) if state_path.exists() else {"nights": [], "promoted": None}
            fp = {"data": data_fingerprint(cfg, base_dir), "config": config_fingerprint(cfg)}
            if _skipped(state, state_path, run, fp):
                return 0
            t0 = time.time()
            cmd = _snakemake_command(profile, run, snakemake_args)
            log_path = results / "nightly" / f"{run}.log"
            print(f"[nightly] training run {run}: {' '.join(cmd)}", flush=True)
            rc = _run_logged(cmd, log_path)
            night = {"run": run, "fingerprint": fp, "at": _now(), "seconds": round(time.time() - t0, 1)}
            if rc != 0:
                night.update(status="failed", reason=f"snakemake exited {rc}; see results/nightly/{run}.log")
                state["nights"].append(night)
                write_json(state_path, state)
                print(f"[nightly] run {run} FAILED: {night['reason']}", file=sys.stderr)
                return 1
            _judge(cfg, results, run, night, state)
            state["nights"].append(night)
            deleted = retain(results, state, cfg["nightly"]["keep_runs"])
            if deleted:
                print(f"[nightly] retention: deleted {', '.join(deleted)}")
            write_json(state_path, state)
            return _pages(cmd, results, run, log_path)
    except NightlyLocked as exc:
        print(f"[nightly] {exc}", file=sys.stderr)
        return 3


def _skipped(state: dict, state_path: Path, run: str, fp: dict) -> bool:
    """Whether nothing changed since the last judged run; if so the night is recorded as skipped."""
    last_ok = next((n for n in reversed(state["nights"]) if n["status"] in ("promoted", "rejected")), None)
    if not (last_ok and last_ok["fingerprint"] == fp):
        return False
    print(
        f"[nightly] nothing changed since run {last_ok['run']} (data {fp['data']}, "
        f"config {fp['config']}); skipping"
    )
    state["nights"].append(
        {
            "run": run,
            "status": "skipped",
            "fingerprint": fp,
            "same_as": last_ok["run"],
            "at": _now(),
        }
    )
    write_json(state_path, state)
    return True


def _snakemake_command(profile: str, run: str, snakemake_args: list[str] | None) -> list[str]:
    """The Snakemake command line that trains the night's run under the profile."""
    return [
        sys.executable,
        "-m",
        "snakemake",
        "--profile",
        profile,
        "--config",
        f"run={run}",
        *(snakemake_args or []),
    ]


def _judge(cfg: dict, results: Path, run: str, night: dict, state: dict) -> None:
    """Whether the trained run replaces the promoted one (the gate); records the verdict in `night`."""
    summary = read_json(results / run / "report" / "summary.json")
    current = read_json(results / "current.json") if (results / "current.json").exists() else None
    current_summary = None
    if current:
        current_summary = {k: current.get(k) for k in ("run", "tuned", "benchmarks")}
    metric, tol = cfg["nightly"]["metric"], cfg["nightly"]["tolerance"]
    ok, reason = gate(summary, current_summary, metric, tol)
    if ok:
        ok, why = benchmark_gate(summary, current_summary, cfg["nightly"]["max_benchmark_drop"])
        reason = why if not ok else "; ".join(filter(None, [reason, why]))
    night.update(
        status="promoted" if ok else "rejected",
        reason=reason,
        metric={metric: summary["tuned"][metric]},
    )
    write_json(results / run / "promotion.json", night)
    if ok:
        promote(results, run, summary, reason)
        state["promoted"] = run
    print(f"[nightly] run {run} {reason}")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# The stages one night runs one after the other (the two evaluate jobs run side by side).
SERIAL_STAGES = ("verify_env", "prepare_data", "pack_data", "sft", "evaluate", "report")


def driver_minutes(repo: Path, profile: str) -> int:
    """How long the job that drives Snakemake must be allowed: every stage's runtime from the profile,
    one after the other, plus an hour for queueing between them. It must outlive sft's own limit."""
    import yaml

    path = Path(profile) if Path(profile).is_absolute() else repo / profile
    try:
        prof = yaml.safe_load((path / "config.yaml").read_text()) or {}
    except (OSError, ValueError):
        prof = {}
    default = int((prof.get("default-resources") or {}).get("runtime", 60))
    per_rule = prof.get("set-resources") or {}
    return sum(int((per_rule.get(r) or {}).get("runtime", default)) for r in SERIAL_STAGES) + 60


def schedule_lines(
    cfg: dict, repo: Path, profile: str = "profiles/slurm", config: str = "config/config.yaml"
) -> dict[str, str]:
    """The scrontab entry (Slurm's cron) and a plain crontab alternative, running `llmft nightly` on
    the same config file the entry was printed from.

    Every path is quoted for the shell cron runs the line in (`%`, which cron turns into a newline,
    escaped), and the log folder is made first: on a fresh checkout results/nightly/ does not exist.
    """
    n = cfg["nightly"]
    q = shlex.quote
    cmd = (
        f"cd {q(str(repo))} && mkdir -p results/nightly && {q(sys.executable)} -m llmft nightly "
        f"--config {q(config)} --profile {q(profile)} >> results/nightly/cron.log 2>&1"
    ).replace("%", "\\%")
    minutes = driver_minutes(repo, profile)
    days, rest = divmod(minutes, 24 * 60)
    limit = f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"
    scron = (
        f"#SCRON --partition={q(n['partition'])} --job-name=llmft-nightly --time={limit}\n"
        f"{n['schedule']} {cmd}\n"
    )
    return {"scrontab": scron, "crontab": f"{n['schedule']} {cmd}\n"}
