"""DPO with preference.reference_logps: cached through the whole DAG on the local executor
(builtin:tiny, 2 CPU processes, real LLaMA-Factory DPO training, short): the reference step computes
every train and held-out sequence once into the shared store; training loads no reference model and
reads them; the step run again computes none."""

import json
import math

import pytest
import yaml

from tests.conftest import make_workdir, reuse_verify, rules_run, snakemake

pytestmark = pytest.mark.workflow

# sft short (the reference is its model: any will do), DPO for a few steps on few pairs.
# logging_steps 1: the first step's loss is logged alone.
SMALL = {
    "data__synthetic_rows": 300,
    "sft__num_train_epochs": 1.0,
    "sft__logging_steps": 1,
    "eval__max_rows": 16,
}
DPO = {
    "method": "dpo",
    "reference_logps": "cached",
    "max_steps": 4,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "data": {"synthetic_rows": 80, "heldout_fraction": 0.2},
}
RECORD = "results/demo/preference/reference/reference.json"


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    work = make_workdir(tmp_path_factory.mktemp("refcache"), **SMALL, preference=DPO)
    reuse_verify(work)  # this machine's verify_env report: nothing here asserts on it
    proc = snakemake(work)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return work, proc


def test_dpo_trains_on_cached_reference_logps_without_a_reference_model(cached):
    work, proc = cached
    run = work / "results/demo"
    assert {"preference_reference", "preference"} <= set(rules_run(proc.stdout + proc.stderr))
    stats = json.loads((run / "preference/data/stats.json").read_text())
    record = json.loads((work / RECORD).read_text())
    pairs = stats["train_rows"] + stats["heldout_rows"]
    # every distinct chosen and rejected sequence of both splits, all computed on this first run
    assert 0 < record["sequences"] <= 2 * pairs and record["computed"] == record["sequences"]
    assert record["reused"] == 0 and record["kind"] == "dpo" and record["dtype"] == "fp32"
    assert record["model_dir"] == "results/demo/sft/model"
    store = work / "results/cache/reference" / record["model"] / "fp32" / "shards"
    assert sorted(p.name for p in store.glob("*.json")) == record["shards"]

    args = yaml.safe_load((run / "preference/llamafactory.yaml").read_text())
    assert args["llmft"]["reference_logps"] == RECORD and args["llmft"]["plan"]["reference"] == "cached"
    render_log = (run / "logs/render_preference_config.log").read_text()
    assert (
        "reference model cached" in render_log and "reference_logps cached: the reference step" in render_log
    )
    job_log = (run / "logs/preference.log").read_text()
    # both training processes read the cache; neither loads a reference model
    assert job_log.count("reference model: not loaded") == 2, job_log[-3000:]
    assert job_log.count(f"cached log-probabilities from {RECORD}") == 2
    assert "Created reference model" not in job_log
    # the first step's policy is the reference (the sft model): against the cached values the DPO
    # loss is log 2 and every reward 0, as against the resident model
    work_dir = json.loads((run / "preference/train_summary.json").read_text())["work_dir"]
    history = json.loads((work / work_dir / "trainer_state.json").read_text())["log_history"]
    first = history[0]
    assert first["step"] == 1 and first["loss"] == pytest.approx(math.log(2), abs=1e-4), first
    assert abs(first["rewards/margins"]) < 1e-4 and abs(first["rewards/chosen"]) < 1e-4, first


def test_the_reference_step_run_again_computes_nothing(cached, tmp_path):
    work, _ = cached
    first = json.loads((work / RECORD).read_text())
    again = snakemake(work, "--forcerun", "preference_reference", "--until", "preference_reference")
    assert again.returncode == 0, again.stderr[-3000:]
    record = json.loads((work / RECORD).read_text())
    assert (record["sequences"], record["computed"], record["reused"]) == (
        first["sequences"],
        0,
        first["sequences"],
    )
    log = (work / "results/demo/logs/preference_reference.log").read_text()
    assert f"{first['sequences']} in the store, 0 to compute" in log
