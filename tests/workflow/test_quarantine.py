"""The stack quarantine through the real nightly on the local profile: the promoted run (a copy of the
session's demo run, promoted) recorded another stack than this machine's (its summary.json and
verify.json `stack` edited: torch 2.12.0+cpu), so tonight's verify_env quarantines the stack before
any training. On this machine's trainer the quarantine passes, is recorded, the night trains, and the
next night on the same stack skips it; with a trainer the test breaks (tests/fixtures/broken_trainer on
PYTHONPATH: gradient accumulation keeps only each step's first micro-batch's gradients) the night is
refused naming the check, its numbers and the stack difference, and results/current stays."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import BIN, DEMO, REPO, make_workdir, shared_run, snakemake_env
from tests.stacks import record_another_stack

pytestmark = pytest.mark.workflow

BROKEN = REPO / "tests/fixtures/broken_trainer"
OLD_TORCH = "2.12.0+cpu"
# A cheap night: a couple of steps, a few rows scored (the gate's too), no benchmarks.
NIGHT = {
    "sft__max_steps": 2,
    "eval__max_rows": 8,
    "nightly__gate_max_rows": 8,
    "nightly__metric": "eval_loss",
    "nightly__tolerance": 0.0,
}


def llmft(work: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "python"), "-m", "llmft", *args],
        cwd=work, env=snakemake_env("local", env), capture_output=True, text=True, timeout=1500,
    )  # fmt: skip


def night(work: Path, run: str, *targets: str, env: dict | None = None) -> subprocess.CompletedProcess:
    profile = str(REPO / "profiles" / "local")
    args = ("nightly", "--run", run, "--profile", profile, "--", "-s", str(REPO / "Snakefile"), *targets)
    return llmft(work, *args, env=env)


def promoted_on_another_stack(work: Path) -> dict:
    """Promote the copied demo run and make its recorded stack another torch's; the edited stack."""
    proc = llmft(work, "promote", "demo", "--why", "the quarantine's reference")
    assert proc.returncode == 0, proc.stderr
    return record_another_stack(work / "results/demo", torch=OLD_TORCH)


def state(work: Path) -> dict:
    return json.loads((work / "results/nightly/state.json").read_text())


def quarantine_of(work: Path, run: str, name: str = "verify.json") -> dict:
    return json.loads((work / "results" / run / "env" / name).read_text())["quarantine"]


def test_a_changed_stack_is_quarantined_passes_is_recorded_and_the_next_night_skips_it(tmp_path):
    """Both nights stop after verify_env (its report as the snakemake target): what follows a pass is
    an ordinary night, and training it would cost the suite minutes for nothing asserted here."""
    work = shared_run("demo", **DEMO).copy_to(tmp_path / "w", **NIGHT)
    recorded = promoted_on_another_stack(work)
    proc = night(work, "n1", "results/n1/env/verify.json")
    assert proc.returncode == 1 and "without results/n1/report/summary.json" in proc.stderr, proc.stderr[
        -4000:
    ]
    q = quarantine_of(work, "n1")
    [(host, node)] = q["nodes"].items()
    assert q["status"] == "passed" and node["action"] == "quarantine" and node["against"] == recorded["hash"]
    assert list(node["checks"]) == ["accumulation", "resume", "canary", "eval_drift"]
    assert all(c["ok"] for c in node["checks"].values()), node["checks"]
    torch_now = next(new for k, _, new in node["changes"] if k == "torch")
    assert [tuple(c) for c in node["changes"]] == [("torch", OLD_TORCH, torch_now)]
    assert (
        f"quarantine passed on {host}" in q["message"] and f"torch {OLD_TORCH} -> {torch_now}" in q["message"]
    )
    # the pass is recorded with the stack; nothing was promoted
    st = state(work)
    assert st["nights"][-1]["stack"] == {
        "status": "passed",
        "message": q["message"],
        "recorded_pass": [node["stack"]],
    }
    [passed] = st["quarantine_passes"]
    assert passed == {
        "stack": node["stack"],
        "against": recorded["hash"],
        "run": "n1",
        "at": passed["at"],
        "changes": f"torch {OLD_TORCH} -> {torch_now}",
    }
    assert os.readlink(work / "results/current") == "demo"
    # the next night, on the same stack against the same promoted stack: no quarantine (without the
    # canary here: a cheaper verify_env)
    make_workdir(work, **{**DEMO, **NIGHT, "verify__canary": False})
    proc = night(work, "n2", "results/n2/env/verify.json")
    assert proc.returncode == 1 and "without results/n2/report/summary.json" in proc.stderr, proc.stderr[
        -3000:
    ]
    q2 = quarantine_of(work, "n2")
    assert q2["status"] == "skipped" and "checks" not in q2["nodes"][host]
    assert "this stack passed it before" in q2["message"]
    assert state(work)["nights"][-1]["stack"]["status"] == "skipped"


@pytest.mark.reliability(
    fault=(
        "the nodes' software stack differs from the promoted run's and the trainer on it is wrong: "
        "gradient accumulation keeps only each step's first micro-batch's gradients "
        "(a trainer the test breaks)"
    ),
    seen=(
        "the night's verify_env quarantines the stack and the accumulation parity check fails; the night "
        "is refused before any training (exit 2), naming the check, its gradient norms and the stack "
        "difference (torch old -> new); results/current and current.json stay as they were"
    ),
    steps_lost="none: nothing trained",
    data_lost="none",
)
def test_a_broken_trainer_on_a_changed_stack_is_refused_naming_the_check(tmp_path):
    work = shared_run("demo", **DEMO).copy_to(tmp_path / "w", **NIGHT, verify__canary=False)
    promoted_on_another_stack(work)
    current = (work / "results/current.json").read_bytes()
    path = os.pathsep.join(filter(None, [str(BROKEN), os.environ.get("PYTHONPATH")]))
    proc = night(work, "n1", env={"PYTHONPATH": path, "LLMFT_TEST_BROKEN_TRAINER": "accumulation"})
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-4000:]
    assert (
        "[nightly] run n1 refused before any training: quarantine: quarantine check accumulation parity"
        in (proc.stderr)
    )
    assert "gradient norm" in proc.stderr and f"torch {OLD_TORCH} -> " in proc.stderr
    assert "Traceback" not in proc.stderr
    q = quarantine_of(work, "n1", "verify.failed.json")
    [node] = q["nodes"].values()
    assert q["status"] == "failed" and not node["checks"]["accumulation"]["ok"]
    # only the broken part fails: resume parity, the canary and the promoted model's scores still pass
    assert all(node["checks"][c]["ok"] for c in ("resume", "canary", "eval_drift")), node["checks"]
    assert os.readlink(work / "results/current") == "demo"
    assert (work / "results/current.json").read_bytes() == current
    assert not (work / "results/n1/sft/model").exists() and not (work / "results/n1/env/verify.json").exists()
    last = state(work)["nights"][-1]
    assert last["status"] == "refused" and last["reason"].startswith(
        "quarantine: quarantine check accumulation"
    )
    assert "quarantine_passes" not in state(work)
