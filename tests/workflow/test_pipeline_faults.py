"""Snakemake itself killed mid-training, and a second Snakemake on the same run folder, through the
real workflow on the local executor (the embedded default, smaller)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, REPO, make_workdir, reuse_verify, rules_run, snakemake, snakemake_env

pytestmark = pytest.mark.workflow

RUN = {
    "run": "killed",
    "data__synthetic_rows": 600,
    "sft__max_steps": 300,
    "sft__save_steps": 50,
    "sft__logging_steps": 10,
    "eval__max_rows": 24,
}


# up to training (the stage a killed Snakemake leaves running); evaluation is not at stake here
TARGET = "results/killed/sft/train_summary.json"


def start(work: Path, log: Path) -> subprocess.Popen:
    cmd = [
        str(BIN / "snakemake"),
        "-s",
        str(REPO / "Snakefile"),
        "-d",
        str(work),
        "--profile",
        str(REPO / "profiles/local"),
        TARGET,
    ]
    env = snakemake_env()
    # its own session: the test can end whatever it leaves behind, as a user's `kill` would not
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def trained_steps(work: Path) -> int:
    for path in (work / "results/killed/work").glob("sft-*/llmft_steps.jsonl"):
        steps = [json.loads(x)["step"] for x in path.read_text().splitlines() if '"time"' in x]
        return steps[-1] if steps else 0
    return 0


@pytest.mark.reliability(
    fault="a second `snakemake` on the same run folder while one runs",
    seen='refused by Snakemake\'s lock before any job starts ("Directory cannot be locked")',
    steps_lost="none",
    data_lost="none",
)
@pytest.mark.reliability(
    fault="Snakemake killed (SIGKILL) mid-training; its sft job keeps running; the rerun made with "
    "`--nolock`",
    seen="the rerun's sft job refuses to train beside the running one, naming its pid, and that "
    "job's log is kept; stopped with `kill PID`, the running job saves a checkpoint; after "
    "`snakemake --unlock` (as Snakemake says) the next rerun redoes the stage from it; "
    "train_summary.json lists both attempts' starting steps and a runtime over both, longer than "
    "the last attempt's",
    steps_lost="none (the stopped job saved a checkpoint)",
    data_lost="none",
)
def test_snakemake_killed_mid_training_and_a_second_snakemake(tmp_path):
    work = make_workdir(tmp_path / "w", **RUN)
    reuse_verify(work, RUN["run"])  # this machine's verify_env report: nothing here asserts on it
    first = start(work, tmp_path / "first.log")
    try:
        deadline = time.time() + 420
        while trained_steps(work) < 20 and time.time() < deadline and first.poll() is None:
            time.sleep(0.5)
        assert first.poll() is None and trained_steps(work) >= 20, (tmp_path / "first.log").read_text()[
            -3000:
        ]

        second = snakemake(work, TARGET, timeout=120)
        log = second.stdout + second.stderr
        assert second.returncode != 0 and "Directory cannot be locked" in log, log[-2000:]
        assert first.poll() is None  # the first run went on

        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        at_kill = trained_steps(work)
        res = snakemake(work, TARGET, timeout=120)
        assert res.returncode != 0 and "--unlock" in res.stdout + res.stderr

        # The killed Snakemake's sft job still trains: a rerun that ignores Snakemake's lock must
        # not train beside it, nor erase its log (Snakemake deletes a job's declared log first).
        res = snakemake(work, "--nolock", TARGET, timeout=300)
        log = res.stdout + res.stderr
        assert res.returncode != 0 and "sft" in rules_run(log), log[-3000:]
        sft_log = (work / "results/killed/logs/sft.log").read_text()
        m = re.search(r"another sft launcher \(pid (\d+) on \S+ since [^)]*\)", sft_log)
        assert m, sft_log[-3000:]
        # the running job's own lines come first, then the refused job's
        assert 0 <= sft_log.find("Initializing 2 distributed tasks") < m.start(), sft_log[-3000:]
        assert trained_steps(work) > at_kill  # ... and it was not disturbed
        orphan = int(m.group(1))
        os.kill(orphan, signal.SIGTERM)  # what the message advises: it saves, then stops
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                os.kill(orphan, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        stopped = json.loads(
            next((work / "results/killed/work").glob("sft-*/llmft_preempted.json")).read_text()
        )

        assert snakemake(work, "--unlock", timeout=120).returncode == 0
        res = snakemake(work, TARGET, timeout=600)
        log = res.stdout + res.stderr
        assert res.returncode == 0, log[-4000:]
        assert "sft" in rules_run(log)
        summary = json.loads((work / "results/killed/sft/train_summary.json").read_text())
        assert summary["steps"] == RUN["sft__max_steps"]
        assert summary["attempt"]["resumed_from_step"] == stopped["step"]
        assert summary["attempt"]["steps_lost"] == 0
        assert summary["attempt"]["starts"] == [0, stopped["step"]]
        assert summary["attempt"]["runtime_s"] > summary["train_runtime_s"]
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
