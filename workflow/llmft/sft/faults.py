"""What keeps a training run trustworthy when something breaks under it.

- Sealed checkpoints: after every rank has finished writing checkpoint-N, rank 0 writes a seal
  listing each file, its size and a hash of its content. A checkpoint without a seal, or whose files
  no longer match it (a job killed mid-save, a full disk, bytes changed in place), is set aside
  before the next attempt, so the trainer resumes from the newest checkpoint that was written whole.
- Heartbeats: every rank rewrites a small file every few seconds (its host, pid and last step),
  from a thread that keeps beating while the rank waits in a collective. When the job fails, the
  launcher names the rank whose heartbeat stopped first: the one that hung or died.
- A lock per node on the work folder: a second launcher on the same training (a second run, or a
  rerun while a killed Snakemake's job is still training) is refused, naming the holder. The
  launcher's torchrun inherits the lock, so it is held until the ranks are gone, even when the
  launcher was killed first.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path

from llmft.core.io import write_json
from llmft.core.modelfiles import content_hash

SEAL_FILE = "llmft_complete.json"
HEARTBEAT_DIR = "llmft_heartbeat"
HEARTBEAT_SECONDS = 2.0
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
EXIT_BUSY = 16  # EBUSY: another launcher holds the work folder
SET_ASIDE_PREFIX = "incomplete-"  # transformers only resumes from and rotates `checkpoint-*`
DIVERGED_PREFIX = "diverged-"  # saved after a gradient spike that the next logged step confirmed


def _host() -> str:
    """This node's name as Slurm knows it (the hostname outside Slurm)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


# ------------------------------------------------------------------ sealed checkpoints


def seal(checkpoint: Path) -> None:
    """Record every file of a checkpoint that all ranks have finished writing: size and content."""
    files = {
        str(p.relative_to(checkpoint)): {"size": p.stat().st_size, "xxh3_128": content_hash(p)}
        for p in sorted(checkpoint.rglob("*"))
        if p.is_file() and p.name != SEAL_FILE
    }
    write_json(checkpoint / SEAL_FILE, {"files": files, "sealed": time.time()})


def seal_problem(checkpoint: Path, contents: bool = True) -> str | None:
    """Why a checkpoint cannot be trusted, or None when it is whole. contents=False compares the
    sizes only (what a seal written before content hashes holds)."""
    try:
        files = json.loads((checkpoint / SEAL_FILE).read_text())["files"]
    except FileNotFoundError:
        return "it has no seal (its save never finished on every rank)"
    except (OSError, ValueError, KeyError):
        return "its seal is unreadable"
    for name, sealed in files.items():
        sealed = sealed if isinstance(sealed, dict) else {"size": sealed}
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != sealed["size"]:
            return f"{name} has {path.stat().st_size} bytes, not the {sealed['size']} sealed"
        if contents and "xxh3_128" in sealed and content_hash(path) != sealed["xxh3_128"]:
            return f"{name} no longer has the content sealed (changed in place after the save)"
    return None


def _problems(work: Path) -> list[tuple[int, Path, str | None]]:
    """Each checkpoint with why it cannot be trusted (None: whole), newest first. Contents are read
    down to the newest whole one, the one training resumes from; older ones are checked by size,
    so a rerun reads one checkpoint, not every one kept."""
    out, found_whole = [], False
    for step, path in reversed(checkpoints(work)):
        why = seal_problem(path, contents=not found_whole)
        found_whole = found_whole or why is None
        out.append((step, path, why))
    return out


def checkpoints(work: Path) -> list[tuple[int, Path]]:
    """The work folder's checkpoint-N folders, by step."""
    found = []
    for p in work.iterdir() if work.is_dir() else ():
        m = CHECKPOINT.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def set_aside(path: Path, prefix: str) -> Path:
    """Rename a checkpoint folder out of `checkpoint-*` (never resumed or rotated); returns the new path."""
    target = path.with_name(f"{prefix}{path.name}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{prefix}{path.name}.{n}")
    path.rename(target)
    return target


def set_aside_unsealed(work: Path) -> list[str]:
    """Rename every checkpoint that was not written whole, so it is neither resumed nor rotated.

    Returns one warning per checkpoint set aside, naming the one training will resume from.
    """
    warnings = []
    for step, path, why in reversed(_problems(work)):
        if why is None:
            continue
        target = set_aside(path, SET_ASIDE_PREFIX)
        warnings.append(f"checkpoint-{step} is not trusted: {why}; moved to {target.name}")
    if warnings:
        whole = checkpoints(work)
        warnings.append(
            f"resuming from checkpoint-{whole[-1][0]}, the newest written whole"
            if whole
            else "no whole checkpoint is left: training starts from step 0"
        )
    return warnings


def last_whole_step(work: Path) -> int:
    """The step of the newest sealed checkpoint (0 when there is none)."""
    return next((step for step, _, why in _problems(work) if why is None), 0)


# ------------------------------------------------------------------ heartbeats


class Heartbeat:
    """A rank's heartbeat file, rewritten every HEARTBEAT_SECONDS by a daemon thread."""

    def __init__(self, work: Path, rank: int):
        self.path = work / HEARTBEAT_DIR / f"rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.record = {
            "rank": rank,
            "host": _host(),
            "pid": os.getpid(),
            "step": 0,
            "started": time.time(),
        }
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the step and the thread write the same file
        self._thread = threading.Thread(target=self._run, name="llmft-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def step(self, step: int) -> None:
        """After each optimizer step: the file says at once which step this rank finished."""
        self.record["step"] = step
        self.record["step_time"] = time.time()
        self.beat()

    def beat(self) -> None:
        with self._lock:
            try:
                write_json(self.path, dict(self.record, beat=time.time()))
            except OSError:
                pass  # a full disk must not kill the rank from here; the save will say so

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            self.beat()

    def stop(self) -> None:
        self._stop.set()


def clear_heartbeats(work: Path) -> None:
    shutil.rmtree(work / HEARTBEAT_DIR, ignore_errors=True)


def read_heartbeats(work: Path) -> list[dict]:
    beats = []
    for p in sorted((work / HEARTBEAT_DIR).glob("rank*.json")):
        try:
            beats.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(beats, key=lambda b: b["rank"])


def stalled(beats: list[dict], slack: float = 5 * HEARTBEAT_SECONDS) -> list[dict]:
    """The ranks whose heartbeat stopped well before the last one did: they hung or died first
    while the others kept beating (waiting in a collective, then ended by its timeout)."""
    if len(beats) < 2:
        return []
    last = max(b["beat"] for b in beats)
    return [b for b in beats if b["beat"] < last - slack]


def failure_report(work: Path, rc: int, timeout_minutes: float) -> list[str]:
    """What the launcher says when training failed without a stop, divergence or preemption."""
    lines = [f"training failed (exit {rc})"]
    beats = read_heartbeats(work)
    for b in stalled(beats):
        waited = max(x["beat"] for x in beats) - b["beat"]
        lines.append(
            f"rank {b['rank']} on node {b['host']} (pid {b['pid']}) stopped responding at step "
            f"{b['step']}, {waited:.0f} s before the others gave up; the others waited for it in a "
            f"collective until sft.collective_timeout_minutes ({timeout_minutes:g}) or its death "
            "ended the job"
        )
    usage = shutil.disk_usage(work)
    if usage.free < max(64 << 20, usage.total // 100):
        lines.append(
            f"the work folder's filesystem is full ({usage.free / 2**20:.0f} MiB free of "
            f"{usage.total / 2**20:,.0f} MiB) at {work}: free space there, then rerun"
        )
    step = last_whole_step(work)
    lines.append(
        f"a rerun resumes from checkpoint-{step}, the newest written whole"
        if step
        else "no whole checkpoint was written yet: a rerun starts from step 0"
    )
    return lines


# ------------------------------------------------------------------ one launcher per node


class WorkBusy(RuntimeError):
    pass


class WorkLock:
    """An exclusive lock on a node's share of a work folder, held while that node trains."""

    def __init__(self, work: Path, node_rank: int):
        self.path = work / f".llmft-node{node_rank}.lock"
        self._fh = None
        self._holder: dict = {}

    def __enter__(self) -> WorkLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            try:
                holder = json.loads(fh.read() or "{}")
            except ValueError:
                holder = {}
            fh.close()
            raise WorkBusy(self._busy_message(holder)) from None
        except OSError as exc:
            # Lustre mounted without -o flock (and some NFS setups) lock nothing: train unguarded
            # rather than not at all, and say so.
            fh.close()
            print(
                f"[llmft] WARNING: the work folder's filesystem does not lock files ({exc.strerror}): "
                "a second launcher on this training will not be refused",
                flush=True,
            )
            return self
        return self._claim(fh)

    def _claim(self, fh) -> WorkLock:
        self._fh = fh
        self._holder = {
            "pid": os.getpid(),
            "host": _host(),
            "slurm_job": os.environ.get("SLURM_JOB_ID", ""),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        self._write()
        return self

    def _write(self) -> None:
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(json.dumps(self._holder))
        self._fh.flush()

    def fds(self) -> tuple[int, ...]:
        """The lock's descriptor, for a child that must hold the lock as long as it lives."""
        return (self._fh.fileno(),) if self._fh else ()

    def note(self, **facts) -> None:
        """Add to what a refused launcher is told about the holder (its torchrun's pid)."""
        if self._fh:
            self._holder.update(facts)
            self._write()

    def _busy_message(self, holder: dict) -> str:
        who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {holder.get('since', '?')}"
        if holder.get("torchrun_pid"):
            who += f"; its torchrun, pid {holder['torchrun_pid']}, holds it until the ranks are gone"
        job = holder.get("slurm_job")
        how = (
            f"wait for Slurm job {job} (squeue -j {job}) or cancel it (scancel {job})"
            if job
            else f"wait for it or stop it (kill {holder.get('pid', '?')})"
        )
        return (
            f"another sft launcher ({who}) is training in {self.path.parent}; a second run on the "
            f"same training is refused. A Snakemake that was killed leaves its job running: {how}, "
            "then rerun (it resumes from the last checkpoint)"
        )

    def __exit__(self, *exc) -> None:
        # Closed, not unlocked: an unlock would free the lock for the torchrun that inherited it too.
        if self._fh:
            self._fh.close()
            self._fh = None
