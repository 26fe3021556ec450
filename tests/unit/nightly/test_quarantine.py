"""The nightly's side of the stack quarantine (llmft.nightly.quarantine): a failed quarantine refuses
the night naming the check and the stack difference, results/current untouched; a pass is recorded
in state.json and handed to the next night's verify_env (nightly.quarantine_passed); a stale
verify.failed.json of an earlier attempt is never read as tonight's. snakemake is replaced here by a
stand-in that writes the verify_env report a night would (the real nightly: tests/workflow/
test_quarantine.py)."""

from __future__ import annotations

import json
import os
import time

import yaml
from llmft.core import quarantine as decisions
from llmft.core import stack as stack_fp
from llmft.core.settings import Config
from llmft.nightly import quarantine as nq
from llmft.nightly import run as nightly_run

OLD = {k: None for k in stack_fp.FIELDS} | {"torch": "2.9.0", "build": "rocm"}
NEW = OLD | {"torch": "2.10.0"}
RECORDED = stack_fp.run_fingerprint({"node1": OLD})


def promoted(results) -> None:
    (results / "night1/report").mkdir(parents=True)
    (results / "night1/report/summary.json").write_text(json.dumps({"run": "night1", "stack": RECORDED}))
    (results / "current").symlink_to("night1", target_is_directory=True)


def quarantine_report(failed: str = "") -> dict:
    d = decisions.decide(NEW, RECORDED, "quarantine")
    checks = {n: {"ok": n != failed, "message": "gradient norm 0.625 vs 1.293"} for n in decisions.CHECKS}
    node = {**d, "checks": checks, "status": decisions.node_status(d, checks)}
    return decisions.summarize({"node1": node}, "quarantine", "night1")


def fake_night(monkeypatch, results, report_name: str | None, report: dict | None, rc: int, seen: list):
    """snakemake for the night: writes verify_env's report (verify.json, or verify.failed.json as a
    failed verify_env keeps it) and exits `rc`; records the night's config overrides in `seen`."""
    monkeypatch.setattr(
        nightly_run,
        "starting_point",
        lambda cfg, res: {"promoted": "night1", "continue_from": None, "note": None},
    )

    def train(cmd, run, start, log_path):
        over = results / "nightly" / f"{run}.config.yaml"
        seen.append(yaml.safe_load(over.read_text()) if over.exists() else {})
        if report_name:
            (results / run / "env").mkdir(parents=True, exist_ok=True)
            (results / run / "env" / report_name).write_text(json.dumps({"ok": False, "quarantine": report}))
        return rc

    monkeypatch.setattr(nightly_run, "_train", train)


def test_a_failed_quarantine_refuses_the_night_and_leaves_current(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    promoted(results)
    seen: list = []
    fake_night(monkeypatch, results, "verify.failed.json", quarantine_report("accumulation"), 1, seen)
    assert nightly_run.nightly(Config(), "profiles/local", "n2", results) == 2
    night = json.loads((results / "nightly/state.json").read_text())["nights"][-1]
    assert night["status"] == "refused" and night["stack"]["status"] == "failed"
    assert night["reason"] == (
        "quarantine: quarantine check accumulation parity (accumulation) failed on node1: gradient norm "
        "0.625 vs 1.293; stack changed since promoted run night1: torch 2.9.0 -> 2.10.0"
    )
    assert "[nightly] run n2 refused before any training: quarantine: quarantine check accumulation" in (
        capsys.readouterr().err
    )
    assert os.readlink(results / "current") == "night1" and not (results / "current.json").exists()
    assert "quarantine_passes" not in json.loads((results / "nightly/state.json").read_text())


def test_a_pass_is_recorded_and_the_next_night_is_told(tmp_path, monkeypatch):
    results = tmp_path / "results"
    promoted(results)
    seen: list = []
    # the night passes its quarantine, then fails later (no training needed for this test)
    fake_night(monkeypatch, results, "verify.json", quarantine_report(), 1, seen)
    assert nightly_run.nightly(Config(), "profiles/local", "n2", results) == 1
    state = json.loads((results / "nightly/state.json").read_text())
    [entry] = state["quarantine_passes"]
    assert entry["stack"] == stack_fp.stack_hash(NEW) and entry["against"] == RECORDED["hash"]
    assert entry["run"] == "n2" and entry["changes"] == "torch 2.9.0 -> 2.10.0"
    assert state["nights"][-1]["stack"]["status"] == "passed"
    assert seen[0] == {"nightly": {"compare_with": "results/night1"}}  # nothing passed before n2
    fake_night(monkeypatch, results, None, None, 1, seen)
    assert nightly_run.nightly(Config(), "profiles/local", "n3", results) == 1
    assert seen[1]["nightly"] == {"compare_with": "results/night1", "quarantine_passed": [entry["stack"]]}


def test_a_stale_failed_report_of_an_earlier_attempt_is_not_tonights(tmp_path):
    env = tmp_path / "results/n2/env"
    env.mkdir(parents=True)
    (env / "verify.failed.json").write_text(json.dumps({"quarantine": quarantine_report("resume")}))
    assert nq.verdict(tmp_path / "results", "n2", since=time.time() + 60) is None
    assert nq.verdict(tmp_path / "results", "n2", since=time.time() - 60)["status"] == "failed"
    assert nq.verdict(tmp_path / "results", "n9", since=0) is None


def test_allowed_and_refused_stacks(tmp_path):
    allowed = decisions.summarize(
        {"node1": {**decisions.decide(NEW, RECORDED, "allow"), "status": "allowed"}}, "allow", "night1"
    )
    night: dict = {"run": "n2"}
    assert nq.take({}, night, allowed, "t") is False and night["stack"]["status"] == "allowed"
    refused = decisions.summarize(
        {"node1": {**decisions.decide(NEW, RECORDED, "refuse"), "status": "refused"}}, "refuse", "night1"
    )
    night = {"run": "n2"}
    assert nq.take({}, night, refused, "t") is True and night["status"] == "refused"
    assert night["reason"] == (
        "quarantine: nightly.on_stack_change refuse: stack changed since promoted run night1: "
        "torch 2.9.0 -> 2.10.0 on node1"
    )
