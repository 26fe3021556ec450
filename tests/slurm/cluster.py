"""What the tests on the Slurm test cluster share: the cluster check, the production profile's
sbatch arguments shrunk to this box, runners, readers of what Slurm recorded, and the upstream build
every fault test starts from (`Upstream`; the session fixture `slurm_upstream` in conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from snakemake.profiles import ProfileConfigFileParser

from tests.conftest import BIN, REPO, copy_results, make_workdir, snakemake

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
    # test_cluster asserts verify_env's numerics canary on both nodes
    "verify__canary": True,
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
    # The plugin backs off by +10 s per poll from this first interval (capped by FAST_POLL).
    polling = ["--slurm-init-seconds-before-status-checks", "2", "--seconds-between-status-checks", "2"]
    return ["--default-resources", *default, "--set-resources", *sets, *polling]


# Its sitecustomize.py caps the Slurm plugin's status-poll interval at a few seconds (the plugin backs
# off by +10 s per poll to 180 s, with no setting to cap it): jobs are noticed seconds after they end.
FAST_POLL = Path(__file__).resolve().parent / "fastpoll"


def fast_poll_env() -> dict:
    """PYTHONPATH for a snakemake (or `llmft nightly`) these tests start: FAST_POLL first."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(FAST_POLL), os.environ.get("PYTHONPATH")]))}


def cluster_run(
    work: Path, *args: str, timeout: int = 600, env: dict | None = None, fast_poll: bool = True
) -> subprocess.CompletedProcess:
    """Snakemake through the production profile on the cluster; `fast_poll=False` leaves the plugin's
    own back-off (for a test that times how soon Snakemake notices a job)."""
    env = {**(fast_poll_env() if fast_poll else {}), **(env or {})}
    return snakemake(work, *box_args(), *args, profile="slurm", timeout=timeout, env=env)


def cluster_start(work: Path, log: Path, *args: str) -> subprocess.Popen:
    """`cluster_run` in the background, its output to `log`: for tests that act while it runs."""
    cmd = [str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "-d", str(work)]
    cmd += ["--profile", str(REPO / "profiles/slurm"), *box_args(), *args]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **fast_poll_env())
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


def restarts(job_id: str) -> int:
    """How many times Slurm itself requeued the job (`scontrol show job`'s Restarts)."""
    cmd = ["scontrol", "show", "job", "-o", job_id]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return int(re.search(r"\bRestarts=(\d+)", out.stdout).group(1))


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


def running_job_id(rule: str) -> str | None:
    """The id of the running Slurm job of a Snakemake rule (the plugin names jobs rule_<rule>_...)."""
    out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i|%k"], capture_output=True, text=True)
    ids = [line.split("|")[0] for line in out.stdout.splitlines() if f"rule_{rule}_" in line]
    return ids[0] if ids else None


def trained_steps(work_root: Path, stage: str) -> list[int]:
    """The optimizer steps a training stage logged (llmft_steps.jsonl), in order."""
    files = list(work_root.glob(f"{stage}-*/llmft_steps.jsonl"))
    if not files:
        return []
    return [json.loads(x)["step"] for x in files[0].read_text().splitlines() if '"time"' in x]


def sbatch_lines(log: str) -> dict[str, str]:
    """The exact sbatch line of each rule (logged by the plugin under --verbose)."""
    return {
        m.group(1): m.group(0)
        for m in re.finditer(r"sbatch call: sbatch .*?--comment '?rule_([a-z_]+?)_wildcards_.*", log)
    }


@pytest.fixture(scope="module", autouse=True)
def cluster():
    problem = _cluster_problem()
    if problem:
        pytest.skip(f"Slurm test cluster not up: {problem}; run `bash tests/slurm/cluster-up.sh` as root")


RUN = SMALL_RUN["run"]
# The stages every test of SMALL_RUN starts from, built once per session (`slurm_upstream`): the
# per-node environment check, the base model and the prepared data. What follows them reads sft's
# keys (render_sft_config, pack_data, sft, evaluate, report), so each test runs those itself.
UPSTREAM_RULES = frozenset({"verify_env", "base_model", "synthetic_data", "prepare_data"})
UPSTREAM_TARGETS = (f"results/{RUN}/env/verify.json", f"results/{RUN}/data/dataset_info.json")


@dataclass(frozen=True)
class Upstream:
    """SMALL_RUN built through UPSTREAM_RULES on the cluster, once. Never run anything in `work`:
    take a copy (`copy_to`)."""

    work: Path
    log: str  # Snakemake's output of that build, with --verbose (its sbatch lines)
    records: dict[str, dict]  # slurm_records of its jobs, read when the build finished

    def copy_to(self, dest: Path, **overrides) -> Path:
        """A workdir at `dest` holding this build's results and Snakemake's records of them, with
        SMALL_RUN's config deep-updated by `overrides` (as make_workdir). A key an upstream stage
        reads (hardware, verify, data, model, sft's kernel and ZeRO keys) reruns that stage; the
        run name must stay RUN, which every stage's recorded params hold."""
        if overrides.get("run", RUN) != RUN:
            raise ValueError(f"a copy of the upstream build is run {RUN!r}, not {overrides['run']!r}")
        copy_results(self.work, dest)
        return make_workdir(dest, **{**SMALL_RUN, **overrides})


def rebuilt_upstream(log: str) -> set[str]:
    """The upstream rules a run on a copy submitted again (none, where the copy was reused)."""
    return set(submissions(log)) & UPSTREAM_RULES
