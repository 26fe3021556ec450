"""A node lost mid-training on the real Slurm test cluster: while the two-node sft job trains, node
n2 goes away at once (its slurmd, the job's slurmstepd there and every task it ran are killed, as a
power loss would), then comes back (slurmd restarted, as a rebooted or replaced node would). The
job must end in bounded time, and the run must finish from the newest checkpoint written whole,
losing less than one save interval.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.slurm.cluster import RUN, cluster_start, rebuilt_upstream, running_job_id, trained_steps

pytestmark = pytest.mark.slurm

STEPS, SAVE = 30, 10
ENDS_WITHIN_S = 300
IN_FLIGHT = 3  # steps the surviving node may finish (a save among them cut short) before it stops
SLURM_CONF = "/etc/slurm/slurm.conf"


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _stat(pid: int) -> tuple[str, int]:
    """(command name, parent pid) of a process."""
    text = Path(f"/proc/{pid}/stat").read_text()
    name = text[text.index("(") + 1 : text.rindex(")")]
    return name, int(text[text.rindex(")") + 2 :].split()[1])


def node_processes(node: str) -> list[int]:
    """The tasks a node runs (SLURMD_NODENAME), the slurmstepd that started them, and its slurmd."""
    tasks, stepds = set(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if _environ(pid).get("SLURMD_NODENAME") == node:
            tasks.add(pid)
    for pid in list(tasks):
        try:
            name, parent = _stat(pid)
            pname, _ = _stat(parent)
        except (OSError, ValueError):
            continue
        if pname.startswith("slurmstepd"):
            stepds.add(parent)
    slurmd = int(Path(f"/var/lib/llmft-slurm/run/slurmd-{node}.pid").read_text())
    return [slurmd, *sorted(stepds), *sorted(tasks)]


def kill_leftovers(folder: Path) -> list[int]:
    """Kill what still runs in `folder` once the run is over: the first attempt's job-side
    Snakemake on the surviving node outlives its batch step here (the test cluster tracks job
    processes by process group, not cgroup, and that Snakemake has a group of its own)."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if cwd == str(folder) or cwd.startswith(f"{folder}/"):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
            except ProcessLookupError:
                pass
    return killed


def job_state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


@pytest.mark.reliability(
    fault="a node lost mid-training: its slurmd, the job's slurmstepd and every rank there killed at once",
    seen=(
        f"the job ends within {ENDS_WITHIN_S // 60} minutes; once the node is back (slurmd restarted), "
        "Snakemake's retry or Slurm's requeue runs sft again and it resumes from the newest checkpoint "
        "written whole"
    ),
    steps_lost="the steps since the last whole save, and those the surviving node finishes before it "
    f"stops: at most sft.save_steps + {IN_FLIGHT}",
    data_lost="none",
)
def test_a_node_lost_mid_training_ends_the_job_and_the_run_resumes(tmp_path, slurm_upstream):
    # the shared verify_env, base model and data; up to training: evaluation is not at stake here
    work = slurm_upstream.copy_to(tmp_path, sft__max_steps=STEPS, sft__save_steps=SAVE, sft__logging_steps=1)
    proc = cluster_start(work, tmp_path / "snakemake.log", f"results/{RUN}/sft/train_summary.json")
    work_root = work / f"results/{RUN}/work"
    try:
        deadline, need = time.time() + 600, SAVE + 4
        while time.time() < deadline and proc.poll() is None and len(trained_steps(work_root, "sft")) < need:
            time.sleep(1)
        job = running_job_id("sft")
        at_loss = len(trained_steps(work_root, "sft"))
        assert job and at_loss >= SAVE + 4, (tmp_path / "snakemake.log").read_text()[-4000:]
        victims = node_processes("n2")
        assert len(victims) >= 3, victims  # slurmd, slurmstepd, the node's launcher (and its ranks)
        t0 = time.monotonic()
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # The job on the surviving node ends by itself (its collectives lose their peer).
        while job_state(job) == "RUNNING" and time.monotonic() - t0 < ENDS_WITHIN_S:
            time.sleep(2)
        ended = time.monotonic() - t0
        assert job_state(job) != "RUNNING", f"job {job} still running {ended:.0f} s after the node was lost"
        subprocess.run(["slurmd", "-f", SLURM_CONF, "-N", "n2"], check=True)  # the node comes back
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
        # the node is back for the tests after this one, whatever happened here
        if subprocess.run(["pgrep", "-f", "slurmd -f .* -N n2"], capture_output=True).returncode:
            subprocess.run(["slurmd", "-f", SLURM_CONF, "-N", "n2"])
        subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"], capture_output=True)
        leftovers = kill_leftovers(tmp_path)
        if leftovers:
            print(f"node lost: killed {len(leftovers)} leftover process(es) of the lost attempt", flush=True)
    text = (tmp_path / "snakemake.log").read_text()
    assert proc.returncode == 0, text[-5000:]
    assert not rebuilt_upstream(text)
    print(f"node lost: job {job} ended {ended:.0f} s later", flush=True)
    steps = trained_steps(work_root, "sft")
    sft_dir = next(work_root.glob("sft-*"))
    starts = [
        json.loads(x)["attempt_start"]
        for x in (sft_dir / "llmft_steps.jsonl").read_text().splitlines()
        if "attempt_start" in x
    ]
    resumed = starts[-1]
    assert len(starts) >= 2 and resumed >= SAVE and resumed % SAVE == 0, starts
    assert set(steps) == set(range(1, STEPS + 1))  # every step trained, some twice
    summary = json.loads((work / f"results/{RUN}/sft/train_summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["attempt"]["resumed_from_step"] == resumed
    assert 0 <= summary["attempt"]["steps_lost"] <= SAVE + IN_FLIGHT
