"""Preemption on the real Slurm test cluster: signal the running sft job, it saves, requeues, resumes.

The workflow runs through `--profile profiles/slurm` (sft on two nodes, ZeRO-3 on CPU processes).
While sft trains, `scancel --signal=USR1` does what `sbatch --signal=USR1@<seconds>` does before a
time limit: every rank saves a checkpoint at the same step, each node runs `scontrol requeue`, Slurm
starts the same job again, and the trainer resumes from that checkpoint. The run must finish with
every step trained exactly once and trainer_log.jsonl holding the whole history.
"""

from __future__ import annotations

import json
import os
import re
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

STEPS = 60


@pytest.mark.reliability(
    fault="a two-node Slurm sft job signalled before its time limit (`--signal=USR1@600`)",
    seen=(
        "a checkpoint on every rank, `scontrol requeue`, the same job id resumes; TensorBoard, "
        "MLflow and W&B continue one run"
    ),
    steps_lost="none",
    data_lost="none",
)
def test_signalled_sft_job_saves_requeues_and_resumes(tmp_path, slurm_upstream):
    run = {
        "sft__max_steps": STEPS,
        "sft__save_steps": 1000,
        "sft__logging_steps": 1,
        "sft__tracking": ["tensorboard", "mlflow", "wandb"],
    }
    # the shared verify_env, base model and data; from there up to training: the evaluations and the
    # report after it are not at stake here (test_cluster.py runs them on Slurm)
    work = slurm_upstream.copy_to(tmp_path, **run)
    target = f"results/{RUN}/sft/train_summary.json"
    proc = cluster_start(work, tmp_path / "snakemake.log", "--verbose", target)
    work_root = work / f"results/{RUN}/work"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and len(trained_steps(work_root, "sft")) < 10:
        time.sleep(1)
    job = running_job_id("sft")
    snake_log = tmp_path / "snakemake.log"
    assert job and len(trained_steps(work_root, "sft")) >= 10, snake_log.read_text()[-4000:]
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
    sft_dir = next(work_root.glob("sft-*"))
    events = [json.loads(x) for x in (sft_dir / "llmft_events.jsonl").read_text().splitlines()]
    saved = next(e["content"]["step"] for e in events if e["file"] == "llmft_preempted.json")
    assert 10 <= saved < STEPS
    # each step once: nothing lost or redone
    assert trained_steps(work_root, "sft") == list(range(1, STEPS + 1))
    history = [json.loads(x) for x in (sft_dir / "trainer_log.jsonl").read_text().splitlines()]
    logged = [e["current_steps"] for e in history if "loss" in e]
    assert logged[0] == 1 and logged[-1] == STEPS and saved in logged
    # Slurm was asked for the signal this test sent by hand, and requeued the same job: Snakemake
    # submitted sft once and waited for it
    assert "--signal=USR1@600" in sbatch_lines(text)["sft"]
    assert len(submissions(text).get("sft", [])) == 1
    sft_log = (work / f"results/{RUN}/logs/sft.log").read_text()
    # every node asks before it exits (the first to exit makes srun --kill-on-bad-exit cancel the
    # other, which may not get to ask; the requeue itself may kill the asker before it logs the
    # answer): Slurm requeued the job once, and any other ask it answered was refused
    assert restarts(job) == 1
    asks = re.findall(rf"scontrol requeue {job}: rc (\d+)", sft_log)
    assert asks and asks.count("0") <= 1, asks
    assert f"Resuming training from {sft_dir.relative_to(work)}/checkpoint-{saved}" in sft_log
    summary = json.loads((work / f"results/{RUN}/sft/train_summary.json").read_text())
    assert summary["steps"] == STEPS
    tracked_runs_continue(work / f"results/{RUN}/tracking", sft_dir.name, saved)


def tracked_runs_continue(root, work_name: str, saved: int) -> None:
    """Each tracker holds one run across the two attempts, every step logged once."""
    from mlflow.tracking import MlflowClient

    from tests.events import steps_per_file

    # one event file per attempt that trained (the evaluation after training may open one more)
    attempts = [steps for steps in steps_per_file(root / "tensorboard" / work_name, "train/loss") if steps]
    assert len(attempts) == 2 and attempts[0][-1] <= saved < attempts[1][0]  # the second file goes on
    assert sorted(attempts[0] + attempts[1]) == list(range(1, STEPS + 1))
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # the file store the run wrote (tracking.py)
    client = MlflowClient(tracking_uri=(root / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name("llmft").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "loss"))
    assert steps == list(range(1, STEPS + 1))
    offline = sorted((root / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and len({d.name.rsplit("-", 1)[-1] for d in offline}) == 1  # one run id
