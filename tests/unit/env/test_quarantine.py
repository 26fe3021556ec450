"""The stack quarantine's checks (llmft.env.quarantine) on CPU, each passing on this machine's stack
and failing for the right reason: LLaMA-Factory's SFT trainer made wrong on purpose by the test
(tests/fixtures/broken_trainer: gradient accumulation that keeps only the first micro-batch's
gradients; a resume that restarts the optimizer and schedule), a failed canary leg, a promoted model
that scores otherwise now; and verify_env's side: no night, an unchanged or refused stack run no
check, and a failed quarantine stops verify_env whatever verify.on_failure says."""

from __future__ import annotations

import importlib.util
import json

import pytest
from llmft.core import stack as stack_fp
from llmft.core.config import validate
from llmft.core.settings import Config, replace
from llmft.env import quarantine as q

from tests.conftest import REPO


def typed(raw: dict) -> Config:
    return Config.from_dict(validate(raw))


BROKEN = REPO / "tests/fixtures/broken_trainer/sitecustomize.py"


def broken(monkeypatch, fault: str) -> None:
    """transformers' Trainer made wrong the way `fault` names, for this test only."""
    from transformers import Trainer

    spec = importlib.util.spec_from_file_location("broken_trainer", BROKEN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("training_step", "_load_optimizer_and_scheduler"):
        monkeypatch.setattr(Trainer, name, getattr(Trainer, name))  # restored after the test
    module.break_trainer(Trainer, fault)


def test_accumulation_parity_passes_on_this_stack_on_one_process_and_over_two_ranks(tmp_path):
    r = q.accumulation_parity(tmp_path, "cpu", ranks=2)
    assert r["ok"], r["message"]
    assert max(r["worst"].values()) <= q.ACCUMULATION_TOLERANCE
    assert list(r["runs"]) == ["one_batch", "accumulated", "2_ranks"]  # 2 ranks: torchrun over gloo
    assert all(len(run) == q.ACCUMULATION_STEPS for run in r["runs"].values())
    assert "and over 2 ranks (2 micro-batches of 1 each)" in r["message"]


def test_the_ranks_are_the_plan_s_and_a_step_s_rows_a_multiple_of_them():
    assert q.plan_ranks(typed({"hardware": {"gpus_per_node": 0, "processes_per_node": 2}}).hardware) == 2
    assert q.plan_ranks(typed({"hardware": {"gpus_per_node": 8, "processes_per_node": 0}}).hardware) == 8
    assert [q.accumulation_rows(r) for r in (1, 2, 3, 8)] == [4, 4, 6, 8]


def test_accumulation_parity_fails_when_micro_batch_gradients_are_dropped(tmp_path, monkeypatch):
    broken(monkeypatch, "accumulation")
    r = q.accumulation_parity(tmp_path, "cpu")
    assert not r["ok"]
    # the loss is still reported for every micro-batch; the gradient norm shows the dropped ones
    assert r["worst"]["loss"] <= q.ACCUMULATION_TOLERANCE < r["worst"]["grad_norm"]
    assert "gradient norm by" in r["message"] and "accumulated: step 1 loss" in r["message"]


def test_resume_parity_passes_on_this_stack(tmp_path):
    r = q.resume_parity(tmp_path, "cpu")
    assert r["ok"], r["message"]
    k = q.RESUME_STEPS
    assert r["optimizer_steps"] == {"resumed": 2 * k, "straight": 2 * k}
    assert [s["step"] for s in r["runs"]["resumed"]] == list(range(1, 2 * k + 1))


def test_resume_parity_fails_when_the_optimizer_restarts_on_resume(tmp_path, monkeypatch):
    broken(monkeypatch, "resume")
    r = q.resume_parity(tmp_path, "cpu")
    k = q.RESUME_STEPS
    assert not r["ok"]
    assert r["optimizer_steps"] == {"resumed": k, "straight": 2 * k}
    assert r["worst"]["learning_rate"] > q.RESUME_TOLERANCE
    assert f"optimizer step count {k} vs {2 * k}" in r["message"]


CANARY_OK = {"ok": True, "message": "loss 0.10% off the golden curve", "path": {"precision": "bf16"}}


def test_the_canary_check_takes_verify_env_s_canary_with_every_leg():
    sft = typed({}).sft
    ok = q.canary_check({"canary": CANARY_OK}, sft, "cpu")
    assert ok["ok"] and ok["legs"] == ["bf16"] and "verify_env's canary" in ok["message"]
    fp8_bad = {**CANARY_OK, "fp8": {"ok": False, "message": "FP8 drifts from bf16: 7.1% off"}}
    bad = q.canary_check({"canary": fp8_bad}, sft, "cpu")
    assert (
        not bad["ok"]
        and bad["legs"] == ["bf16", "fp8"]
        and "FP8 drifts from bf16: 7.1% off" in bad["message"]
    )
    off = {**CANARY_OK, "ok": False, "message": "loss 5.8% off", "diagnosis": "the attention kernel"}
    assert not q.canary_check({"canary": off}, sft, "cpu")["ok"]


def rows(losses: list[float], ems: list[float], prefix: str = "p") -> list[dict]:
    return [
        {"prompt": f"{prefix}{i}", "loss": loss, "exact_match": em}
        for i, (loss, em) in enumerate(zip(losses, ems, strict=True))
    ]


def test_evaluation_drift_compares_the_same_rows_within_the_tolerance():
    recorded = rows([2.0, 3.0, 4.0, 1.0], [1, 0, 1, 1])
    assert q.compare_scores(recorded, rows([2.001, 3.0, 4.0, 1.0], [1, 0, 1, 1]))["ok"]
    drifted = q.compare_scores(recorded, rows([2.2, 3.3, 4.4, 1.1], [1, 0, 1, 1]))
    assert (
        not drifted["ok"]
        and "mean loss 2.7500 vs recorded 2.5000 (10.00%, tolerance 2%)" in drifted["message"]
    )
    worse = q.compare_scores(recorded, rows([2.0, 3.0, 4.0, 1.0], [0, 0, 0, 1]))
    assert not worse["ok"] and "exact match 0.2500 vs 0.7500" in worse["message"]
    other = q.compare_scores(recorded, rows([2.0, 3.0, 4.0, 1.0], [1, 0, 1, 1], prefix="x"))
    assert not other["ok"] and "NOT the rows it was scored on" in other["message"]


def promoted_run(tmp_path, fp: dict):
    run = tmp_path / "results/night1"
    (run / "report").mkdir(parents=True)
    (run / "report/summary.json").write_text(json.dumps({"stack": stack_fp.run_fingerprint({"h": fp})}))
    return run


FACTS = {"host": "vm", "build": "cpu", "python": "3.11.7", "torch_version": "2.13.0+cpu"}


def test_verify_env_decides_without_a_child_when_there_is_nothing_to_check(tmp_path, monkeypatch):
    def no_child(*a, **k):
        raise AssertionError("no quarantine child for this decision")

    monkeypatch.setattr(q.subprocess, "run", no_child)
    run = promoted_run(tmp_path, stack_fp.fingerprint(FACTS))
    budget = (tmp_path, FACTS)
    assert q.node_quarantine({}, *budget, typed({}), 60, 0) is None  # not a night: no compare_with
    night = typed({"nightly": {"compare_with": "results/night1"}})
    monkeypatch.chdir(tmp_path)
    same = q.node_quarantine({}, *budget, night, 60, 0)
    assert same["status"] == "unchanged" and same["promoted"] == str(run.relative_to(tmp_path))
    changed = {**FACTS, "torch_version": "2.14.0+cpu"}
    refused = q.node_quarantine(
        {}, tmp_path, changed, replace(night, "nightly.on_stack_change", "refuse"), 60, 0
    )
    assert refused["status"] == "refused"
    assert [tuple(c) for c in refused["changes"]] == [("torch", "2.13.0+cpu", "2.14.0+cpu")]
    passed = [stack_fp.stack_hash(stack_fp.fingerprint(changed))]
    skipped = q.node_quarantine(
        {}, tmp_path, changed, replace(night, "nightly.quarantine_passed", passed), 60, 0
    )
    assert skipped["status"] == "skipped"


@pytest.mark.parametrize("on_failure", ["fail", "warn"])
def test_a_failed_quarantine_stops_verify_env_whatever_verify_on_failure_says(tmp_path, on_failure):
    from llmft.core import quarantine as decisions
    from llmft.core import slurm
    from llmft.env import verify

    cfg = typed({"verify": {"on_failure": on_failure}, "nightly": {"compare_with": "results/night1"}})
    decision = decisions.decide(
        {**stack_fp.fingerprint(FACTS), "torch": "2.14"},
        stack_fp.run_fingerprint({"vm": stack_fp.fingerprint(FACTS)}),
        "quarantine",
    )
    checks = {
        name: {"ok": name != "resume", "message": "optimizer step count 3 vs 6"} for name in decisions.CHECKS
    }
    facts = {
        **FACTS,
        "quarantine": {**decision, "checks": checks, "status": decisions.node_status(decision, checks)},
    }
    alloc = slurm.Allocation(
        job_id="1", nodes=["vm"], node_rank=0, master_addr="127.0.0.1", master_port=29500
    )
    out = tmp_path / "env/verify.json"
    coll = {"failure": {"check": "collectives", "message": "not measured", "fix": ""}}
    rc = verify._report(cfg, str(out), alloc, "cpu", [facts], coll, 0.0, 60.0)
    assert rc == 1
    report = json.loads((tmp_path / "env/verify.failed.json").read_text())
    assert report["quarantine"]["status"] == "failed"
    finding = next(f for f in report["findings"] if f["check"] == "quarantine")
    assert not finding["ok"] and "quarantine check resume parity (resume) failed on vm" in finding["message"]
    assert "torch 2.13.0+cpu -> 2.14" in finding["message"]


CRASHING_RANK = """import os, sys
mode = os.environ.get("LLMFT_TEST_RANK0_ABORTS", "")
if mode and os.environ.get("RANK") == "0" and "--ranks-part" in sys.argv:
    marker = os.environ["LLMFT_TEST_RANK0_MARKER"]
    if mode == "always" or not os.path.exists(marker):
        open(marker, "a").close()
        os.abort()
"""


# torchrun's output when rank 0 dies of a C++ exception in gloo (the rank's own lines, then torchrun's
# summary; hand-written in torch 2.x's format)
TORCHRUN_CRASH = """[rank0]: starting
terminate called after throwing an instance of 'gloo::IoException'
  what():  [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-08_00:40:40
  rank      : 0 (local_rank: 0)
  host      : localhost
  exitcode  : -6 (pid: 3790)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 3790
============================================================
"""


def test_a_crash_is_named_by_the_ranks_own_error_and_the_root_cause():
    words = q.crash_words(TORCHRUN_CRASH)
    assert "Connection closed by peer" in words and "terminate called" in words
    assert words.endswith("(root cause: rank      : 0 (local_rank: 0) exitcode  : -6 (pid: 3790)  (SIGABRT))")
    assert "Failures" not in words
    assert q.crash_words("Killed\n") == "Killed"


@pytest.mark.parametrize("mode", ["once", "always"])
def test_a_crashed_ranks_run_is_tried_once_more_and_a_second_crash_is_named(tmp_path, mode):
    """Rank 0 of accumulation parity's torchrun run aborts (SIGABRT, as a torn-down collective does):
    once, the second try gives the steps; every time, the check's error names both crashes."""
    import os

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(CRASHING_RANK)
    marker = tmp_path / "aborted"
    path = os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "LLMFT_TEST_RANK0_ABORTS": mode,
           "LLMFT_TEST_RANK0_MARKER": str(marker)}  # fmt: skip
    n = q.accumulation_rows(2)
    if mode == "once":
        steps = q._ranks_run(tmp_path, "cpu", 2, n, env, 600)
        assert marker.exists() and len(steps) == q.ACCUMULATION_STEPS
    else:
        with pytest.raises(
            RuntimeError,
            match=r"(?s)2 ranks crashed 3 times; (torchrun exit 1: .*SIGABRT.* \| ){2}torchrun exit 1: .*SIGABRT",  # noqa: E501
        ):
            q._ranks_run(tmp_path, "cpu", 2, n, env, 600)
