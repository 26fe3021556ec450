"""The skip gate (tests/skipgate.py) on a generated suite, in a pytest of its own, with two xdist
workers as `make test` runs it and without: under CI or LLMFT_NO_SKIPS=1 a skip or xfail that
tests/allowed_skips.yaml does not list (its test and its reason) fails the run and is named; an
allowed skip, and any skip outside the gate, do not fail it."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.skipgate import load_allowed

ALLOWED_REASON = "this test is about a submit host without a GPU"
SUITE = {
    # the allow-list names this file with ALLOWED_REASON: another reason there is not allowed
    "tests/slurm/test_login_node_plan.py": (
        f"import pytest\n\n\ndef test_gpu_host():\n    pytest.skip({ALLOWED_REASON!r})\n\n\n"
        "def test_scontrol():\n    pytest.skip('scontrol is not installed')\n"
    ),
    "tests/unit/test_module.py": "import pytest\n\npytest.skip('no node', allow_module_level=True)\n",
    "tests/unit/test_other.py": (
        "import pytest\n\n\n@pytest.mark.skipif(True, reason='node not found')\n"
        "def test_tokens():\n    pass\n\n\ndef test_ok():\n    pass\n\n\n"
        "@pytest.mark.xfail(reason='known')\ndef test_known():\n    assert 0\n"
    ),
}


def run(tmp_path, env, workers="0"):
    for name, text in SUITE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "LLMFT_NO_SKIPS")}
    base["PYTHONPATH"] = str(REPO)
    args = [sys.executable, "-m", "pytest", "-p", "tests.skipgate", "-p", "no:cacheprovider", "--rootdir"]
    args += [str(tmp_path), "-q", "-n", workers, "tests"]
    return subprocess.run(args, cwd=tmp_path, env={**base, **env}, capture_output=True, text=True)


@pytest.mark.parametrize("env, workers", [({"CI": "true"}, "0"), ({"LLMFT_NO_SKIPS": "1"}, "2")])
@pytest.mark.reliability(
    fault="a test skips or xfails under CI or make test (two xdist workers) because something it needs "
    "is missing (Node, Chromium, root), or an allowed test skips for another reason than its entry's",
    seen="the run fails at the end, naming each skip and xfail whose test and reason "
    "tests/allowed_skips.yaml does not list, with its reason",
    steps_lost="none",
    data_lost="none",
)
def test_a_skip_or_xfail_not_on_the_list_fails_the_run_and_is_named(tmp_path, env, workers):
    proc = run(tmp_path, env, workers)
    assert proc.returncode == 1, proc.stdout[-3000:]
    out = proc.stdout
    assert "tests/unit/test_other.py::test_tokens: node not found" in out
    assert "tests/unit/test_module.py: no node" in out  # a whole module skipped at collection
    assert "tests/unit/test_other.py::test_known: xfail: known" in out
    assert "tests/slurm/test_login_node_plan.py::test_scontrol: scontrol is not installed" in out
    assert "4 skipped or xfailed test(s) fail this run" in out
    assert "test_login_node_plan.py::test_gpu_host:" not in out  # its test and reason are listed


@pytest.mark.parametrize("env", [{}, {"CI": "false"}])
def test_skips_outside_ci_pass(tmp_path, env):
    proc = run(tmp_path, env)
    assert proc.returncode == 0 and "4 skipped, 1 xfailed" in proc.stdout, proc.stdout[-3000:]


def test_every_allowed_skip_names_its_reason_and_says_why():
    allowed = load_allowed()
    assert any(a["reason"] == ALLOWED_REASON for a in allowed)
    assert all(a["reason"] != "*" and len(a["why"]) > 20 for a in allowed)


@pytest.mark.reliability(
    fault="make test on a machine without Node/npm and no way to install them (not root, no apt-get)",
    seen="tests/setup-tokenizers.sh exits 1 saying node/npm are missing and it cannot install them",
    steps_lost="none",
    data_lost="none",
)
def test_setup_tokenizers_fails_loudly_when_it_cannot_get_node(tmp_path):
    """The compatibility matrix needs the tokenizers this script fetches with npm: without node, npm
    and apt-get on PATH it must fail, not exit 0 and leave 47 tests to skip."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "id", "mkdir", "mktemp", "rm", "cat", "tail", "ls", "tar", "cp", "mv"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    script = REPO / "tests/setup-tokenizers.sh"
    proc = subprocess.run(
        ["/bin/bash", str(script)], env={"PATH": str(bin_dir)}, capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stderr
    assert "node/npm not found, and not root with apt-get to install them" in proc.stderr
