"""preference.reference_logps: cached on the real Slurm test cluster: the reference step runs as a
Slurm job of its own (the production profile's node shape) before the preference job, which reads its
record and loads no reference model."""

from __future__ import annotations

import json

import pytest

from tests.slurm.cluster import RUN, cluster_run, rebuilt_upstream, sbatch_lines, submissions

pytestmark = pytest.mark.slurm


def test_cached_reference_logps_are_a_slurm_job_before_training(tmp_path, slurm_upstream):
    run = {
        "preference": {
            "method": "dpo",
            "start_from": "base",  # no sft job before it: the base model is the reference
            "reference_logps": "cached",
            "max_steps": 4,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 1,
            "data": {"synthetic_rows": 100},
        },
    }
    work = slurm_upstream.copy_to(tmp_path, **run)
    proc = cluster_run(work, "--verbose", f"results/{RUN}/preference/train_summary.json")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert not rebuilt_upstream(log)
    jobs = submissions(log)
    assert len(jobs.get("preference_reference", [])) == 1 and len(jobs.get("preference", [])) == 1
    assert "gpu:mi300x:8" in sbatch_lines(log)["preference_reference"]
    record = json.loads((work / f"results/{RUN}/preference/reference/reference.json").read_text())
    assert record["computed"] == record["sequences"] > 0 and record["reused"] == 0
    assert record["model_dir"] == f"results/{RUN}/base_model"
    job_log = (work / f"results/{RUN}/logs/preference.log").read_text()
    assert "reference model: not loaded" in job_log and "Created reference model" not in job_log
