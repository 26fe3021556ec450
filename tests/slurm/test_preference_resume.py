"""Preemption of the preference stage on the real Slurm test cluster, as test_sft_resume.py does for
sft: signal the running two-node DPO job, it saves, requeues and resumes every step exactly once."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.slurm.cluster import (
    RUN,
    cluster_start,
    rebuilt_upstream,
    restarts,
    running_job_id,
    sbatch_lines,
    submissions,
    trained_steps,
)

pytestmark = pytest.mark.slurm

STEPS = 40


@pytest.mark.reliability(
    fault="a two-node Slurm preference (DPO) job signalled before its time limit (`--signal=USR1@600`)",
    seen="a checkpoint on every rank, `scontrol requeue`, the same job id resumes",
    steps_lost="none",
    data_lost="none",
)
def test_signalled_preference_job_saves_requeues_and_resumes(tmp_path, slurm_upstream):
    run = {
        "preference": {
            "method": "dpo",
            # from the base model: the stage needs no sft job before it (what it trains from is not
            # what is tested here)
            "start_from": "base",
            "learning_rate": 1.0e-4,
            "max_steps": STEPS,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 1,
            "data": {"synthetic_rows": 300},
        },
        "sft__save_steps": 1000,
        "sft__logging_steps": 1,
    }
    # the shared verify_env, base model and data (no key they read changes); from there what the
    # preference stage needs (its pairs), not the evaluations after it
    work = slurm_upstream.copy_to(tmp_path, **run)
    target = f"results/{RUN}/preference/train_summary.json"
    proc = cluster_start(work, tmp_path / "snakemake.log", "--verbose", target)
    work_root = work / f"results/{RUN}/work"
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None and len(trained_steps(work_root, "preference")) < 10:
        time.sleep(1)
    job = running_job_id("preference")
    snake_log = tmp_path / "snakemake.log"
    assert job and len(trained_steps(work_root, "preference")) >= 10, snake_log.read_text()[-4000:]
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    try:
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.send_signal(2)  # Snakemake stops (and cancels its jobs) on SIGINT, not SIGTERM
            proc.wait(timeout=120)
    text = (tmp_path / "snakemake.log").read_text()
    assert proc.returncode == 0, text[-4000:]
    assert not rebuilt_upstream(text)
    pref_dir = next(work_root.glob("preference-*"))
    events = [json.loads(x) for x in (pref_dir / "llmft_events.jsonl").read_text().splitlines()]
    saved = next(e["content"]["step"] for e in events if e["file"] == "llmft_preempted.json")
    assert 10 <= saved < STEPS
    # each step once: nothing lost or redone
    assert trained_steps(work_root, "preference") == list(range(1, STEPS + 1))
    assert "--signal=USR1@600" in sbatch_lines(text)["preference"]
    assert len(submissions(text).get("preference", [])) == 1
    assert restarts(job) == 1  # Slurm's own record: the same job requeued once
    log = (work / f"results/{RUN}/logs/preference.log").read_text()
    assert f"Resuming training from {pref_dir.relative_to(work)}/checkpoint-{saved}" in log
    summary = json.loads((work / f"results/{RUN}/preference/train_summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_loss"] is not None
    assert (work / f"results/{RUN}/preference/model/config.json").is_file()  # published after resuming
