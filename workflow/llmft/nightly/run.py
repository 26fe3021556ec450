"""Nightly retrains that are safe to leave unattended.

`python -m llmft nightly` = lock → skip when nothing changed → `snakemake` for a run named by date
(its verify_env quarantines a changed software stack: llmft.nightly.quarantine; its gate rule writes
the verdict, nightly/gate.py; its report renders it) → promote or refuse as the verdict says →
retention → the trend page. State lives in `results/nightly/state.json`; the promoted run is the
symlink `results/current` (and `results/current.json`, which says why).
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from llmft.core.config import BUILTIN_DATA, ConfigError, is_run_name, validate
from llmft.core.io import read_json, write_json, write_text
from llmft.core.lineage import recorded_lineage
from llmft.core.settings import Config, Data, Nightly
from llmft.nightly import gate
from llmft.nightly.lock import Lock, NightlyLocked
from llmft.nightly.promote import GATE_WHY, PromotionError, current_run, protected, record, set_current
from llmft.nightly.quarantine import passed_stacks, take, verdict


def _hash_file(path: Path, h) -> None:
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)


def data_fingerprint(data: Data, base_dir: Path = Path(".")) -> str:
    """Hash of every data source's bytes (a folder: every file in it, sorted)."""
    h = hashlib.sha256()
    for src in data.sources:
        h.update(json.dumps(src, sort_keys=True).encode())
        if src.get("dataset_info"):  # a LLaMA-Factory dataset entry: the entry's file, and the entry
            from llmft.core.lf.lfdataset import resolve

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


def config_fingerprint(cfg: Config) -> str:
    """Hash of the validated config, without the run name and the nightly settings (of the config as
    a dict: what is hashed is its JSON, keys sorted)."""
    relevant = {k: v for k, v in cfg.to_dict().items() if k not in ("run", "nightly")}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


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


def _trend(results: Path, run: str, log_path: Path) -> int:
    """The trend page across the runs retention kept (`llmft trend`), with the night's verdict; the
    run's own page already shows it (the report rendered gate.json). 0, or 1 when it fails."""
    trend = [sys.executable, "-m", "llmft", "trend", "--results-dir", str(results)]
    if _run_logged([*trend, "--out", str(results / "trend.html")], log_path) != 0:
        print(f"[nightly] run {run}: the trend page failed; see {log_path}", file=sys.stderr)
        return 1
    return 0


def own_run_folder(results: Path, night: dict) -> Path | None:
    """The run folder a recorded night made, when retention may delete it: a run name (no path, not
    current or nightly), a real folder directly under results/ (not a symlink), and made by the
    nightly itself (`created`; a state written before that was recorded: any such folder)."""
    run = night.get("run")
    if not isinstance(run, str) or not is_run_name(run) or night.get("created") is False:
        return None
    target = results / run
    if target.is_symlink() or not target.is_dir():
        return None
    return target if target.resolve().parent == results.resolve() else None


def retain(results: Path, state: dict, keep: int, keep_promoted: int = 1) -> list[str]:
    """Delete nightly runs beyond the newest `keep`; never a protected one (promote.protected: the
    promoted run, the runs rollback returns to, and every run those descend from), and never a
    folder own_run_folder does not vouch for (a state.json holding `.`, `../x` or `current`)."""
    keep_runs = protected(results, state, keep_promoted)
    folders: dict[str, Path] = {}
    for night in state["nights"]:
        if night.get("status") in ("promoted", "rejected", "failed") and not night.get("deleted"):
            target = own_run_folder(results, night)
            if target is not None:
                folders.setdefault(night["run"], target)
    runs = list(folders)
    deleted = []
    for run in runs[:-keep] if len(runs) > keep else []:
        if run not in keep_runs:
            shutil.rmtree(folders[run])
            deleted.append(run)
    for night in state["nights"]:
        if night.get("run") in deleted:
            night["deleted"] = True
    return deleted


def _retain_logged(results: Path, state: dict, n: Nightly) -> None:
    """Retention after a night; when a kept run's lineage cannot be read, nothing is deleted."""
    try:
        deleted = retain(results, state, n.keep_runs, n.keep_promoted)
    except PromotionError as exc:
        print(f"[nightly] retention skipped, nothing deleted: {exc}", file=sys.stderr)
        return
    if deleted:
        print(f"[nightly] retention: deleted {', '.join(deleted)}")


def run_name(results: Path, today: str | None = None) -> str:
    """The night's run name: the date, with a suffix when that date already has a run."""
    base = today or datetime.now(timezone.utc).strftime("%Y-%m-%d")
    name, i = base, 1
    while (results / name).exists():
        i += 1
        name = f"{base}.{i}"
    return name


def nightly(
    cfg: Config,
    profile: str,
    run: str,
    results: Path = Path("results"),
    snakemake_args: list[str] | None = None,
    base_dir: Path = Path("."),
    configfile: str | None = None,
) -> int:
    """One scheduled night. Exit codes: 0 done or skipped, 1 failed, 2 refused before any job (the
    promoted model is missing or broken) or before any training (the stack quarantine: verify_env's
    checks failed on a changed stack, nightly.on_stack_change), 3 locked. `configfile`: the config
    file snakemake runs."""
    try:  # config key run's rule, as Snakemake's run wildcard: no path, not current or nightly
        validate({"run": run})
    except ConfigError as exc:
        print(f"[nightly] --run {run!r} refused, nothing recorded: {exc}", file=sys.stderr)
        return 2
    state_path = results / "nightly" / "state.json"
    try:
        with Lock(results / "nightly" / "lock"):
            state = read_json(state_path) if state_path.exists() else {"nights": [], "promoted": None}
            fp = {"data": data_fingerprint(cfg.data, base_dir), "config": config_fingerprint(cfg)}
            if _skipped(state, state_path, run, fp):
                return 0
            t0, night = time.time(), {"run": run, "fingerprint": fp, "mode": cfg.nightly.mode}
            # retention deletes only folders a night made: this one, or an earlier attempt of it
            night["created"] = not (results / run).exists() or any(
                n.get("run") == run and n.get("created") for n in state["nights"]
            )
            try:
                start = starting_point(cfg.nightly, results)
            except PromotionError as exc:
                night.update(status="refused", reason=str(exc), at=_now())
                _record(state, night)
                write_json(state_path, state)
                print(f"[nightly] run {run} refused before any job: {exc}", file=sys.stderr)
                return 2
            night.update(started_from=start["continue_from"] or "base model", note=start["note"])
            start["quarantine_passed"] = passed_stacks(results, state, start["promoted"])
            files = _configfiles(results, run, start, [configfile] if configfile else [])
            cmd = _snakemake_command(profile, run, [*files, *(snakemake_args or [])])
            log_path = results / "nightly" / f"{run}.log"
            rc = _train(cmd, run, start, log_path)
            night.update(at=_now(), seconds=round(time.time() - t0, 1))
            if take(state, night, verdict(results, run, t0), night["at"]):  # the stack quarantine
                _record(state, night)
                write_json(state_path, state)
                print(f"[nightly] run {run} refused before any training: {night['reason']}", file=sys.stderr)
                return 2
            if rc != 0 or not (results / run / "report" / "summary.json").exists():
                night.update(status="failed", reason=_failure(rc, run, log_path))
                _record(state, night)
                write_json(state_path, state)
                print(f"[nightly] run {run} FAILED: {night['reason']}", file=sys.stderr)
                return 1
            _judge(cfg.nightly, results, run, night, state)
            _record(state, night)
            write_json(state_path, state)  # the verdict is kept whatever retention meets
            _retain_logged(results, state, cfg.nightly)
            write_json(state_path, state)
            return _trend(results, run, log_path)
    except NightlyLocked as exc:
        print(f"[nightly] {exc}", file=sys.stderr)
        return 3


def _record(state: dict, night: dict) -> None:
    """Append the night; earlier attempts under the same run name that did not finish (failed,
    refused) become its `attempts`, so each run is one night in the history."""
    unfinished = ("failed", "refused")
    earlier = [n for n in state["nights"] if n.get("run") == night["run"] and n.get("status") in unfinished]
    if earlier:
        state["nights"] = [n for n in state["nights"] if not any(n is e for e in earlier)]
        attempts = [a for e in earlier for a in [*e.pop("attempts", []), e]]
        night["attempts"] = [{k: a.get(k) for k in ("status", "reason", "at")} for a in attempts]
    state["nights"].append(night)


FALLBACK_NOTE = "no promoted model: retrained from base, as nightly.fallback allows"


def continued_runs(results: Path, run: str) -> int:
    """How many runs in a row, ending with `run`, continued from the one before (the length of its
    recorded lineage chain, lineage.recorded_lineage; 0 for a run trained from the base model or made before
    lineage)."""
    return len(recorded_lineage(results / run).get("chain") or [])


def retrain_every_note(every: int, promoted: str, streak: int) -> str:
    return (
        f"nightly.retrain_every {every}: the promoted run {promoted} is {streak} continued run(s) from a "
        f"training from the base model (at most {every - 1} in a row): tonight retrains from the base "
        "model on all rows"
    )


def starting_point(n: Nightly, results: Path) -> dict:
    """What the night compares against and (continue mode) starts from, resolved once, before any
    job: a promotion during the night changes neither. Raises PromotionError naming the key."""
    mode = n.mode
    promoted = current_run(results, f"nightly.mode {mode}")
    point = {"promoted": promoted, "continue_from": None, "note": None}
    problem = gate.promoted_problem(n, results, promoted)
    if problem:
        raise PromotionError(problem)
    if mode == "retrain":
        return point
    if promoted:
        every, streak = n.retrain_every, continued_runs(results, promoted)
        if every is not None and streak + 1 >= every:
            return {**point, "note": retrain_every_note(every, promoted, streak)}
        return {**point, "continue_from": f"results/{promoted}"}
    if n.fallback == "retrain":
        return {**point, "note": FALLBACK_NOTE}
    raise PromotionError(
        f"nightly.mode continue: there is no promoted model yet ({results / 'current'} does not exist); "
        "promote a finished run with `llmft promote RUN`, or set nightly.fallback: retrain"
    )


def _configfiles(results: Path, run: str, start: dict, files: list[str]) -> list[str]:
    """`--configfile` for snakemake: the night's config, then what this night sets over it
    (results/nightly/<run>.config.yaml): the promoted run to score on this run's held-out split and,
    continuing, to start from. One flag: a second --configfile would replace the first."""
    over = {}
    if start["promoted"]:
        over["nightly"] = {"compare_with": f"results/{start['promoted']}"}
        if start.get("quarantine_passed"):  # stacks that passed a quarantine already
            over["nightly"]["quarantine_passed"] = start["quarantine_passed"]
    if start["continue_from"]:
        over["model"] = {"continue_from": start["continue_from"]}
    if over:
        import yaml

        path = results / "nightly" / f"{run}.config.yaml"
        write_text(path, yaml.safe_dump(over, sort_keys=True))
        files = [*files, str(path)]
    return ["--configfile", *files] if files else []


def _train(cmd: list[str], run: str, start: dict, log_path: Path) -> int:
    """Run the night's snakemake, saying first what it starts from (and the fallback, if taken)."""
    origin = start["continue_from"] or "the base model (model.name_or_path)"
    lines = [f"[nightly] training run {run} from {origin}: {' '.join(cmd)}"]
    if start["note"]:
        lines.insert(0, f"[nightly] run {run}: {start['note']}")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        log.write("".join(line + "\n" for line in lines))
    print("\n".join(lines), flush=True)
    return _run_logged(cmd, log_path)


def _failure(rc: int, run: str, log_path: Path) -> str:
    """Why a night failed: snakemake's exit code (with the config error it stopped on), or, when it
    exited 0 without the run's summary.json (a target or --until among the snakemake arguments
    stopped it before the report), that; nothing is judged either way."""
    if rc == 0:
        return (
            f"snakemake exited 0 without results/{run}/report/summary.json (a target or --until among "
            "the snakemake arguments stops before the report): nothing to judge; "
            f"see results/nightly/{run}.log"
        )
    error = _config_error(log_path)
    why = f"snakemake exited {rc}" + (f": {error}" if error else "")
    return f"{why}; see results/nightly/{run}.log"


def _config_error(log_path: Path) -> str | None:
    """The config error snakemake stopped on before any job (the workflow's `llmft config error:`
    line), so the night's failure names the key rather than only pointing at its log."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    errors = [line.strip() for line in lines if "llmft config error:" in line]
    return errors[-1] if errors else None


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


def _judge(n: Nightly, results: Path, run: str, night: dict, state: dict) -> None:
    """Act on the gate's verdict (nightly/gate.py: the run's gate.json, or on a first night the
    verdict from its summary.json): record it in `night` and the run's promotion.json, and on
    promotion move results/current and add the move to the state's history."""
    current = read_json(results / "current.json") if (results / "current.json").exists() else None
    verdict = gate.night_verdict(n, results / run, current)
    ok, reason = verdict["status"] == "promoted", verdict["reason"]
    night.update(status=verdict["status"], reason=reason, metric=verdict["score"])
    write_json(results / run / "promotion.json", night)
    if ok:
        set_current(results, run, reason)
        record(state, "promote", current["run"] if current else None, run, GATE_WHY + reason)
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
    n: Nightly, repo: Path, profile: str = "profiles/slurm", config: str = "config/config.yaml"
) -> dict[str, str]:
    """The scrontab entry (Slurm's cron) and a plain crontab alternative, running `llmft nightly` on
    the same config file the entry was printed from.

    Every path is quoted for the shell cron runs the line in (`%`, which cron turns into a newline,
    escaped), and the log folder is made first: on a fresh checkout results/nightly/ does not exist.
    """
    q = shlex.quote
    cmd = (
        f"cd {q(str(repo))} && mkdir -p results/nightly && {q(sys.executable)} -m llmft nightly "
        f"--config {q(config)} --profile {q(profile)} >> results/nightly/cron.log 2>&1"
    ).replace("%", "\\%")
    minutes = driver_minutes(repo, profile)
    days, rest = divmod(minutes, 24 * 60)
    limit = f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"
    scron = (
        f"#SCRON --partition={q(n.partition)} --job-name=llmft-nightly --time={limit}\n{n.schedule} {cmd}\n"
    )
    return {"scrontab": scron, "crontab": f"{n.schedule} {cmd}\n"}
