"""The stack quarantine's decisions (nightly.on_stack_change): pure functions of recorded facts.

A night compares each of its nodes' stack fingerprint (llmft.core.stack) with the one the promoted
run recorded (its summary.json `stack`, else its verify.json's). An unchanged stack runs nothing;
a changed one is, by nightly.on_stack_change, quarantined (verify_env runs the quarantine checks
on the node before any training: llmft.env.quarantine), refused, or allowed (recorded only). A
stack that passed its quarantine against the same promoted stack is not quarantined again: the
nightly records each pass in results/nightly/state.json and hands the passed stacks to the next
night's verify_env (nightly.quarantine_passed).

Shared by verify_env (which decides on the node and writes the verdict into verify.json) and the
nightly (which reads that verdict, refuses a failed night and records a pass); neither imports the
other for it.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmft.core import stack as stack_fp

MODES = ("quarantine", "allow", "refuse")
# The checks a quarantine runs, in order, with the names verdicts use.
CHECKS = {
    "accumulation": "accumulation parity",
    "resume": "resume parity",
    "canary": "numerics canary",
    "eval_drift": "evaluation drift",
}
# verify.json's quarantine status, from the worst node's: what the night does with it.
FAILED = ("failed", "refused")


def promoted_stack(run_dir: Path) -> dict | None:
    """The stack a run recorded (llmft.core.stack.run_fingerprint's shape): its summary.json `stack`,
    else its verify.json's (or one computed from that report's nodes); None when neither has one."""
    for path, pick in (
        (run_dir / "report" / "summary.json", lambda d: d.get("stack")),
        (run_dir / "env" / "verify.json", stack_fp.of_report),
    ):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        found = pick(data) if isinstance(data, dict) else None
        if isinstance(found, dict) and isinstance(found.get("fingerprint"), dict):
            return found
    return None


def decide(node_fp: dict, promoted: dict | None, mode: str, passed: list[str] | tuple = ()) -> dict:
    """What a node does about its stack: `action` unchanged | skip (passed before) | quarantine |
    refuse | allow | unknown (the promoted run recorded no stack), with the stack's hash, the promoted
    one's and the changes [(component, old, new)]."""
    new_hash = stack_fp.stack_hash(node_fp)
    if promoted is None:
        return {"action": "unknown", "stack": new_hash, "against": None, "changes": []}
    changes = stack_fp.diff(promoted["fingerprint"], node_fp)
    out = {"stack": new_hash, "against": promoted.get("hash"), "changes": changes}
    if not changes:
        return {**out, "action": "unchanged"}
    if mode == "allow":
        return {**out, "action": "allow"}
    if mode == "refuse":
        return {**out, "action": "refuse"}
    return {**out, "action": "skip" if new_hash in passed else "quarantine"}


def node_status(decision: dict, checks: dict | None) -> str:
    """One node's status: its decision's action, or for a quarantine `passed` / `failed` by its checks
    (a quarantine whose checks did not all report counts as failed)."""
    action = decision["action"]
    if action != "quarantine":
        return {"refuse": "refused", "allow": "allowed", "skip": "skipped"}.get(action, action)
    if not checks or any(name not in checks for name in CHECKS):
        return "failed"
    return "passed" if all(checks[name].get("ok") for name in CHECKS) else "failed"


# The run's status: the worst node's, in this order.
_ORDER = ("failed", "refused", "passed", "allowed", "skipped", "unknown", "unchanged")


def run_status(statuses: list[str]) -> str:
    return min(statuses, key=_ORDER.index) if statuses else "unchanged"


def first_failure(checks: dict | None) -> tuple[str, dict]:
    """(check name, its result) of the first failed (or missing) check."""
    checks = checks or {}
    for name in CHECKS:
        result = checks.get(name)
        if result is None or not result.get("ok"):
            return name, result or {"message": "did not report (the quarantine stopped before it)"}
    return "", {}


def message(host: str, node: dict, promoted_run: str | None) -> str:
    """One node's verdict as a line: the check and its numbers where one failed, and always the stack
    difference (old -> new, per component)."""
    status = node["status"]
    changes = [tuple(c) for c in node.get("changes") or []]
    where = f"promoted run {promoted_run}" if promoted_run else "the promoted run"
    diff = f"stack changed since {where}: {stack_fp.diff_text(changes)}" if changes else ""
    if status == "failed":
        name, result = first_failure(node.get("checks"))
        return (
            f"quarantine check {CHECKS.get(name, name)} ({name}) failed on {host}: "
            f"{result.get('message', '')}; {diff}"
        )
    if status == "refused":
        return f"nightly.on_stack_change refuse: {diff} on {host}"
    if status == "passed":
        return f"quarantine passed on {host} ({', '.join(CHECKS.values())}); {diff}"
    if status == "allowed":
        return f"nightly.on_stack_change allow: {diff} on {host} (recorded, not checked)"
    if status == "skipped":
        return f"quarantine skipped on {host}: this stack passed it before; {diff}"
    if status == "unknown":
        return f"{where} recorded no stack: nothing to compare on {host}"
    return f"stack unchanged since {where} on {host}"


def summarize(nodes: dict[str, dict], mode: str, promoted_run: str | None) -> dict:
    """verify.json's `quarantine`: every node's decision, checks and status ({host: node}), the run's
    status and one message per node (the failures first)."""
    statuses = [n["status"] for n in nodes.values()]
    status = run_status(statuses)
    lines = sorted(
        (message(h, n, promoted_run) for h, n in nodes.items()),
        key=lambda line: not line.startswith(("quarantine check", "nightly.on_stack_change refuse")),
    )
    return {
        "mode": mode,
        "promoted_run": promoted_run,
        "status": status,
        "ok": status not in FAILED,
        "message": " | ".join(lines),
        "nodes": nodes,
    }


def passes(state: dict, against: str | None) -> list[str]:
    """The stacks that passed a quarantine against the promoted stack `against` (state.json)."""
    if not against:
        return []
    return sorted({p["stack"] for p in state.get("quarantine_passes") or [] if p.get("against") == against})


def record_pass(state: dict, verdict: dict, run: str, at: str) -> list[dict]:
    """Record in state.json every node stack that passed its quarantine tonight; the new entries."""
    added = []
    known = {(p.get("stack"), p.get("against")) for p in state.get("quarantine_passes") or []}
    for node in (verdict.get("nodes") or {}).values():
        key = (node.get("stack"), node.get("against"))
        if node.get("status") == "passed" and key not in known:
            entry = {
                "stack": key[0],
                "against": key[1],
                "run": run,
                "at": at,
                "changes": stack_fp.diff_text([tuple(c) for c in node.get("changes") or []]),
            }
            state.setdefault("quarantine_passes", []).append(entry)
            known.add(key)
            added.append(entry)
    return added
