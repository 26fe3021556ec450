"""A Slurm profile and a config that disagree on GPUs are refused before anything is submitted."""

from __future__ import annotations

import os

import pytest

from tests.conftest import BIN, make_workdir, rules_run, snakemake


def dry_run(tmp_path, *args, **overrides):
    work = make_workdir(tmp_path, **overrides)
    res = snakemake(work, "-n", "-p", *args, profile="slurm", timeout=240)
    return res.returncode, res.stdout + res.stderr


@pytest.mark.reliability(
    fault="a Slurm profile that asks for GPUs for a CPU config, none for a GPU one, or another count",
    seen="refused before any job (under `-n` too), naming both numbers and the key to change",
    steps_lost="none",
    data_lost="none",
)
def test_the_production_profile_refuses_the_cpu_demo_config(tmp_path):
    rc, log = dry_run(tmp_path / "cpu")
    assert rc != 0
    assert "llmft config error: the profile requests 8 GPU(s) per node for verify_env" in log, log[-2000:]
    assert "Traceback" not in log and "sbatch" not in log


def test_a_gpu_count_other_than_the_profiles_is_refused_and_equal_ones_plan(tmp_path):
    rc, log = dry_run(tmp_path / "four", hardware__gpus_per_node=4, hardware__vendor="rocm")
    assert rc != 0 and "requests 8 GPU(s) per node" in log and "hardware.gpus_per_node is 4" in log
    # the profile's gres replaced on the command line by one without GPUs: the reverse mismatch
    rc, log = dry_run(
        tmp_path / "nogres",
        "--set-resources", "verify_env:slurm_partition=mi300x", "sft:slurm_partition=mi300x",
        "evaluate:slurm_partition=mi300x",
        hardware__gpus_per_node=8, hardware__vendor="rocm",
    )  # fmt: skip
    assert rc != 0 and "requests no GPUs for verify_env" in log, log[-2000:]
    rc, log = dry_run(tmp_path / "eight", hardware__gpus_per_node=8, hardware__vendor="rocm")
    assert rc == 0, log[-3000:]
    assert {"verify_env", "sft", "evaluate"} <= set(rules_run(log))


def test_the_local_profile_does_not_wait_on_an_unanswering_slurm_controller(tmp_path, monkeypatch):
    """Snakemake imports the Slurm plugin even for the local profile; its import asks `scontrol show
    config`, which waits ~10 s where Slurm's tools are installed but no controller answers."""
    fake, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    fake.mkdir()
    for tool in ("sinfo", "sacct", "squeue"):
        (fake / tool).write_text("#!/bin/sh\nexit 0\n")
    # As the real scontrol (checked with Slurm 22.05): an empty SLURM_CONF is refused at once; with a
    # slurm.conf whose controller is down it keeps trying to connect.
    (fake / "scontrol").write_text(
        f'#!/bin/sh\necho "$*: SLURM_CONF=$SLURM_CONF" >> {calls}\n'
        '[ "$SLURM_CONF" = /dev/null ] && exit 1\n'
        f"echo waited >> {calls}; sleep 30\n"
    )
    for tool in fake.iterdir():
        tool.chmod(0o755)
    work = make_workdir(tmp_path / "work")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")  # the shell's, as on a login node
    res = snakemake(work, "-n", env={"PATH": f"{fake}:{BIN}:{os.environ['PATH']}"})
    assert res.returncode == 0, res.stderr[-2000:]
    log = calls.read_text()
    assert "show config: SLURM_CONF=/dev/null" in log and "waited" not in log, log
