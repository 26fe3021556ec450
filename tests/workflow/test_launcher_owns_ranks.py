"""The sft launcher owns its ranks, on real CPU training (tiny model, 2 processes, gloo), no mocks.

torchrun keeps each worker in a session of its own. A SIGKILL to the process group of the launcher's
parent (Snakemake's) must still end them, and the work folder stays locked until they are gone, so
a rerun never starts a second training beside them.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.workflow.test_sft_launcher import finish, launch, render, stage, steps_done

pytestmark = pytest.mark.workflow
__all__ = ["stage"]  # the module-scoped fixture: the demo's model and data


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def lock_free(path: Path) -> bool:
    """Whether another launcher could take the work folder's lock now (the real flock, released again)."""
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fh, fcntl.LOCK_UN)
        return True


@pytest.mark.reliability(
    fault="SIGKILL to the process group of the sft launcher's parent (Snakemake) during training",
    seen=(
        "torchrun (its own session, a parent-death signal) ends both ranks within 40 s; the work folder "
        "stays locked until they are gone, and a second launcher meanwhile is refused (exit 16) naming the "
        "launcher's and torchrun's PIDs"
    ),
    steps_lost="the steps since the last save",
    data_lost="none",
)
def test_a_killed_launcher_takes_its_ranks_and_holds_the_folder_until_they_are_gone(stage):
    name = "owned"
    # Far more steps than the test waits for: ranks left behind would still be training at the end.
    overrides, args = render(stage, name, {"max_steps": 5000, "save_steps": 100000})
    work = stage / args["output_dir"]
    cmd = [sys.executable, "-m", "llmft", "sft", "launch", "--overrides", overrides, "--yaml", f"{name}.yaml"]
    log = open(stage / f"{name}.log", "w")
    # Snakemake's place: a shell in a process group of its own, running the launcher as its child.
    shell = subprocess.Popen(
        ["bash", "-c", '"$@"; echo launcher exited $?', "bash", *cmd],
        cwd=stage,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    ranks: list[int] = []
    try:
        deadline = time.time() + 300
        while (not steps_done(work) or steps_done(work)[-1] < 3) and time.time() < deadline:
            assert shell.poll() is None, (stage / f"{name}.log").read_text()[-3000:]
            time.sleep(0.2)
        beats = [json.loads((work / "llmft_heartbeat" / f"rank{r}.json").read_text()) for r in (0, 1)]
        ranks = [b["pid"] for b in beats]
        lock = work / ".llmft-node0.lock"
        holder = json.loads(lock.read_text())
        launcher, torchrun = holder["pid"], holder["torchrun_pid"]
        assert parent_of(launcher) == shell.pid and parent_of(torchrun) == launcher
        # The ranks sit outside the shell's process group: the signal below cannot reach them itself.
        assert all(os.getpgid(pid) != shell.pid for pid in ranks)

        # A second launcher on the same training, while the first trains: refused, naming the holder.
        second = launch(stage, overrides, name, tag="-second")
        out = finish(second, 120)
        assert second.returncode == 16, out[-2000:]
        assert f"another sft launcher (pid {launcher} on " in out and f"torchrun, pid {torchrun}," in out
        assert f"is training in {args['output_dir']};" in out and all(alive(pid) for pid in ranks)

        os.killpg(shell.pid, signal.SIGKILL)
        t0 = time.monotonic()
        # The launcher is dead at once; its torchrun still holds the lock while it ends the ranks.
        assert all(alive(pid) for pid in ranks) and not lock_free(lock)
        while time.monotonic() - t0 < 120 and any(alive(pid) for pid in [*ranks, torchrun]):
            time.sleep(0.1)
        gone_s = time.monotonic() - t0
        left = [pid for pid in [*ranks, torchrun] if alive(pid)]
        assert not left, f"still running {gone_s:.0f} s after the kill: {left}"
        # torchrun gives its workers 30 s to save and stop before it kills them
        assert gone_s < 40, f"the ranks took {gone_s:.0f} s to end"
        print(f"ranks gone {gone_s:.1f} s after the kill; last step {steps_done(work)[-1]}")
        assert lock_free(lock)  # released with the last holder: a rerun may start
    finally:
        log.close()
        for pid in ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
