"""The stack quarantine's decisions (llmft.core.quarantine): same stack -> nothing, a changed one
quarantined, refused or allowed by nightly.on_stack_change, a passed one skipped; the verdict's
status and message; the passes state.json records."""

from __future__ import annotations

import json

import pytest
from llmft.core import quarantine as q
from llmft.core import stack as stack_fp

OLD = {k: None for k in stack_fp.FIELDS} | {"torch": "2.9.0", "rocm": "7.0.2", "build": "rocm"}
NEW = OLD | {"torch": "2.10.0", "rocm": "7.1.0"}


def promoted(fp: dict = OLD) -> dict:
    return stack_fp.run_fingerprint({"node1": fp})


def test_an_unchanged_stack_runs_nothing_whatever_the_mode():
    for mode in q.MODES:
        d = q.decide(OLD, promoted(), mode)
        assert d["action"] == "unchanged" and d["changes"] == []
        assert q.node_status(d, None) == "unchanged"


def test_a_changed_stack_is_quarantined_refused_or_allowed_by_the_mode():
    actions = {mode: q.decide(NEW, promoted(), mode)["action"] for mode in q.MODES}
    assert actions == {"quarantine": "quarantine", "refuse": "refuse", "allow": "allow"}
    d = q.decide(NEW, promoted(), "quarantine")
    assert d["changes"] == [("torch", "2.9.0", "2.10.0"), ("rocm", "7.0.2", "7.1.0")]
    assert d["stack"] == stack_fp.stack_hash(NEW) and d["against"] == promoted()["hash"]
    assert q.node_status(q.decide(NEW, promoted(), "refuse"), None) == "refused"
    assert q.node_status(q.decide(NEW, promoted(), "allow"), None) == "allowed"


def test_a_stack_that_passed_against_the_same_promoted_stack_is_skipped():
    d = q.decide(NEW, promoted(), "quarantine", passed=[stack_fp.stack_hash(NEW)])
    assert d["action"] == "skip" and q.node_status(d, None) == "skipped"
    # refuse still refuses a stack that passed a quarantine once
    assert q.decide(NEW, promoted(), "refuse", passed=[stack_fp.stack_hash(NEW)])["action"] == "refuse"


def test_no_recorded_stack_is_unknown_not_a_quarantine():
    d = q.decide(NEW, None, "quarantine")
    assert d["action"] == "unknown" and q.node_status(d, None) == "unknown"


def checks(**failed) -> dict:
    return {name: {"ok": name not in failed, "message": failed.get(name, "fine")} for name in q.CHECKS}


def test_a_quarantine_passes_only_when_every_check_passed():
    d = q.decide(NEW, promoted(), "quarantine")
    assert q.node_status(d, checks()) == "passed"
    assert q.node_status(d, checks(resume="optimizer step count 3 vs 6")) == "failed"
    partial = {k: v for k, v in checks().items() if k != "eval_drift"}  # stopped before the last
    assert q.node_status(d, partial) == "failed"
    assert q.first_failure(partial)[0] == "eval_drift"


def node(status_checks: dict | None, mode: str = "quarantine") -> dict:
    d = q.decide(NEW, promoted(), mode)
    return {**d, "checks": status_checks, "status": q.node_status(d, status_checks)}


def test_a_failure_names_the_check_its_numbers_and_the_stack_difference():
    v = q.summarize(
        {"node1": node(checks(accumulation="gradient norm 0.625 vs 1.293"))}, "quarantine", "night1"
    )
    assert v["status"] == "failed" and v["ok"] is False
    assert v["message"] == (
        "quarantine check accumulation parity (accumulation) failed on node1: gradient norm 0.625 vs 1.293; "
        "stack changed since promoted run night1: torch 2.9.0 -> 2.10.0; rocm 7.0.2 -> 7.1.0"
    )


def test_the_run_status_is_the_worst_node_s_and_failures_come_first():
    nodes = {"a": node(checks()), "b": node(checks(canary="loss 6% off"))}
    v = q.summarize(nodes, "quarantine", "night1")
    assert v["status"] == "failed" and v["message"].startswith("quarantine check numerics canary")
    assert "quarantine passed on a" in v["message"]
    assert q.summarize({"a": node(None, "refuse")}, "refuse", "n")["status"] == "refused"
    allowed = q.summarize({"a": node(None, "allow")}, "allow", "n")
    assert allowed["ok"] and "recorded, not checked" in allowed["message"]
    assert q.run_status(["unchanged", "skipped"]) == "skipped"


def test_a_pass_is_recorded_once_and_offered_against_the_same_promoted_stack_only():
    state: dict = {"nights": []}
    v = q.summarize({"node1": node(checks())}, "quarantine", "night1")
    added = q.record_pass(state, v, "night2", "2026-12-07T02:00:00+00:00")
    assert [e["stack"] for e in added] == [stack_fp.stack_hash(NEW)]
    assert added[0]["changes"] == "torch 2.9.0 -> 2.10.0; rocm 7.0.2 -> 7.1.0" and added[0]["run"] == "night2"
    assert q.record_pass(state, v, "night3", "later") == []  # already recorded
    assert q.passes(state, promoted()["hash"]) == [stack_fp.stack_hash(NEW)]
    assert q.passes(state, "0" * 12) == [] and q.passes(state, None) == []
    failed = q.summarize({"node1": node(checks(resume="x"))}, "quarantine", "night1")
    assert q.record_pass({}, failed, "n", "t") == []


@pytest.mark.parametrize("where", ["summary", "verify", "verify_nodes_only", "none"])
def test_the_promoted_stack_is_read_from_summary_then_verify(tmp_path, where):
    run = tmp_path / "night1"
    (run / "report").mkdir(parents=True)
    (run / "env").mkdir()
    recorded = promoted()
    if where == "summary":
        (run / "report/summary.json").write_text(json.dumps({"run": "night1", "stack": recorded}))
    elif where == "verify":
        (run / "report/summary.json").write_text(json.dumps({"run": "night1"}))  # before the stack
        (run / "env/verify.json").write_text(json.dumps({"stack": recorded}))
    elif where == "verify_nodes_only":
        facts = {"host": "node1", "build": "cpu", "python": "3.11.7", "torch_version": "2.13.0+cpu"}
        (run / "env/verify.json").write_text(json.dumps({"nodes": [facts]}))
        recorded = stack_fp.of_nodes([facts])
    got = q.promoted_stack(run)
    assert got == (None if where == "none" else recorded)
