"""Faults during real CPU training (tiny model, 2 processes, gloo, ZeRO-3), no mocks: a rank killed,
a rank hung, the newest checkpoint half-written, the disk full during a save, a second launcher on
the same training. Each attempt fails in bounded time with a message that names what happened, and
the rerun resumes from the newest checkpoint written whole, losing at most one save interval.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.workflow.test_sft_launcher import finish, launch, publish, render, stage, steps_done

pytestmark = pytest.mark.workflow
__all__ = ["stage"]  # the module-scoped fixture: the demo's model and data, made once here

SAVE = 10
KILLED_WITHIN_S = 90  # a bound that holds on a loaded 2-core machine
REFUSED_WITHIN_S = 60
HUNG_TIMEOUT_S = 15  # sft.collective_timeout_minutes 0.25
HUNG_WITHIN_S = HUNG_TIMEOUT_S + 30 + 60  # torchrun's 30 s before SIGKILL, and slack for a loaded machine
IN_FLIGHT = 2  # steps the other rank may finish (a save among them cut short) before it stops


def start(stage: Path, name: str, sft: dict, work_root: str = "work"):
    """Render `name` with these sft keys and start its launcher: (overrides, work folder, process)."""
    overrides, args = render(stage, name, sft, work_root=work_root)
    return overrides, stage / args["output_dir"], launch(stage, overrides, name)


def heartbeat(work: Path, rank: int) -> dict:
    return json.loads((work / "llmft_heartbeat" / f"rank{rank}.json").read_text())


def wait_for_step(proc, work: Path, step: int, timeout: float = 240) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        done = steps_done(work)
        if done and done[-1] >= step:
            return done[-1]
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s:\n{proc.log_path.read_text()[-3000:]}")


def attempts(work: Path) -> list[int]:
    """The step each training attempt started from, in order."""
    lines = (work / "llmft_steps.jsonl").read_text().splitlines()
    return [json.loads(x)["attempt_start"] for x in lines if "attempt_start" in x]


def resume_to_the_end(root: Path, overrides: str, name: str, work: Path, steps: int) -> tuple[str, dict]:
    proc = launch(root, overrides, name, tag="-rerun")
    out = finish(proc, 300)
    assert proc.returncode == 0, out[-3000:]
    summary = publish(root, overrides, name)
    assert summary["steps"] == steps
    return out, summary


@pytest.mark.reliability(
    fault="one training rank killed (SIGKILL)",
    seen=f"the attempt fails within {KILLED_WITHIN_S} s; torchrun names the rank and its signal; llmft "
    "says which checkpoint a rerun resumes from",
    steps_lost=f"the steps since the last whole save, and those the other rank finishes before it stops: "
    f"at most sft.save_steps + {IN_FLIGHT}",
    data_lost="none",
)
def test_a_killed_rank_fails_the_attempt_and_the_rerun_resumes(stage):
    name = "killed"
    overrides, work, proc = start(stage, name, {"max_steps": 40, "save_steps": SAVE})
    at = wait_for_step(proc, work, SAVE + 3)
    victim = heartbeat(work, 1)
    t0 = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    out = finish(proc, 180)
    assert proc.returncode not in (0, 75), out[-3000:]
    assert time.monotonic() - t0 < KILLED_WITHIN_S
    assert "Signal 9 (SIGKILL) received" in out and "rank" in out
    assert f"[llmft] training failed (exit {proc.returncode})" in out
    resumed = max(s for s in (10, 20, 30) if s <= at)
    assert f"[llmft] a rerun resumes from checkpoint-{resumed}" in out, out[-3000:]
    lost = steps_done(work)[-1] - resumed
    assert 0 <= lost <= SAVE + IN_FLIGHT
    rerun, summary = resume_to_the_end(stage, overrides, name, work, 40)
    assert attempts(work) == [0, resumed]
    assert summary["attempt"]["steps_lost"] == lost


@pytest.mark.reliability(
    fault="one training rank hung (SIGSTOP) in a collective",
    seen=f"the job fails after sft.collective_timeout_minutes ({HUNG_TIMEOUT_S} s here), within "
    f"{HUNG_WITHIN_S} s of the hang; llmft names the rank, its node and pid, and the step it stopped at",
    steps_lost="the steps since the last save (< sft.save_steps)",
    data_lost="none: the rerun resumes from the last checkpoint and finishes",
)
def test_a_hung_rank_fails_within_the_collective_timeout_and_is_named(stage):
    name = "hung"
    # 0.25 min = 15 s: the workers' collectives give up after that; torchrun then waits 30 s for
    # the stopped rank to take its SIGTERM before it sends SIGKILL.
    overrides, work, proc = start(
        stage, name, {"max_steps": 30, "save_steps": SAVE, "collective_timeout_minutes": HUNG_TIMEOUT_S / 60}
    )
    wait_for_step(proc, work, SAVE + 3)
    victim = heartbeat(work, 1)
    t0 = time.monotonic()
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        out = finish(proc, 240)
    finally:
        try:
            os.kill(victim["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    wall = time.monotonic() - t0
    assert proc.returncode not in (0, 75), out[-3000:]
    assert HUNG_TIMEOUT_S <= wall < HUNG_WITHIN_S, f"took {wall:.0f} s"
    host = victim["host"]
    assert f"rank 1 on node {host} (pid {victim['pid']}) stopped responding at step" in out, out[-3000:]
    assert "sft.collective_timeout_minutes (0.25)" in out
    assert "rank 0 on node" not in out
    assert "[llmft] a rerun resumes from checkpoint-10" in out, out[-3000:]
    lost = steps_done(work)[-1] - SAVE
    assert 0 < lost < SAVE
    rerun, summary = resume_to_the_end(stage, overrides, name, work, 30)
    assert "not trusted" not in rerun
    assert attempts(work) == [0, SAVE] and summary["attempt"]["steps_lost"] == lost


@pytest.fixture(scope="module")
def stopped_past_the_second_save(stage) -> tuple[Path, int]:
    """One training past checkpoint-20, stopped (a checkpoint now): its work folder and the step of its
    newest checkpoint. Each checkpoint-corruption test spoils a copy of it."""
    _, work, proc = start(stage, "stopped", {"max_steps": 30, "save_steps": SAVE})
    wait_for_step(proc, work, 2 * SAVE + 2)
    os.kill(proc.pid, signal.SIGUSR1)  # a checkpoint now, then stop
    out = finish(proc, 180)
    assert proc.returncode == 75, out[-3000:]
    stopped = json.loads((work / "llmft_preempted.json").read_text())["step"]
    assert (work / f"checkpoint-{stopped}" / "llmft_complete.json").is_file()  # sealed by every rank's save
    return work, stopped


def stop_at_the_third_save(stage: Path, name: str, stopped: tuple[Path, int]) -> tuple[str, Path, Path, Path]:
    """The stopped training (stopped_past_the_second_save) copied as `name`'s: (overrides, work, the
    newest checkpoint, its largest file)."""
    overrides, args = render(stage, name, {"max_steps": 30, "save_steps": SAVE})
    work = stage / args["output_dir"]
    shutil.copytree(stopped[0], work)
    newest = work / f"checkpoint-{stopped[1]}"
    shard = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    return overrides, work, newest, shard


def resumed_from_the_one_before(stage: Path, overrides: str, name: str, work: Path, newest: Path, why: str):
    rerun, summary = resume_to_the_end(stage, overrides, name, work, 30)
    assert (
        f"[llmft] WARNING: {newest.name} is not trusted: {why}; moved to incomplete-{newest.name}" in rerun
    ), rerun[-3000:]
    assert "[llmft] WARNING: resuming from checkpoint-20, the newest written whole" in rerun
    assert attempts(work) == [0, 20]
    assert (work / f"incomplete-{newest.name}").is_dir()  # kept, not deleted
    assert summary["attempt"]["resumed_from_step"] == 20


@pytest.mark.reliability(
    fault="newest checkpoint half-written (a shard truncated after the save)",
    seen="a warning names the checkpoint and the file; training resumes from the one before",
    steps_lost="the steps between the two checkpoints (< sft.save_steps)",
    data_lost="none: the bad checkpoint is kept aside as incomplete-checkpoint-N",
)
def test_a_half_written_newest_checkpoint_is_set_aside(stage, stopped_past_the_second_save):
    name = "halfsaved"
    overrides, work, newest, shard = stop_at_the_third_save(stage, name, stopped_past_the_second_save)
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:
        fh.truncate(size // 2)
    why = f"{shard.relative_to(newest)} has {size // 2} bytes, not the {size} sealed"
    resumed_from_the_one_before(stage, overrides, name, work, newest, why)


@pytest.mark.reliability(
    fault="newest checkpoint corrupted in place, its sizes unchanged (bytes flipped in its largest shard)",
    seen="a warning names the checkpoint and the file whose content no longer matches its seal's "
    "hash; training resumes from the one before and finishes",
    steps_lost="the steps between the two checkpoints (< sft.save_steps)",
    data_lost="none: the bad checkpoint is kept aside as incomplete-checkpoint-N",
)
def test_a_newest_checkpoint_corrupted_in_place_is_set_aside(stage, stopped_past_the_second_save):
    name = "bitrot"
    overrides, work, newest, shard = stop_at_the_third_save(stage, name, stopped_past_the_second_save)
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:
        fh.seek(size // 2)
        block = fh.read(4096)
        fh.seek(size // 2)
        fh.write(bytes(b ^ 0xFF for b in block))
    assert shard.stat().st_size == size
    why = f"{shard.relative_to(newest)} no longer has the content sealed (changed in place after the save)"
    resumed_from_the_one_before(stage, overrides, name, work, newest, why)


def _mount_tmpfs(path: Path, size_mb: int) -> str | None:
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], capture_output=True, text=True
    )
    return None if res.returncode == 0 else (res.stderr.strip() or f"mount exit {res.returncode}")


@pytest.mark.reliability(
    fault="disk full during a checkpoint save (a small filesystem for the work folder)",
    seen="the attempt fails; llmft says the work folder's filesystem is full, how much is free, "
    "and which checkpoint a rerun resumes from",
    steps_lost="the steps since the last whole checkpoint",
    data_lost="none: the partial checkpoint is set aside on the rerun",
)
def test_a_full_disk_during_a_save_loses_only_that_save(stage):
    name = "diskfull"
    small = stage / "small"
    # One checkpoint of the tiny model (bf16 weights, fp32 master weights and Adam moments, RNG
    # states) is about 9 MB: 16 MB hold the first save, not the second.
    problem = _mount_tmpfs(small, 16)
    if problem:
        pytest.skip(f"cannot mount a small tmpfs here ({problem}): needs root, as the Slurm tests do")
    try:
        overrides, work, proc = start(stage, name, {"max_steps": 30, "save_steps": SAVE}, work_root="small")
        out = finish(proc, 240)
        assert proc.returncode not in (0, 75), out[-3000:]
        full = re.search(
            r"\[llmft\] the work folder's filesystem is full \((\d+) MiB free of ([\d,]+) MiB\)", out
        )
        assert full and int(full.group(1)) < 1 and full.group(2) == "16", out[-3000:]
        assert "[llmft] a rerun resumes from checkpoint-10" in out
        subprocess.run(["mount", "-o", "remount,size=256m", str(small)], check=True)
        rerun, summary = resume_to_the_end(stage, overrides, name, work, 30)
        assert "[llmft] WARNING: checkpoint-20 is not trusted" in rerun, rerun[-3000:]
        assert attempts(work) == [0, 10] and summary["attempt"]["resumed_from_step"] == 10
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


@pytest.mark.reliability(
    fault="a second launcher on the same training (a rerun while the first still trains)",
    seen=f"refused within {REFUSED_WITHIN_S} s (exit 16), naming the running launcher's pid and how to "
    "stop it (`kill PID`); the running training goes on",
    steps_lost="none",
    data_lost="none",
)
def test_a_second_launcher_on_the_same_training_is_refused(stage):
    name = "twice"
    overrides, work, first = start(stage, name, {"max_steps": 200, "save_steps": 1000})
    try:
        wait_for_step(first, work, 2)
        second = launch(stage, overrides, name, tag="-second")
        out = finish(second, REFUSED_WITHIN_S)
        assert second.returncode == 16, out[-2000:]
        assert f"another sft launcher (pid {first.pid} on" in out and f"kill {first.pid}" in out
        assert first.poll() is None  # the first run was not disturbed
    finally:
        first.send_signal(signal.SIGUSR1)
        finish(first, 180)
    assert first.returncode == 75
