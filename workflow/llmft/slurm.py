"""Reading a Slurm allocation: nodes, first host, node rank, a per-job rendezvous port.

The Snakemake Slurm jobstep plugin strips every SLURM_* variable except SLURMD_NODENAME before it
runs a rule, so facts are read from the environment when present and from `squeue`/`scontrol`
otherwise.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from dataclasses import dataclass


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist ("n[1-3,5],gpu01") into host names, in order.

    Pure Python so it works where `scontrol` is not on PATH (and in unit tests).
    """
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for rng in ranges.split(","):
            if "-" in rng:
                lo, hi = rng.split("-", 1)
                width = len(lo)
                for i in range(int(lo), int(hi) + 1):
                    hosts.append(f"{prefix}{i:0{width}d}{suffix}")
            else:
                hosts.append(f"{prefix}{rng}{suffix}")
    return hosts


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
