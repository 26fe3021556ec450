"""sft, part two: this node's torchrun over llmft.sft.train; stops forwarded, requeued after preemption."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import yaml
from llmft.core import slurm
from llmft.core.launch import dies_with_this_process, launch_env, owns_its_children, torchrun_command
from llmft.core.platform import Platform
from llmft.core.settings import Config
from llmft.sft import faults
from llmft.sft.markers import (
    DIVERGENCE_FILE,
    EXIT_DIVERGED,
    EXIT_PREEMPTED,
    PREEMPTED_FILE,
    STEPS_FILE,
    STOP_REQUEST_FILE,
)

# History of earlier attempts in the work folder: one JSON line per stop, preemption or divergence.
EVENTS_FILE = "llmft_events.jsonl"


def worker_pids(parent: int) -> list[int]:
    """All descendants of a process (torchrun's workers), read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [parent]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _archive(work: Path, name: str) -> None:
    path = work / name
    if not path.exists():
        return
    text = path.read_text()
    try:
        content = json.loads(text)
    except ValueError:
        content = text
    with open(work / EVENTS_FILE, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"file": name, "archived": time.time(), "content": content}) + "\n")
    path.unlink()


def _ignore_usr1() -> None:
    # torchrun has no SIGUSR1 handler and would die of it; ignoring is inherited through exec,
    # and llmft.sft.train installs its own handler in the workers.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def launch(cfg: Config, yaml_path: str, worker: str = "llmft.sft.train") -> int:
    """Run this node's torchrun over `worker` (llmft.sft.train, or llmft.worker: it with the trainer
    patches other stages supply); forward stop signals; requeue after preemption.

    One launcher per node and work folder at a time (faults.WorkLock); a second is refused. The
    launcher owns its ranks: however it dies, torchrun ends them, and the lock is held until it has.
    """
    alloc = slurm.current_allocation()
    if alloc.nnodes != cfg.hardware.nodes:
        raise RuntimeError(
            f"the job has {alloc.nnodes} node(s) {alloc.nodes} but hardware.nodes is "
            f"{cfg.hardware.nodes}: the Slurm resources and the config disagree"
        )
    if not alloc.job_id:
        # Outside Slurm one node rendezvouses with itself: any free port (or MASTER_PORT), so runs
        # side by side on one machine never collide on a fixed one.
        port = int(os.environ.get("MASTER_PORT") or slurm.free_port())
        alloc = dataclasses.replace(alloc, master_port=port)
    args = yaml.safe_load(Path(yaml_path).read_text())
    work = Path(args["output_dir"])
    work.mkdir(parents=True, exist_ok=True)
    try:
        with faults.WorkLock(work, alloc.node_rank) as lock:
            return _launch_locked(cfg, yaml_path, args, work, alloc, lock, worker)
    except faults.WorkBusy as exc:
        print(f"[llmft] {exc}", flush=True)
        return faults.EXIT_BUSY


def _launch_locked(
    cfg: Config,
    yaml_path: str,
    args: dict,
    work: Path,
    alloc: slurm.Allocation,
    lock: faults.WorkLock,
    worker: str = "llmft.sft.train",
) -> int:
    ours = args.get("llmft") or {}
    platform = Platform.from_json(ours["platform"])
    if finished(work):
        # The same config trained to the end before (its outputs were deleted, or the job died after
        # training): LLaMA-Factory would "resume" from the final checkpoint and train 0 steps.
        print(f"[llmft] training in {work} had finished: publishing it again, not training", flush=True)
        if alloc.node_rank == 0:
            with open(work / STEPS_FILE, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"republished": time.time()}) + "\n")
        return 0
    if alloc.node_rank == 0:
        _clear_previous_attempt(work)
    env = launch_env(platform, alloc)
    host = os.environ.get("SLURMD_NODENAME", alloc.nodes[alloc.node_rank])
    print(
        # the first part in LLaMA-Factory's own launcher wording, which its users grep for
        f"[llmft] Initializing {env['NPROC_PER_NODE']} distributed tasks at: {alloc.master_addr}:"
        f"{alloc.master_port} (node {host}, rank {alloc.node_rank}/{alloc.nnodes}, work {work})",
        flush=True,
    )
    # torchrun keeps each worker in a session of its own; a launcher SIGKILLed with its process group
    # (Snakemake's) would leave them training. So torchrun runs in a session of its own, out of that
    # signal's reach, gets SIGTERM when this launcher dies (it then ends its workers), and holds the
    # work folder's lock (an inherited descriptor) until it exits: no rerun starts beside them.
    proc = subprocess.Popen(
        torchrun_command(alloc, platform.processes_per_node, worker, yaml_path),
        env=env,
        preexec_fn=dies_with_this_process(signal.SIGTERM, then=_ignore_usr1),
        start_new_session=owns_its_children(),
        pass_fds=lock.fds(),
    )
    lock.note(torchrun_pid=proc.pid)
    try:
        rc = _wait_forwarding_stops(proc, work, host)
    finally:
        _end(proc)
    return _exit_code(cfg, ours, work, alloc, rc)


def _end(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """A launcher leaving early (an exception, Ctrl-C) ends its torchrun first: torchrun asks its
    workers to stop (SIGTERM: they save and exit) and, after its own grace, kills them."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *worker_pids(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait()


def _clear_previous_attempt(work: Path) -> None:
    """Which leftovers of the previous attempt node 0 moves out of the way before this one starts."""
    # What ended the previous attempt (stop request, preemption, divergence) moves to the event
    # history, so this attempt's markers mean this attempt. Node 0 does it before the rendezvous
    # that every worker waits for.
    for stale in (STOP_REQUEST_FILE, PREEMPTED_FILE, DIVERGENCE_FILE):
        _archive(work, stale)
    # A checkpoint a killed attempt left half-written would be the one LLaMA-Factory resumes
    # from: set it aside, so training resumes from the newest one written whole.
    for warning in faults.set_aside_unsealed(work):
        print(f"[llmft] WARNING: {warning}", flush=True)
    faults.clear_heartbeats(work)


def _wait_forwarding_stops(proc: subprocess.Popen, work: Path, host: str) -> int:
    """torchrun's exit status; a SIGUSR1/SIGTERM meanwhile becomes a stop request to its workers."""

    def on_signal(signum, _frame):
        name = signal.Signals(signum).name
        print(f"[llmft] {name}: asking the trainer to save a checkpoint and stop", flush=True)
        request = work / STOP_REQUEST_FILE
        if not request.exists():
            request.write_text(json.dumps({"signal": name, "host": host, "time": time.time()}))
        for pid in worker_pids(proc.pid):
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:
                pass

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_code(cfg: Config, ours: dict, work: Path, alloc: slurm.Allocation, rc: int) -> int:
    """The launcher's exit status: diverged, preempted (requeued when asked) or torchrun's own."""
    # torchrun reports any worker failure as 1: the workers' marker files say what happened.
    if (work / DIVERGENCE_FILE).exists():
        print(f"[llmft] {json.loads((work / DIVERGENCE_FILE).read_text())['message']}", flush=True)
        return EXIT_DIVERGED
    if (work / PREEMPTED_FILE).exists():
        info = json.loads((work / PREEMPTED_FILE).read_text())
        print(
            f"[llmft] checkpoint saved at step {info['step']} ({info['why']}); exiting to resume", flush=True
        )
        # Every node asks, before it exits: srun --kill-on-bad-exit cancels the step at the first
        # node's exit status 75, so a node 0 still winding down could be killed before it asked.
        # Slurm refuses a second ask for a job it is already requeueing, so the job runs again once.
        if ours.get("requeue_on_preempt") and alloc.job_id:
            _requeue(alloc.job_id)
        return EXIT_PREEMPTED
    if rc != 0:
        timeout = cfg.sft.collective_timeout_minutes
        for line in faults.failure_report(work, rc, timeout):
            print(f"[llmft] {line}", flush=True)
    return rc


def _requeue(job_id: str) -> None:
    """Ask Slurm to requeue the preempted job, so it resumes from the checkpoint just saved."""
    req = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    print(
        f"[llmft] scontrol requeue {job_id}: rc {req.returncode} {req.stderr.strip()}",
        flush=True,
    )


def finished(work: Path) -> bool:
    """LLaMA-Factory wrote its end-of-training results and the final model (or, for LoRA, the final
    adapter) into the work folder."""
    final = (work / "config.json").is_file() or (work / "adapter_config.json").is_file()
    return (work / "all_results.json").is_file() and final
