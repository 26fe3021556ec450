"""The workflow through `--profile profiles/slurm` on the real Slurm test cluster (tests/slurm/cluster-up.sh).

Two slurmd "nodes" n1, n2 on this host, partitions `mi300x` and `cpu`, fake `gpu:mi300x:8` gres per
node: the production profile's partitions, gres and task layout are submitted unchanged through the
official plugin. Only what a 2-core box needs is overridden on the command line (memory and CPUs
per job, faster status polling). SFT runs on two nodes, one process each, on the CPU.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
import yaml

from tests.conftest import make_workdir, rules_run
from tests.slurm.cluster import (  # noqa: F401 (re-exported: other modules import them from here)
    BOX,
    CPU_RULES,
    GPU_RULES,
    PROFILE,
    SMALL_RUN,
    SUBMIT,
    _cluster_problem,
    box_args,
    cluster,
    cluster_run,
    cluster_start,
    rebuilt_upstream,
    sbatch_lines,
    slurm_records,
    step_nodes,
    submissions,
)

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, slurm_upstream):
    """The whole DAG of SMALL_RUN: the shared upstream build, then the rest on a copy of it. The log
    is both runs' output, so every stage's submission is in it."""
    work = slurm_upstream.copy_to(tmp_path_factory.mktemp("slurm"))
    start = time.monotonic()
    proc = cluster_run(work, "--verbose")
    elapsed = time.monotonic() - start
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert not rebuilt_upstream(log), submissions(log)
    print(f"the DAG after the upstream stages on Slurm: {elapsed:.0f} s")
    return work, slurm_upstream.log + log


def test_every_stage_is_its_own_slurm_job_on_the_production_partitions(whole_run, slurm_upstream):
    work, log = whole_run
    jobs = submissions(log)
    assert set(jobs) == GPU_RULES | CPU_RULES
    assert len(jobs["evaluate"]) == 2  # base and tuned, one job each
    assert all(len(ids) == 1 for rule, ids in jobs.items() if rule != "evaluate")
    ids = [i for ids in jobs.values() for i in ids]
    assert len(set(ids)) == len(ids)
    assert "render_sft_config" in rules_run(log)  # a localrule: runs on the submit host, no job
    # the upstream jobs as Slurm recorded them when they finished (squeue forgets a job MinJobAge later)
    records = {**slurm_records([i for i in ids if i not in slurm_upstream.records]), **slurm_upstream.records}
    assert set(records) == set(ids)
    for rule, rule_ids in jobs.items():
        for job_id in rule_ids:
            rec = records[job_id]
            assert rec["state"] == "COMPLETED", rec
            assert rec["comment"].startswith(f"rule_{rule}_wildcards_"), rec
            assert rec["name"].startswith("llmft_"), rec
            if rule in GPU_RULES:
                assert rec["partition"] == "mi300x" and rec["gres"] == "gres:gpu:mi300x:8", rec
            else:
                assert rec["partition"] == "cpu" and rec["gres"] == "N/A", rec
    for rule in ("verify_env", "sft"):
        rec = records[jobs[rule][0]]
        assert rec["nodes"] == "2" and rec["nodelist"] == "n[1-2]", rec


def test_sbatch_lines_are_the_production_profiles(whole_run):
    _, log = whole_run
    lines = sbatch_lines(log)
    sft = lines["sft"]
    flags = ("-p mi300x", "--gres=gpu:mi300x:8", "--nodes=2", "--ntasks=2", "--exclusive", "-A llm-ft")
    for flag in (*flags, "--signal=USR1@600"):
        assert flag in sft, sft
    assert "--ntasks-per-gpu" not in sft  # tasks_per_gpu: 0, or the job would pend forever
    assert "-p cpu" in lines["prepare_data"] and "--gres" not in lines["prepare_data"]


def test_sft_ranks_ran_on_both_nodes_with_world_size_two(whole_run):
    work, log = whole_run
    assert step_nodes(submissions(log)["sft"][0]) == {"n1", "n2"}
    run = work / "results/slurm"
    sft_log = (run / "logs/sft.log").read_text()
    launchers = dict(
        re.findall(
            r"\[llmft\] Initializing 1 distributed tasks at: 127\.0\.0\.1:\d+ \(node (n\d), rank (\d+)/2",
            sft_log,
        )
    )
    assert launchers == {"n1": "0", "n2": "1"}, sft_log[-3000:]
    ranks = set(re.findall(r"Process rank: (\d+), world size: 2\b", sft_log))
    assert ranks == {"0", "1"}, sft_log[-3000:]
    assert re.search(r"stage\W+3", (run / "sft/deepspeed.json").read_text())
    summary = yaml.safe_load((run / "sft/train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == SMALL_RUN["sft__max_steps"]
    assert (run / "report/index.html").is_file()


def test_verify_env_runs_on_every_node_under_the_sft_launcher(whole_run):
    work, log = whole_run
    lines = sbatch_lines(log)
    assert "--nodes=2" in lines["verify_env"] and "--ntasks=2" in lines["verify_env"]
    assert step_nodes(submissions(log)["verify_env"][0]) == {"n1", "n2"}
    launcher = re.search(r"srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 --kill-on-bad-exit=1", log)
    assert launcher, "no per-node srun launcher in the shell commands"
    shells = re.findall(r"(srun --nodes=2 [^\n]*?) python -m llmft (verify-env|sft)", log)
    assert {stage for _, stage in shells} == {"verify-env", "sft"}
    assert len({prefix for prefix, _ in shells}) == 1  # one launcher prefix for both stages
    # each node ran the numerics canary (40 steps through its kernels) and matched the golden curve
    nodes = json.loads((work / "results/slurm/env/verify.json").read_text())["nodes"]
    assert [n["host"] for n in nodes] == ["n1", "n2"]
    assert all(n["canary"]["ok"] and len(n["canary"]["run"]["losses"]) == 40 for n in nodes), nodes


def test_rerun_one_stage_runs_only_its_jobs(whole_run):
    work, _ = whole_run
    run = work / "results/slurm"
    before = {p: p.stat().st_mtime for p in (run / "eval").rglob("metrics.json")}
    model_mtime = (run / "sft/train_summary.json").stat().st_mtime
    proc = cluster_run(work, "--forcerun", "evaluate", "--until", "evaluate")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    jobs = submissions(log)
    assert set(jobs) == {"evaluate"} and len(jobs["evaluate"]) == 2, jobs
    assert sorted(rules_run(log)) == ["evaluate", "evaluate"]
    records = slurm_records(jobs["evaluate"])
    assert all(
        r["comment"].startswith("rule_evaluate_") and r["state"] == "COMPLETED" for r in records.values()
    )
    assert all(p.stat().st_mtime > t for p, t in before.items())
    assert (run / "sft/train_summary.json").stat().st_mtime == model_mtime


FAILS_WITHIN_S = 240


@pytest.mark.reliability(
    fault="a stage that fails on a node (a package missing there)",
    seen=f"`snakemake` exits non-zero within {FAILS_WITHIN_S // 60} minutes (the job and its one retry "
    "failed) and prints the job's own log",
    steps_lost="none",
    data_lost="none",
)
def test_failing_stage_exits_nonzero_in_bounded_time_and_shows_its_log(tmp_path):
    work = make_workdir(
        tmp_path,
        run="broken",
        hardware__allow_cpu_on_gpu_jobs=True,
        verify__required_packages=["torch", "llmft_no_such_package"],
    )
    start = time.monotonic()
    # the plugin's own poll back-off, uncapped: the bound is on how soon Snakemake notices the failure
    proc = cluster_run(work, "results/broken/env/verify.json", timeout=300, fast_poll=False)
    elapsed = time.monotonic() - start
    log = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), log[-4000:]  # failed by itself, not by the timeout
    assert elapsed < FAILS_WITHIN_S, f"took {elapsed:.0f} s"
    jobs = submissions(log)
    assert set(jobs) == {"verify_env"} and len(jobs["verify_env"]) == 2  # profile: retries: 1
    records = slurm_records(jobs["verify_env"])
    assert {r["state"] for r in records.values()} == {"FAILED"}
    for job_id in jobs["verify_env"]:
        assert f"SLURM-job '{job_id}' failed" in log
    # The stage's own log is shown, not just a job id.
    stage_log = (work / "results/broken/logs/verify_env.log").read_text().strip()
    assert "llmft_no_such_package" in stage_log
    assert stage_log.splitlines()[-1] in log
    # Nothing of this run is left in the queue.
    active = subprocess.run(
        ["squeue", "-h", "-t", "PENDING,RUNNING,COMPLETING", "-j", ",".join(jobs["verify_env"])],
        capture_output=True,
        text=True,
    )
    assert active.stdout.strip() == ""
