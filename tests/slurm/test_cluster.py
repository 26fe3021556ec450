"""The workflow through `--profile profiles/slurm` on the real Slurm test cluster (tests/slurm/cluster-up.sh).

Two slurmd "nodes" n1, n2 on this host, partitions `mi300x` and `cpu`, fake `gpu:mi300x:8` gres per
node: the production profile's partitions, gres and task layout are submitted unchanged through the
official plugin. Only what a 2-core box needs is overridden on the command line (memory and CPUs
per job, faster status polling). SFT runs on two nodes, one process each, on the CPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from snakemake.profiles import ProfileConfigFileParser

from tests.conftest import BIN, REPO, make_workdir, rules_run, snakemake
from tests.reliability import reliability

pytestmark = pytest.mark.slurm

PROFILE = REPO / "profiles" / "slurm" / "config.yaml"
GPU_RULES = {"verify_env", "sft", "evaluate"}
CPU_RULES = {"base_model", "synthetic_data", "prepare_data", "pack_data", "report"}
SUBMIT = re.compile(r"Job (\d+) has been submitted with SLURM jobid (\d+) \(log: (\S+)\)\.")
# A test node has 2 CPUs and ~11 GB; production asks for up to 96 CPUs and 1.5 TB per node.
BOX = {"cpus_per_task": 1, "mem_mb": 2500}
# A small run: two nodes x one process, a few steps, a short held-out split.
SMALL_RUN = {
    "run": "slurm",
    "hardware__nodes": 2,
    "hardware__processes_per_node": 1,
    "hardware__gpus_per_node": 0,
    # the production profile's MI300X gres for CPU ranks: the test cluster's nodes have no GPUs
    "hardware__allow_cpu_on_gpu_jobs": True,
    "data__synthetic_rows": 600,
    "sft__max_steps": 8,
    "sft__logging_steps": 4,
    "eval__max_rows": 24,
}


def _cluster_problem() -> str | None:
    if shutil.which("sinfo") is None:
        return "no Slurm client (sinfo) on PATH"
    out = subprocess.run(["sinfo", "-h", "-o", "%R %T"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return f"no Slurm controller answers ({out.stderr.strip()[:200]})"
    states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
    missing = {"mi300x", "cpu"} - set(states)
    if missing:
        return f"the cluster has no partition(s) {sorted(missing)}"
    return None


@pytest.fixture(scope="module", autouse=True)
def cluster():
    problem = _cluster_problem()
    if problem:
        pytest.skip(f"Slurm test cluster not up: {problem}; run `bash tests/slurm/cluster-up.sh` as root")


def box_args() -> list[str]:
    """The production profile's resources with only CPUs and memory shrunk to this box, as CLI args.

    `--set-resources`/`--default-resources` on the command line replace the profile's whole map, so
    the profile's own entries (partitions, gres, tasks_per_gpu, runtimes, extras) are passed along,
    parsed by Snakemake's own profile parser.
    """
    with open(PROFILE) as fh:
        prof = ProfileConfigFileParser().parse(fh)
    keep_default = [a for a in prof["default-resources"] if a.split("=", 1)[0] not in BOX]
    default = keep_default + [f"{k}={v}" for k, v in BOX.items()]
    rules = sorted({a.split(":", 1)[0] for a in prof["set-resources"]})
    keep_set = [a for a in prof["set-resources"] if a.split(":", 1)[1].split("=", 1)[0] not in BOX]
    sets = keep_set + [f"{r}:{k}={v}" for r in rules for k, v in BOX.items()]
    # The plugin backs off by +10 s per poll from this first interval; 2 s keeps stages short.
    polling = ["--slurm-init-seconds-before-status-checks", "2", "--seconds-between-status-checks", "2"]
    return ["--default-resources", *default, "--set-resources", *sets, *polling]


def cluster_run(
    work: Path, *args: str, timeout: int = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    return snakemake(work, *box_args(), *args, profile="slurm", timeout=timeout, env=env)


def cluster_start(work: Path, log: Path, *args: str) -> subprocess.Popen:
    """`cluster_run` in the background, its output to `log`: for tests that act while it runs."""
    cmd = [str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "-d", str(work)]
    cmd += ["--profile", str(REPO / "profiles/slurm"), *box_args(), *args]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=work, stdout=out, stderr=subprocess.STDOUT, env=env)


def submissions(log: str) -> dict[str, list[str]]:
    """Slurm job ids by rule, from the plugin's "Job N has been submitted with SLURM jobid X" lines."""
    out: dict[str, list[str]] = {}
    for _, slurm_id, path in SUBMIT.findall(log):
        rule = re.search(r"/rule_([A-Za-z0-9_]+)/", path).group(1)
        out.setdefault(rule, []).append(slurm_id)
    return out


def slurm_records(job_ids: list[str]) -> dict[str, dict]:
    """What Slurm itself recorded for each job (MinJobAge keeps finished jobs in squeue)."""
    fields = ["id", "name", "comment", "partition", "nodelist", "nodes", "state", "gres"]
    out = subprocess.run(
        ["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i|%j|%k|%P|%N|%D|%T|%b"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [dict(zip(fields, line.split("|"), strict=True)) for line in out.stdout.splitlines()]
    return {r["id"]: r for r in rows}


def step_nodes(job_id: str) -> set[str]:
    """The nodes whose slurmd launched task(s) of the job's first step: Slurm's record of where it ran."""
    conf = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=True).stdout
    pattern = re.search(r"^SlurmdLogFile\s*=\s*(\S+)", conf, re.M).group(1)
    needle = f"launch task StepId={job_id}.0 "
    return {
        node
        for node in ("n1", "n2")
        if needle in Path(pattern.replace("%n", node)).read_text(errors="replace")
    }


def sbatch_lines(log: str) -> dict[str, str]:
    """The exact sbatch line of each rule (logged by the plugin under --verbose)."""
    return {
        m.group(1): m.group(0)
        for m in re.finditer(r"sbatch call: sbatch .*?--comment '?rule_([a-z_]+?)_wildcards_.*", log)
    }


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    work = make_workdir(tmp_path_factory.mktemp("slurm"), **SMALL_RUN)
    start = time.monotonic()
    proc = cluster_run(work, "--verbose")
    elapsed = time.monotonic() - start
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    print(f"whole DAG on Slurm: {elapsed:.0f} s")
    return work, log


def test_every_stage_is_its_own_slurm_job_on_the_production_partitions(whole_run):
    work, log = whole_run
    jobs = submissions(log)
    assert set(jobs) == GPU_RULES | CPU_RULES
    assert len(jobs["evaluate"]) == 2  # base and tuned, one job each
    assert all(len(ids) == 1 for rule, ids in jobs.items() if rule != "evaluate")
    ids = [i for ids in jobs.values() for i in ids]
    assert len(set(ids)) == len(ids)
    assert "render_sft_config" in rules_run(log)  # a localrule: runs on the submit host, no job
    records = slurm_records(ids)
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
    _, log = whole_run
    lines = sbatch_lines(log)
    assert "--nodes=2" in lines["verify_env"] and "--ntasks=2" in lines["verify_env"]
    assert step_nodes(submissions(log)["verify_env"][0]) == {"n1", "n2"}
    launcher = re.search(r"srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 --kill-on-bad-exit=1", log)
    assert launcher, "no per-node srun launcher in the shell commands"
    shells = re.findall(r"(srun --nodes=2 [^\n]*?) python -m llmft (verify-env|sft)", log)
    assert {stage for _, stage in shells} == {"verify-env", "sft"}
    assert len({prefix for prefix, _ in shells}) == 1  # one launcher prefix for both stages


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


@reliability(
    fault="a stage that fails on a node (a package missing there)",
    seen="`snakemake` exits non-zero within minutes and prints the job's own log",
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
    proc = cluster_run(work, "results/broken/env/verify.json", timeout=300)
    elapsed = time.monotonic() - start
    log = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), log[-4000:]  # failed by itself, not by the timeout
    assert elapsed < 240, f"took {elapsed:.0f} s"
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
