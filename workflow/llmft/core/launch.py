"""One node's launch plumbing, shared by verify_env and sft: environment, torchrun command, package path.

The environment comes from the `Platform` (the collective preset of the nodes' vendor and arch), so
the verify stage and the training stage start their torchrun the same way on the same nodes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from llmft.core import slurm
from llmft.core.platform import Platform

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# Linux's prctl(PR_SET_PDEATHSIG): the kernel signals a child when the thread that started it dies,
# however it dies (SIGKILL included). Loaded here, not in the forked child.
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
# The folder that holds the llmft package: children import it from here however it was installed.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def package_env(env: dict) -> dict:
    """`env` with this checkout's llmft importable (PYTHONPATH) and this interpreter's bin first on PATH."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def launch_env(platform: Platform, alloc: slurm.Allocation, base_env: dict | None = None) -> dict:
    """Environment for LLaMA-Factory's torchrun launcher (and verify_env's) on this node."""
    env = dict(os.environ if base_env is None else base_env)
    for key, value in platform.collective_env.items():
        env.setdefault(key, value)
    env.update(OFFLINE_ENV)
    env.setdefault("RECORD_VRAM", "1")  # peak GPU memory in trainer_log.jsonl
    env.update(
        {
            "FORCE_TORCHRUN": "1",
            "NNODES": str(alloc.nnodes),
            "NODE_RANK": str(alloc.node_rank),
            "NPROC_PER_NODE": str(platform.processes_per_node),
            "MASTER_ADDR": alloc.master_addr,
            "MASTER_PORT": str(alloc.master_port),
        }
    )
    if not platform.on_gpu:
        # One compute thread per process: 2 processes on 2 cores don't fight.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // platform.processes_per_node)))
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        # What LLaMA-Factory's own launcher sets (OPTIM_TORCH): less fragmentation, no
        # record_stream bookkeeping for NCCL.
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        env.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
    return package_env(env)


def torchrun_command(alloc: slurm.Allocation, nproc: int, module: str, *args: str) -> list[str]:
    """torchrun over `python -m module args`, as LLaMA-Factory's launcher builds it for FORCE_TORCHRUN."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(alloc.nnodes),
        "--node_rank",
        str(alloc.node_rank),
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        alloc.master_addr,
        "--master_port",
        str(alloc.master_port),
        "-m",
        module,
        *args,
    ]


def dies_with_this_process(sig: int = signal.SIGTERM, then: Callable[[], None] | None = None):
    """A Popen preexec_fn: the child (torchrun) gets `sig` when this process dies, so a launcher killed
    outright (SIGKILL to Snakemake's process group) takes its torchrun with it, and torchrun on
    SIGTERM ends the workers it keeps in sessions of their own. `then` runs after, in the child."""
    parent = os.getpid()

    def preexec() -> None:
        if _LIBC is not None:
            _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the prctl took hold
            os._exit(128 + int(sig))
        if then is not None:
            then()

    return preexec


def owns_its_children() -> bool:
    """Whether dies_with_this_process works here (Linux): only then may a launcher start torchrun in
    a session of its own, out of reach of a signal to its own process group."""
    return _LIBC is not None
