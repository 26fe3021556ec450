"""The promoted model: `results/current`, its history, `llmft promote` / `llmft rollback`, and the
runs retention must keep.

`results/current` is a relative symlink to a run folder, replaced by a rename (never absent while it
moves); `results/current.json` says which run and why, written atomically. Every move is an entry
of `promotions` in results/nightly/state.json: {action, from, to, who, at, why}. Replaying those
entries (promote pushes, rollback pops) gives the stack of promoted runs; rollback returns to the
one below the top.
"""

from __future__ import annotations

import getpass
import os
import socket
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from llmft.core.config import ConfigError, validate
from llmft.core.io import read_json, write_json
from llmft.core.lineage import recorded_lineage, run_problems
from llmft.nightly.gate import promoted_record
from llmft.nightly.lock import Lock

# How a promotion by the nightly gate is recorded in the history (run._judge).
GATE_WHY = "nightly gate: "
# What a move by hand does after it: (results, its history entry, {run: status}) -> notes to print.
Show = Callable[[Path, dict, dict], list[str]]


class PromotionError(ConfigError):
    """A run cannot be promoted, continued from or rolled back to; the message names run and key."""


def check_run(results: Path, run: str, what: str) -> None:
    """Refuse, naming `what` (the key or command) and the run, a run that is not finished."""
    problems = run_problems(results / run)
    if problems:
        raise PromotionError(f"{what}: run {run} is not a finished run: " + "; ".join(problems))


def current_run(results: Path, what: str = "results/current") -> str | None:
    """The run `results/current` points at, checked; None when nothing was promoted yet.
    A dangling link, or one to a folder that is not a finished run, is an error naming `what`."""
    link = results / "current"
    if not link.is_symlink():
        if link.exists():
            raise PromotionError(f"{what}: {link} is not a symlink to a run folder; move it away")
        return None
    target = os.readlink(link)
    run = Path(target).name
    if Path(target).is_absolute() or Path(target).parent != Path(".") or run in ("", ".", ".."):
        raise PromotionError(f"{what}: {link} points at {target!r}, not at a run folder beside it")
    if not (results / run).is_dir():
        raise PromotionError(f"{what}: {link} points at run {run}, whose folder {results / run} is gone")
    check_run(results, run, what)
    return run


def set_current(results: Path, run: str, reason: str) -> None:
    """Point results/current at the run (a new symlink renamed over the old one) and write
    results/current.json: the run, why, and the scores the next night's gate compares against."""
    summary = read_json(results / run / "report" / "summary.json")
    tmp = results / f".current.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run, target_is_directory=True)
    os.replace(tmp, results / "current")
    # the scores the next night's gate compares against (gate.promoted_record), and why
    record = {**promoted_record(summary), "run": run, "reason": reason}
    write_json(results / "current.json", record)


def who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def record(state: dict, action: str, old: str | None, new: str, why: str) -> dict:
    """Append one move of results/current to the state's history; the state's `promoted` follows."""
    entry = {
        "action": action,
        "from": old,
        "to": new,
        "who": who(),
        "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "why": why,
    }
    history(state).append(entry)
    state["promoted"] = new
    return entry


def history(state: dict) -> list[dict]:
    """The state's `promotions`; a state written before the history existed starts with its
    `promoted` run, so a rollback can still return to it."""
    if "promotions" not in state:
        earlier = state.get("promoted")
        seed = {
            "action": "promote",
            "from": None,
            "to": earlier,
            "who": None,
            "at": None,
            "why": "before the history",
        }
        state["promotions"] = [seed] if earlier else []
    return state["promotions"]


def promoted_stack(state: dict) -> list[str]:
    """The promoted runs, oldest first, as the history leaves them: a promotion pushes its run, a
    rollback pops the top."""
    stack: list[str] = []
    for entry in history(state):
        if entry["action"] == "rollback":
            stack = stack[:-1]
        elif not stack or stack[-1] != entry["to"]:
            stack.append(entry["to"])
    return stack


def ancestors(results: Path, run: str) -> set[str]:
    """Every run `run` descends from: its recorded lineage (lineage.recorded_lineage: lineage.json,
    else an older run's summary.json), parent and chain, recursively. A lineage that cannot be read is an
    error: retention must not guess what is safe to delete."""
    seen: set[str] = set()
    todo = [run]
    while todo:
        name = todo.pop()
        if not (results / name).is_dir():
            continue  # already gone: nothing to protect, and its own parents were recorded in the chain
        try:
            lineage = recorded_lineage(results / name)
        except (OSError, ValueError) as exc:
            why = f"retention: cannot read the lineage of run {name} ({results / name}): {exc}"
            raise PromotionError(why) from None
        for parent in [lineage.get("parent"), *(lineage.get("chain") or [])]:
            if parent and parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def protected(results: Path, state: dict, keep_promoted: int) -> set[str]:
    """What retention never deletes: the newest `keep_promoted` promoted runs (the current one and
    the runs rollback returns to) and every run each descends from."""
    keep = set(promoted_stack(state)[-keep_promoted:])
    if state.get("promoted"):
        keep.add(state["promoted"])
    for run in list(keep):
        keep |= ancestors(results, run)
    return keep


def _linked(results: Path) -> str | None:
    """The run name results/current names, whether or not its folder is whole (promote repairs it)."""
    link = results / "current"
    return Path(os.readlink(link)).name if link.is_symlink() else None


def _state(results: Path) -> tuple[Path, dict]:
    path = results / "nightly" / "state.json"
    return path, (read_json(path) if path.exists() else {"nights": [], "promoted": None})


def promote_command(results: Path, run: str, why: str, show: Show) -> str:
    """`llmft promote RUN`: a finished run becomes results/current, under the nightly lock; `show`
    (llmft.report.promotion.show_move) then tells the runs' pages."""
    try:  # the schema's rule for run names: no path, not current or nightly
        validate({"run": run})
    except ConfigError as exc:
        raise PromotionError(f"llmft promote: {exc}") from None
    with Lock(results / "nightly" / "lock"):
        check_run(results, run, f"llmft promote {run}")
        old = _linked(results)
        path, state = _state(results)
        if old == run and (results / "current.json").exists():
            by = _by(state, run)
            raise PromotionError(f"llmft promote {run}: run {run} is already the promoted model{by}")
        set_current(results, run, f"promoted by hand ({who()}): {why}")
        entry = record(state, "promote", old, run, why)
        write_json(path, state)
        notes = show(results, entry, {run: "promoted", old: "replaced"})
    return "\n".join(
        [f"results/current: {old or 'none'} -> {run} ({entry['who']}, {entry['at']}): {why}", *notes]
    )


def _by(state: dict, run: str) -> str:
    """Who made `run` the promoted model, from the history's last move to it."""
    entry = next((e for e in reversed(history(state)) if e.get("to") == run), None)
    if entry is None:
        return ""
    why = str(entry.get("why") or "")
    if why.startswith(GATE_WHY):
        return f": the nightly gate promoted it ({why[len(GATE_WHY) :]}); nothing to do"
    return f": {entry.get('who') or 'someone'} promoted it at {entry.get('at')} ({why}); nothing to do"


def rollback_command(results: Path, why: str, show: Show) -> str:
    """`llmft rollback`: results/current returns to the run promoted before the current one; `show`
    as for promote_command."""
    with Lock(results / "nightly" / "lock"):
        path, state = _state(results)
        stack = promoted_stack(state)
        old = _linked(results)
        if len(stack) < 2:
            raise PromotionError(
                f"llmft rollback: no earlier promoted run to return to (promoted so far: "
                f"{', '.join(stack) or 'none'}; history in {path})"
            )
        target = stack[-2]
        if not (results / target).is_dir():
            raise PromotionError(
                f"llmft rollback: the previously promoted run {target}'s folder {results / target} is gone; "
                f"promote another run with `llmft promote RUN`"
            )
        check_run(results, target, "llmft rollback")
        set_current(results, target, f"rolled back by hand ({who()}) from {old}: {why}")
        entry = record(state, "rollback", old, target, why)
        write_json(path, state)
        notes = show(results, entry, {target: "promoted", old: "rolled back"})
    return "\n".join(
        [f"results/current: {old} -> {target} ({entry['who']}, {entry['at']}, rollback): {why}", *notes]
    )
