"""llmft.core.imports: packages a stage's libraries would import for nothing look not installed
inside the stage, and only there."""

import importlib.util
import json
import subprocess
import sys

import pytest
from llmft.core.imports import hidden

from tests.conftest import BIN, make_workdir


def test_a_hidden_package_looks_not_installed_inside_the_block_only():
    name = "json.tool"  # importable, and not imported by this test process yet
    assert name not in sys.modules and importlib.util.find_spec(name) is not None
    with hidden(name):
        assert importlib.util.find_spec(name) is None
        with pytest.raises(ImportError):
            importlib.import_module(name)
    assert name not in sys.modules
    assert importlib.import_module(name).__name__ == name


def test_a_package_already_imported_is_left_alone():
    with hidden("json"):
        assert sys.modules["json"] is json and importlib.util.find_spec("json") is not None


# Run as the stage runs (`python -m llmft base-model`), then list which of the hidden packages the
# process holds: none, though transformers imports each of them when it can.
PROBE = """
import sys
from llmft.__main__ import main
assert main(sys.argv[1:]) == 0
print(sorted(n for n in ("sklearn", "scipy", "torchao", "deepspeed") if sys.modules.get(n) is not None))
"""


def test_the_base_model_stage_loads_none_of_the_packages_it_hides(tmp_path):
    work = make_workdir(tmp_path)
    cmd = [str(BIN / "python"), "-c", PROBE, "base-model", "--out", str(tmp_path / "model")]
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1].replace("'", '"')) == []
    assert (tmp_path / "model" / "config.json").is_file()
