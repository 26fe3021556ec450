"""A benchmark job over several processes: one per GPU of the job (or, asked for, CPU processes).

The job's own process counts the GPUs its allocation gave it (Slurm's gres sets the visible
devices), starts torchrun over `python -m llmft.benchmarks.worker SPEC` (an argument list, no shell),
and reads what rank 0 wrote. Each rank loads the model on its own device and runs every task;
lm-eval gives it every world_size-th document and gathers the per-document metrics on rank 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from llmft.benchmarks.score import BenchmarkError, evaluate_tasks
from llmft.benchmarks.tasks import task_manager
from llmft.core import slurm
from llmft.core.io import read_optional, write_json, write_text
from llmft.core.launch import OFFLINE_ENV, package_env, torchrun_command
from llmft.core.settings import Eval

SPEC, RESULT = "spec.json", "scores.json"


def process_count(requested: int, device: str) -> int:
    """One process per GPU visible to the job (at most `requested` when given); on CPU `requested`
    processes, 1 unless asked."""
    if device != "cuda":
        return max(1, requested)
    import torch

    gpus = torch.cuda.device_count()
    return min(requested or gpus, gpus)


def launch(ecfg: Eval, model_dir: str, device: str, dtype: str, threads: int, n: int) -> dict:
    """Run the benchmarks over `n` processes; {"tasks": ..., "processes": ...} from rank 0."""
    # a single node: rendezvous on this host, on a port free now (jobs may share the node)
    alloc = dataclasses.replace(
        slurm.current_allocation(), nodes=["localhost"], node_rank=0, master_addr="127.0.0.1"
    )
    alloc = dataclasses.replace(alloc, master_port=slurm.free_port())
    env = package_env({**os.environ, **OFFLINE_ENV})
    per_process = max(1, (threads or os.cpu_count() or 1) // n)
    if device != "cuda":
        env["OMP_NUM_THREADS"] = str(per_process)  # n processes share the job's cores
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        spec = {
            "eval": dataclasses.asdict(ecfg),  # the eval section, as JSON the ranks read back
            "model": model_dir,
            "dtype": dtype,
            "threads": per_process if device != "cuda" else 0,
        }
        write_json(Path(tmp) / SPEC, spec)
        print(f"[llmft] benchmarks over {n} processes ({device})", flush=True)
        cmd = torchrun_command(alloc, n, "llmft.benchmarks.worker", tmp)
        rc = _run_forwarding(cmd, env, Path(tmp))
        errors = sorted(Path(tmp).glob("error-*.txt"))
        if errors:
            raise BenchmarkError(errors[0].read_text())
        result = read_optional(Path(tmp) / RESULT)
        if rc != 0 or result is None:
            raise BenchmarkError(
                f"the {n} benchmark processes on {model_dir} failed (torchrun exit {rc}); "
                "their output is above in this log"
            )
        return result


def _run_forwarding(cmd: list[str], env: dict, folder: Path) -> int:
    """torchrun's exit status; its output goes to this job's log as it comes, except the traceback
    torchrun prints of its own when a rank stopped on an error that rank already named."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    named = False
    for line in proc.stdout:
        named = named or (line.startswith("Traceback") and any(folder.glob("error-*.txt")))
        if not named:
            sys.stdout.write(line)
            sys.stdout.flush()
    return proc.wait()


def main(folder: str) -> int:
    """One rank: its device, the process group, lm-eval over its share; rank 0 writes the result."""
    import torch
    import torch.distributed as dist

    spec = json.loads((Path(folder) / SPEC).read_text())
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    else:
        device = "cpu"
    dist.init_process_group("nccl" if device != "cpu" else "gloo")
    ecfg = Eval(**spec["eval"])
    try:
        done = evaluate_tasks(
            Path(spec["model"]), ecfg, task_manager(ecfg, Path.cwd()), device, spec["dtype"], spec["threads"]
        )
    except BenchmarkError as exc:
        write_text(Path(folder) / f"error-{rank}.txt", str(exc))
        print(f"llmft: benchmark error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        write_json(Path(folder) / RESULT, done)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
