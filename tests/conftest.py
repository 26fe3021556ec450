"""Shared test helpers: the repo root, and a Snakemake runner in a scratch working directory."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.skipgate import (  # noqa: F401  (hooks: no silent skips under CI / make test)
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Snakemake imports every installed executor plugin before it reads the profile, and the Slurm
# plugin's import asks `scontrol show config`: ~10 s where Slurm's tools are installed but no
# controller answers. An empty SLURM_CONF makes scontrol fail at once; local jobs need no Slurm.
LOCAL_ENV = {"SLURM_CONF": os.devnull}


def snakemake_env(profile: str = "local", env: dict | None = None) -> dict:
    """The environment a test's `snakemake` runs in: the venv first on PATH, and LOCAL_ENV for
    the local profile (`env` last)."""
    full_env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    full_env.update(LOCAL_ENV if profile == "local" else {})
    full_env.update(env or {})
    return full_env


def snakemake(
    workdir: Path, *args: str, timeout: int = 900, profile: str = "local", env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the real `snakemake` on the repo's Snakefile in `workdir`; never raises on failure.

    Past `timeout` seconds it gets SIGINT, which makes it cancel its Slurm jobs (it ignores SIGTERM
    while jobs run); SIGKILL follows 60 s later if it still has not exited (exit code 124 or 137).
    """
    cmd = [
        "timeout",
        "-s",
        "INT",
        "-k",
        "60",
        str(timeout),
        str(BIN / "snakemake"),
        "-s",
        str(REPO / "Snakefile"),
        "-d",
        str(workdir),
        "--profile",
        str(REPO / "profiles" / profile),
        *args,
    ]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout + 90,
        env=snakemake_env(profile, env),
        cwd=workdir,
    )


# verify_env's numerics canary trains a small model for ~7 s in every pipeline that runs it. Test
# pipelines skip it unless they ask for it (verify__canary=True): the tests that assert it
# (test_pipeline's demo, the Slurm upstream stages on both nodes, test_verify_env) do.
TEST_DEFAULTS = {"verify__canary": False}


def make_workdir(path: Path, **overrides) -> Path:
    """A scratch working directory with config/config.yaml = the repo's, deep-updated by
    TEST_DEFAULTS, then by `overrides`."""
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for dotted, value in {**TEST_DEFAULTS, **overrides}.items():
        node = cfg
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    (path / "config").mkdir(parents=True, exist_ok=True)
    (path / "config" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


_SESSION: dict = {}


@pytest.fixture(scope="session", autouse=True)
def _session_dir(tmp_path_factory):
    """A folder every xdist worker of this pytest session shares (the session's own folder when serial)."""
    base = tmp_path_factory.getbasetemp()
    _SESSION["dir"] = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@dataclass(frozen=True)
class SharedRun:
    """A pipeline built once per session (`shared_run`) in a folder of its own. Never run anything
    in `work`: take a copy (`copy_to`)."""

    work: Path
    overrides: dict  # make_workdir's overrides it was built with
    log: str  # Snakemake's output of the build

    def copy_to(self, dest: Path, **extra) -> Path:
        """A workdir at `dest` with this build's results and Snakemake's records of them (paths in
        them are relative to the workdir, modification times kept), configured as the build, deep-
        updated by `extra`. A key a stage reads reruns that stage and what follows it."""
        copy_results(self.work, dest)
        return make_workdir(dest, **{**self.overrides, **extra})


def copy_results(src: Path, dest: Path) -> None:
    """`src`'s results and Snakemake's records of them into workdir `dest`, so the copied outputs are
    current there: the records hold paths relative to the workdir, and modification times are kept."""
    shutil.copytree(src / "results", dest / "results", symlinks=True)
    shutil.copytree(src / ".snakemake" / "metadata", dest / ".snakemake" / "metadata")


def shared_run(name: str, timeout: int = 1800, **overrides) -> SharedRun:
    """The whole pipeline of make_workdir(**overrides), built once per session by the first test
    asking, on either xdist worker (the other waits on the lock), under the session's shared folder
    in a folder named by `name` and a hash of the overrides: every test of the same config shares
    one build. A failed build is tried again by the next test asking."""
    from filelock import FileLock

    digest = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:12]
    root = _SESSION["dir"] / "shared"
    root.mkdir(parents=True, exist_ok=True)
    work, log = root / f"{name}-{digest}", root / f"{name}-{digest}.log"
    with FileLock(str(root / f"{name}-{digest}.lock")):
        if not log.is_file():
            shutil.rmtree(work, ignore_errors=True)
            proc = snakemake(make_workdir(work, **overrides), timeout=timeout)
            assert proc.returncode == 0, proc.stderr[-4000:]
            log.write_text(proc.stdout + proc.stderr)
    return SharedRun(work, overrides, log.read_text())


# The embedded default as is, with verify_env's numerics canary (the suite's other pipelines skip
# it): test_pipeline's demo. The tests that start from the embedded default's model, data or
# training (test_benchmarks, test_lora_freeze, test_sft_launcher, test_faults, test_hostile_paths,
# test_preference's sft model) take a copy of `shared_run("demo", **DEMO)` instead of building their own.
DEMO = {"verify__canary": True}


def verify_config_json(work: Path, run: str) -> str:
    """The --config-json the workflow's verify_env job would get for run `run` in `work`: its config
    slice, from the command `snakemake -n -p` prints (the rule's own params, not a copy of them)."""
    target = f"results/{run}/env/verify.json"
    proc = snakemake(work, "-n", "-p", target, "--config", f"run={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = shlex.split(shell_commands(proc, "verify_env")[0])
    return words[words.index("--config-json") + 1]


def shell_commands(proc, rule: str) -> list[str]:
    """The llmft commands `snakemake -n -p` prints for one rule's jobs."""
    out, lines = [], (proc.stdout + proc.stderr).splitlines()
    for i, line in enumerate(lines):
        if line.strip() == f"rule {rule}:" or line.strip() == f"localrule {rule}:":
            cmd = next((x for x in lines[i + 1 :] if "python -m llmft" in x), "")
            out.append(cmd.strip().removeprefix("Shell command: "))
    return out


def reuse_verify(work: Path, run: str = "demo") -> None:
    """Give run `run` in `work` this machine's verify_env report, so its pipeline does not run
    verify_env again: for pipelines whose tests assert nothing of verify_env (test_pipeline's demo,
    test_verify_env, the hostile-path run and the Slurm tests run it for real). The report is made by
    the real `python -m llmft verify-env`, once per session and config slice, shared by the workers."""
    from filelock import FileLock

    cut = verify_config_json(work, run)
    key = json.dumps({**json.loads(cut), "run": "-"}, sort_keys=True)
    shared = _SESSION["dir"] / "verify" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    shared.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(shared) + ".lock"):
        if not shared.is_file():
            tmp = shared.with_suffix(".partial.json")
            cmd = [str(BIN / "python"), "-m", "llmft", "verify-env", "--config-json", cut]
            proc = subprocess.run([*cmd, "--out", str(tmp)], capture_output=True, text=True,
                                  env=snakemake_env(), cwd=work, timeout=900)  # fmt: skip
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            tmp.replace(shared)
    place_verify(shared, work, run)


def place_verify(report: Path, work: Path, run: str) -> None:
    """Run `run` in `work` takes verify_env report `report` (this machine's, or the same nodes'), so
    its pipeline does not run verify_env again."""
    out = work / "results" / run / "env" / "verify.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(report, out)


def rules_run(log: str) -> list[str]:
    """The rules Snakemake executed, from its own log lines."""
    out = []
    for line in log.splitlines():
        line = line.strip()
        if line.startswith(("rule ", "localrule ")) and line.endswith(":"):
            out.append(line.split()[1].rstrip(":"))
    return out


# `make test` runs the suite on two pytest-xdist workers. Each module is one unit of work, so its
# module-scoped fixtures (a trained demo, a tokenized dataset) are built once; all of tests/slurm is
# one unit, so the test cluster's two nodes serve one test at a time. The longest units go first:
# the cluster's, then the workflow runs; the unit tests fill the tail.
_ORDER = {"slurm": 0, "workflow": 1}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: _ORDER.get(Path(item.path).parent.name, 2))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "tests/slurm" if module.startswith("tests/slurm/") else module

    return ByModule(config, log)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture
def scratch(tmp_path) -> Path:
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def tiny_config(folder: Path, **extra) -> str:
    """A folder holding only config.json of the demo's builtin tiny model: all the planner reads."""
    t = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["model"]["tiny"]
    shape = {
        "model_type": "llama",
        "hidden_size": t["hidden_size"],
        "num_hidden_layers": t["num_layers"],
        "num_attention_heads": t["num_heads"],
        "intermediate_size": 4 * t["hidden_size"],
        "vocab_size": t["vocab_size"],
        **extra,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape))
    return str(folder)


# Real tokenizers, fetched by tests/setup-tokenizers.sh (run by `make test`) into a git-ignored
# folder: one folder per family, each loadable with transformers' AutoTokenizer.from_pretrained.
TOKENIZER_CACHE = REPO / ".cache" / "tokenizers"
TOKENIZER_FAMILIES = ("llama3", "qwen3", "qwen2_5", "gemma3", "deepseek_v3", "llama2")


def real_tokenizer_path(family: str) -> Path | None:
    """The folder of `family`'s real tokenizer, or None when tests/setup-tokenizers.sh has not
    fetched it."""
    folder = TOKENIZER_CACHE / family
    if (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    return None


def real_tokenizer(family: str) -> Path:
    """The folder of `family`'s real tokenizer; skips the calling test, saying why, when absent."""
    folder = real_tokenizer_path(family)
    if folder is None:
        pytest.skip(f"real {family} tokenizer not in {TOKENIZER_CACHE} (run bash tests/setup-tokenizers.sh)")
    return folder
