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
