"""Sealed checkpoints, heartbeats and the per-node work lock (workflow/llmft/sft/faults.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from llmft.sft import faults


def checkpoint(work, step, files=None):
    path = work / f"checkpoint-{step}"
    path.mkdir(parents=True)
    for name, data in (files or {"model.safetensors": b"x" * 100, "global_step1/zero.pt": b"y" * 50}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


def test_only_checkpoints_written_whole_are_resumed_from(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoint(tmp_path, step)
    for step in (10, 20, 30):
        faults.seal(tmp_path / f"checkpoint-{step}")
    # 40 was never sealed (killed mid-save); 30 lost bytes after its seal (a truncated shard)
    (tmp_path / "checkpoint-30/global_step1/zero.pt").write_bytes(b"y" * 10)
    assert faults.seal_problem(tmp_path / "checkpoint-20") is None
    assert "no seal" in faults.seal_problem(tmp_path / "checkpoint-40")
    assert "global_step1/zero.pt has 10 bytes, not the 50 sealed" in faults.seal_problem(
        tmp_path / "checkpoint-30"
    )
    assert faults.last_whole_step(tmp_path) == 20
    warnings = faults.set_aside_unsealed(tmp_path)
    assert warnings[:2] == [
        "checkpoint-30 is not trusted: global_step1/zero.pt has 10 bytes, not the 50 sealed; "
        "moved to incomplete-checkpoint-30",
        "checkpoint-40 is not trusted: it has no seal (its save never finished on every rank); "
        "moved to incomplete-checkpoint-40",
    ]
    assert warnings[-1] == "resuming from checkpoint-20, the newest written whole"
    assert [s for s, _ in faults.checkpoints(tmp_path)] == [10, 20]
    # set aside again later: the names never collide, and nothing is deleted
    checkpoint(tmp_path, 30)
    faults.set_aside_unsealed(tmp_path)
    assert (tmp_path / "incomplete-checkpoint-30.2").is_dir()
    assert faults.set_aside_unsealed(tmp_path) == []


def test_a_checkpoint_changed_in_place_with_its_sizes_kept_is_not_trusted(tmp_path):
    for step in (10, 20):
        checkpoint(tmp_path, step)
        faults.seal(tmp_path / f"checkpoint-{step}")
    weights = tmp_path / "checkpoint-20/model.safetensors"
    with open(weights, "r+b") as fh:  # bit rot, a bad copy: the same size, other bytes
        fh.seek(37)
        fh.write(b"\xff\x00")
    assert weights.stat().st_size == 100
    assert faults.seal_problem(tmp_path / "checkpoint-20") == (
        "model.safetensors no longer has the content sealed (changed in place after the save)"
    )
    assert faults.last_whole_step(tmp_path) == 10
    assert faults.set_aside_unsealed(tmp_path) == [
        "checkpoint-20 is not trusted: model.safetensors no longer has the content sealed (changed in "
        "place after the save); moved to incomplete-checkpoint-20",
        "resuming from checkpoint-10, the newest written whole",
    ]


def test_a_seal_without_content_hashes_is_checked_by_size(tmp_path):
    path = checkpoint(tmp_path, 10)
    (path / faults.SEAL_FILE).write_text(json.dumps({"files": {"model.safetensors": 100}}))
    assert faults.seal_problem(path) is None
    (path / "model.safetensors").write_bytes(b"x" * 99)
    assert faults.seal_problem(path) == "model.safetensors has 99 bytes, not the 100 sealed"


def test_no_whole_checkpoint_means_step_zero(tmp_path):
    checkpoint(tmp_path, 5)
    assert (
        faults.set_aside_unsealed(tmp_path)[-1] == "no whole checkpoint is left: training starts from step 0"
    )
    assert faults.last_whole_step(tmp_path) == 0


def test_the_rank_whose_heartbeat_stopped_first_is_named(tmp_path):
    beats = [
        {"rank": 0, "host": "n1", "pid": 11, "step": 8, "beat": 1000.0},
        {"rank": 1, "host": "n2", "pid": 22, "step": 7, "beat": 960.0},
        {"rank": 2, "host": "n2", "pid": 23, "step": 8, "beat": 998.5},
    ]
    assert [b["rank"] for b in faults.stalled(beats)] == [1]
    assert faults.stalled(beats[:1]) == []
    (tmp_path / faults.HEARTBEAT_DIR).mkdir()
    for b in beats:
        (tmp_path / faults.HEARTBEAT_DIR / f"rank{b['rank']}.json").write_text(json.dumps(b))
    lines = faults.failure_report(tmp_path, 1, 0.25)
    assert lines[0] == "training failed (exit 1)"
    assert lines[1].startswith("rank 1 on node n2 (pid 22) stopped responding at step 7, 40 s before")
    assert "sft.collective_timeout_minutes (0.25)" in lines[1]
    assert lines[-1] == "no whole checkpoint was written yet: a rerun starts from step 0"


def test_a_live_heartbeat_keeps_beating_while_its_thread_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(faults, "HEARTBEAT_SECONDS", 0.05)
    hb = faults.Heartbeat(tmp_path, 3).start()
    hb.step(12)
    first = json.loads(hb.path.read_text())["beat"]
    time.sleep(0.3)
    hb.stop()
    rec = json.loads(hb.path.read_text())
    assert rec["beat"] > first and rec["step"] == 12 and rec["pid"] == os.getpid() and rec["rank"] == 3


HOLD = """
import sys, time
from pathlib import Path
from llmft.sft.faults import WorkLock
with WorkLock(Path(sys.argv[1]), 0):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_launcher_on_the_same_work_folder_is_refused(tmp_path):
    env = dict(os.environ, SLURM_JOB_ID="4242", SLURMD_NODENAME="n1")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(faults.WorkBusy) as err:
            with faults.WorkLock(tmp_path, 0):
                pass
        msg = str(err.value)
        assert f"pid {holder.pid} on n1" in msg and "scancel 4242" in msg and "resumes" in msg
        with faults.WorkLock(tmp_path, 1):  # another node's share is its own
            pass
    finally:
        holder.kill()
        holder.wait()
    with faults.WorkLock(tmp_path, 0):  # released by the holder's death, even a SIGKILL
        pass


def test_a_filesystem_without_locks_trains_unguarded_with_a_warning(tmp_path, monkeypatch, capsys):
    def no_locks(fh, op):
        raise OSError(38, "Function not implemented")  # ENOSYS: Lustre mounted without -o flock

    monkeypatch.setattr(faults.fcntl, "flock", no_locks)
    with faults.WorkLock(tmp_path, 0):
        pass
    assert "does not lock files (Function not implemented)" in capsys.readouterr().out
