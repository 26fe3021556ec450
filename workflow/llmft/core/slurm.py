"""Reading a Slurm allocation: nodes, first host, node rank, a per-job rendezvous port.

The Snakemake Slurm jobstep plugin strips every SLURM_* variable except SLURMD_NODENAME before it
runs a rule, so facts are read from the environment when present and from `squeue`/`scontrol`
otherwise.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmft.core.settings import Hardware


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist ("rack[1-2]-node[01-02],gpu7") into host names, in Slurm's order.

    `scontrol show hostnames` is the reference: it is used when it is on PATH and answers; the
    pure-Python `parse_hostlist` otherwise (login hosts without Slurm's tools, unit tests).
    """
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=20
            )
            hosts = out.stdout.split()
            if out.returncode == 0 and hosts:
                return hosts
        except (OSError, subprocess.SubprocessError):
            pass
    return parse_hostlist(nodelist)


def parse_hostlist(nodelist: str) -> list[str]:
    """Slurm's hostlist syntax in pure Python, expanded as `scontrol show hostnames` does.

    Names are separated by commas (or whitespace) outside brackets. Inside a bracket group, a comma
    list of numbers and lo-hi ranges; a range keeps the width of its lower bound ("01-10" gives
    01..10). Several groups in one name expand to their cartesian product, the first group varying
    slowest ("r[1-2]n[1-2]" gives r1n1 r1n2 r2n1 r2n2). Text after the last group ("n[1-2]-ib"),
    which scontrol rejects, is kept as a suffix: a superset of Slurm's syntax, never a different
    expansion of a list Slurm accepts.
    """
    hosts: list[str] = []
    for name in _split_top_level(nodelist):
        parts = re.split(r"\[([^\[\]]*)\]", name)  # odd items: the inside of each bracket group
        if any("[" in p or "]" in p for p in parts[::2]):
            raise ValueError(f"unbalanced brackets in hostlist {nodelist!r}")
        choices = [[p] if i % 2 == 0 else _expand_group(p, nodelist) for i, p in enumerate(parts)]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    names, depth, cur = [], 0, ""
    for ch in nodelist:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced brackets in hostlist {nodelist!r}")
        if depth == 0 and (ch == "," or ch.isspace()):
            names.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced brackets in hostlist {nodelist!r}")
    names.append(cur)
    return [n for n in names if n]


def _expand_group(group: str, nodelist: str) -> list[str]:
    out: list[str] = []
    for item in group.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"bad range {item!r} in hostlist {nodelist!r}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
        else:
            out.extend(f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
    return out


def rendezvous_port(job_id: str | int | None, base: int = 29500, span: int = 2000) -> int:
    """A fixed MASTER_PORT derived from the job id, so two jobs on one host never collide."""
    if not job_id:
        return base
    return base + int(str(job_id).split("_")[0]) % span


def free_port() -> int:
    """A TCP port that nothing listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Allocation:
    """Where this process runs within a (possibly multi-node) job."""

    job_id: str
    nodes: list[str]
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def nnodes(self) -> int:
        return len(self.nodes)


def _squeue_nodelist(job_id: str) -> str:
    out = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def _resolve(host: str) -> str:
    """The address to rendezvous on. Test clusters give several nodes one host: use NodeAddr."""
    try:
        out = subprocess.run(["scontrol", "show", "node", host], capture_output=True, text=True, timeout=20)
        m = re.search(r"NodeAddr=(\S+)", out.stdout)
        if m:
            return m.group(1)
    except (OSError, subprocess.SubprocessError):
        pass
    return host


def current_allocation(env: dict[str, str] | None = None) -> Allocation:
    """The allocation of the running process; a single local "node" outside Slurm."""
    env = dict(os.environ if env is None else env)
    job_id = env.get("SLURM_JOB_ID", "")
    if not job_id:
        # Outside Slurm several pipelines may share a host (CI, a laptop): take a free port.
        return Allocation("", ["localhost"], 0, "127.0.0.1", free_port())
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not nodelist:
        nodelist = _squeue_nodelist(job_id)
    nodes = expand_nodelist(nodelist)
    me = env.get("SLURMD_NODENAME", "")
    if "SLURM_NODEID" in env and env.get("SLURM_NNODES") == str(len(nodes)):
        rank = int(env["SLURM_NODEID"])
    elif me in nodes:
        rank = nodes.index(me)
    else:
        raise RuntimeError(
            f"cannot tell this node's rank: SLURMD_NODENAME={me!r} is not in the job's node list {nodes}"
        )
    return Allocation(job_id, nodes, rank, _resolve(nodes[0]), rendezvous_port(job_id))


# The stages that run on GPU nodes when the config has GPUs (verify_env probes them, sft and
# preference train, evaluate and evaluate_preference generate and score, evaluate_preference_gate
# scores, benchmarks runs lm-eval); every other stage is a CPU job.
GPU_STAGES = (
    "verify_env",
    "sft",
    "evaluate",
    "benchmarks",
    "preference",
    "evaluate_preference",
    "evaluate_preference_gate",
)


def gpus_requested(resources: dict) -> int | None:
    """GPUs per node that a rule's Slurm resources ask for (gres, gpu, slurm_extra's --gpus*);
    None when they ask for none."""
    found = []
    gres = str(resources.get("gres") or "")
    found += [int(n) for n in re.findall(r"\bgpu(?::[\w.-]+)?:(\d+)", gres)]
    if re.search(r"\bgpu(?::[\w.-]+)?(?:,|$)", gres.strip("'\"")):
        found.append(1)  # `gres: gpu` or `gpu:mi300x` alone is one GPU
    for key in ("gpu", "gpus"):
        value = str(resources.get(key) or "")
        if value.isdigit() and int(value):
            found.append(int(value))
    extra = str(resources.get("slurm_extra") or "")
    found += [int(n) for n in re.findall(r"--gpus(?:-per-node)?[= ](?:[\w.-]+:)?(\d+)", extra)]
    return max(found) if found else None


def _plain_resources(mapping) -> dict:
    """Snakemake's resources of one rule (a Resources object or a plain mapping) as {name: value}."""
    out = {}
    for name, value in dict(mapping or {}).items():
        raw = getattr(value, "raw", value)  # a Resource as written; a callable one is not a request
        if isinstance(raw, (str, int)) and not isinstance(raw, bool):
            out[name] = raw
    return out


def stage_resources(resource_settings) -> dict[str, dict]:
    """Each GPU stage's resources as Snakemake will submit them: the default resources, then the
    profile's or command line's set-resources for that rule."""
    default = _plain_resources(resource_settings.default_resources)
    overrides = resource_settings.overwrite_resources
    return {name: default | _plain_resources(overrides.get(name)) for name in GPU_STAGES}


def profile_mismatch(hardware: Hardware, resource_settings) -> str | None:
    """Why the profile's resources and the config's hardware disagree, or None.

    A Slurm profile is recognised by a partition or account on any stage; the local executor
    requests nothing, so nothing is compared.
    """
    return resources_mismatch(
        hardware.gpus_per_node, hardware.allow_cpu_on_gpu_jobs, stage_resources(resource_settings)
    )


def resources_mismatch(gpus_per_node: int, allow_cpu_on_gpu_jobs: bool, rules: dict[str, dict]) -> str | None:
    """`profile_mismatch` on plain {stage: resources}."""
    slurmish = any(r.get("slurm_partition") or r.get("slurm_account") for r in rules.values())
    for rule in GPU_STAGES:
        res = rules.get(rule, {})
        asked = gpus_requested(res)
        if gpus_per_node == 0 and asked and not allow_cpu_on_gpu_jobs:
            return (
                f"the profile requests {asked} GPU(s) per node for {rule} "
                f"(gres {res.get('gres') or '-'}) but hardware.gpus_per_node is 0: this config trains "
                "on CPU processes and would hold GPU nodes idle. Set hardware.gpus_per_node to the "
                "nodes' GPU count, or use profiles/local; to run a CPU config inside GPU jobs on "
                "purpose (a smoke test of the partition), set hardware.allow_cpu_on_gpu_jobs: true"
            )
        if gpus_per_node and asked is not None and asked != gpus_per_node:
            return (
                f"the profile requests {asked} GPU(s) per node for {rule} (gres {res.get('gres')}) "
                f"but hardware.gpus_per_node is {gpus_per_node}: make them equal (the profile's "
                f"set-resources {rule}.gres, or the config key)"
            )
        if gpus_per_node and asked is None and slurmish:
            return (
                f"hardware.gpus_per_node is {gpus_per_node} but the profile requests no GPUs for "
                f'{rule}: its job would start on a node without GPUs. Add gres: "gpu:<type>:'
                f'{gpus_per_node}" under set-resources.{rule} (profiles/slurm has the MI300X lines)'
            )
    return None


# The stages whose own shell line starts one task per node with the `mpi` resource (per_node_launcher).
PER_NODE_STAGES = ("verify_env", "sft")
_LAUNCHER_WORD = re.compile(r"[A-Za-z0-9_./=:+-]+")
_LAUNCHER_WHAT = "words of letters, digits and _ . / = : + -, the first not starting with - (e.g. srun)"


def _launcher_error(where: str, mpi, cpus) -> str | None:
    words = str(mpi).split()
    if not words or words[0].startswith("-") or not all(_LAUNCHER_WORD.fullmatch(w) for w in words):
        return (
            f"the profile's resource {where}.mpi: {str(mpi)[:200]!r} is not a launcher command: "
            + _LAUNCHER_WHAT
        )
    if not re.fullmatch(r"[1-9][0-9]{0,5}", str(cpus)):
        return (
            f"the profile's resource {where}.cpus_per_task: {str(cpus)[:200]!r} is not a whole number of "
            "CPUs (1 or more)"
        )
    return None


def launcher_resources_error(resource_settings) -> str | None:
    """Why a per-node stage's `mpi` or `cpus_per_task`, as the profile or command line sets them, cannot
    go into its launcher line; None when they can (or are not set)."""
    for rule, res in stage_resources(resource_settings).items():
        if rule in PER_NODE_STAGES:
            error = _launcher_error(rule, res.get("mpi", "srun"), res.get("cpus_per_task", 1))
            if error:
                return error
    return None


def launcher_words(mpi, nodes: int, cpus) -> list[str]:
    """The command that starts one task on each of `nodes` nodes, as words. A job's resources that a
    callable made are checked here, when its shell line is built."""
    error = _launcher_error("verify_env/sft", mpi, cpus)
    if error:
        raise ValueError(error)
    return [*str(mpi).split(), f"--nodes={nodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}",
            "--kill-on-bad-exit=1"]  # fmt: skip
