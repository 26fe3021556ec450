"""Config and profile values that reach a shell line, and configs too big to pass to a job, are refused
before Snakemake builds any job: the message names the key or profile resource, the
payload a value carries never runs, and an alias bomb is refused in bounded time.
"""

from __future__ import annotations

import os
import time

import pytest
import yaml

from tests.conftest import REPO, make_workdir, snakemake

# Creates PAYLOAD in the working directory if a shell ever runs it.
PAYLOAD = "PWNED"
STUB = '#!/bin/sh\n[ "$1" = "--version" ] && echo "apptainer version 1.3.4" && exit 0\nexit 99\n'


def refused(res, needle: str) -> str:
    log = res.stdout + res.stderr
    assert res.returncode != 0, log[-3000:]
    assert needle in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    return log


@pytest.mark.reliability(
    fault="`container.image` carrying a shell command (`img.sif;touch${IFS}PWNED`) under `--sdm apptainer`",
    seen="refused before any job, naming the key and what an image may be; the command never runs",
    steps_lost="none",
    data_lost="none",
)
def test_an_image_carrying_a_command_is_refused_before_apptainer_runs(tmp_path):
    """A real run, not -n: Snakemake would put the image unquoted into `apptainer exec <image> bash -c`
    (the stub apptainer fails, `touch PWNED bash -c ...` would then run)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text(STUB)
    (bin_dir / "apptainer").chmod(0o755)
    work = make_workdir(tmp_path / "w", container__image=f"img.sif;touch${{IFS}}{PAYLOAD}")
    res = snakemake(
        work, "--sdm", "apptainer", timeout=300,
        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
    )  # fmt: skip
    refused(res, "llmft config error: config key container.image: ")
    assert "docker://" in res.stderr  # what an image may be
    assert not (work / PAYLOAD).exists()


def slurm_profile_copy(tmp_path, rule: str, **resources) -> str:
    prof = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())
    prof["set-resources"][rule].update(resources)
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile/config.yaml").write_text(yaml.safe_dump(prof))
    return str(tmp_path / "profile")


HOSTILE_RESOURCES = [
    ("sft", "mpi", f"srun; touch {PAYLOAD} #"),
    ("verify_env", "mpi", f"$(touch {PAYLOAD})"),
    ("sft", "cpus_per_task", f"96 $(touch {PAYLOAD})"),
]


@pytest.mark.parametrize(
    "rule,name,value", HOSTILE_RESOURCES, ids=[f"{r}.{n}" for r, n, _ in HOSTILE_RESOURCES]
)
@pytest.mark.reliability(
    fault="a Slurm profile's `mpi` or `cpus_per_task` carrying a shell command, with `hardware.nodes: 2`",
    seen="refused under `-n`, naming the profile resource and what it may be",
    steps_lost="none",
    data_lost="none",
)
def test_a_launcher_resource_carrying_a_command_is_refused(tmp_path, rule, name, value):
    work = make_workdir(tmp_path / "w", hardware__nodes=2, hardware__gpus_per_node=8, hardware__vendor="rocm")
    res = snakemake(
        work, "-n", "-p", profile=slurm_profile_copy(tmp_path, rule, **{name: value}), timeout=240
    )
    log = refused(res, f"llmft config error: the profile's resource {rule}.{name}: ")
    assert ("(e.g. srun)" if name == "mpi" else "a whole number of CPUs") in log
    assert not (work / PAYLOAD).exists()


def bomb(kind: str, levels: int = 9) -> str:
    """sft.extra.run_name as a YAML alias bomb: 9 ** levels values once every alias is written out,
    each level nine aliases of the one before."""
    if kind == "list":
        items = ["&a0 [x, x, x, x, x, x, x, x, x]"]
        items += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
        body = "".join(f"      - {item}\n" for item in items)
    else:
        items = ["a0: &a0 {" + ", ".join(f"k{j}: x" for j in range(9)) + "}"]
        items += [
            f"a{i}: &a{i} {{{', '.join(f'k{j}: *a{i - 1}' for j in range(9))}}}" for i in range(1, levels)
        ]
        body = "".join(f"      {item}\n" for item in items)
    return f"sft:\n  extra:\n    run_name:\n{body}"


# A mapping bomb in a --configfile is not among them: Snakemake copies that file's mappings before
# the Snakefile runs (config/README.md).
BOMBS = [("list", "config/config.yaml"), ("dict", "config/config.yaml"), ("list", "--configfile")]


@pytest.mark.parametrize("kind,where", BOMBS, ids=[f"{k}-{w}" for k, w in BOMBS])
@pytest.mark.reliability(
    fault=(
        "a YAML alias bomb (9 ** 9 values) under `sft.extra.run_name`: of lists or mappings in "
        "config/config.yaml, of lists in a `--configfile`"
    ),
    seen="refused within 60 s, naming the file and the key",
    steps_lost="none",
    data_lost="none",
)
def test_an_alias_bomb_is_refused_in_bounded_time_naming_file_and_key(tmp_path, kind, where):
    work = make_workdir(tmp_path / "w")
    if where == "--configfile":
        (work / "extra.yaml").write_text(bomb(kind))
        args, named = ("--configfile", str(work / "extra.yaml")), "extra.yaml"
    else:
        cfg = yaml.safe_load((work / "config/config.yaml").read_text())
        del cfg["sft"]
        (work / "config/config.yaml").write_text(yaml.safe_dump(cfg) + bomb(kind))
        args, named = (), "config/config.yaml"
    start = time.monotonic()
    res = snakemake(work, "-n", *args, timeout=120)
    assert time.monotonic() - start < 60
    log = refused(res, "config key sft.extra.run_name expands to more than 20000 values")
    assert named in log


@pytest.mark.reliability(
    fault="a 200 000-character config string (`sft.extra.run_name`), past the kernel's 128 KiB argument cap",
    seen="refused before any job, naming the key and the limit (not `Argument list too long` in a job)",
    steps_lost="none",
    data_lost="none",
)
def test_a_config_string_too_long_for_a_command_line_is_refused(tmp_path):
    work = make_workdir(tmp_path / "w", sft__extra={"run_name": "x" * 200_000})
    res = snakemake(work, "-n", timeout=120)
    refused(
        res, "llmft config error: config key sft.extra.run_name: a text of 200000 characters; at most 8192"
    )


RUNS = [
    ("-rf", "not starting with '.' or '-'"),
    ("--help", "not starting with '.' or '-'"),
    ("r" * 256, "at most 128"),
]


@pytest.mark.parametrize("run,why", RUNS, ids=["-rf", "--help", "256 characters"])
@pytest.mark.reliability(
    fault="run names `-rf`, `--help`, 256 characters, given with `--config run=...`",
    seen="refused before any job, naming `run` and what a run name may be (no Snakemake traceback)",
    steps_lost="none",
    data_lost="none",
)
def test_a_run_name_that_is_an_option_or_too_long_is_refused(tmp_path, run, why):
    work = make_workdir(tmp_path / "w")
    res = snakemake(work, "-n", "--config", f"run={run}", timeout=120)
    assert why in refused(res, "llmft config error: config key run: ")
