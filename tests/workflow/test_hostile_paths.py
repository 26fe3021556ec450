"""No config value or path reaches a shell unquoted: a model folder and a dataset whose path holds
spaces, quotes, `$(...)`, backticks and a newline go through the real workflow (data preparation,
rendering, packing, evaluation), and nothing in them is ever run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import make_workdir, snakemake
from tests.reliability import reliability

pytestmark = pytest.mark.workflow

HOSTILE = "My Models/m$(touch pwned)`touch pwned2`'q\"\nline two"


@reliability(
    fault="model and data paths holding spaces, quotes, `$(...)`, backticks and a newline",
    seen="the run goes through; nothing in the names is ever run (every path is quoted or passed in a file)",
    steps_lost="none",
    data_lost="none",
)
def test_hostile_model_and_data_paths_are_data_not_code(tmp_path):
    work = tmp_path / "w"
    folder = work / HOSTILE
    folder.mkdir(parents=True)
    make_workdir(work)  # the demo config, for the commands that build the model and the rows
    for cmd in (
        ["base-model", "--out", str(folder / "model")],
        ["synthetic", "--out", str(folder / "rows.jsonl")],
    ):
        proc = subprocess.run([sys.executable, "-m", "llmft", *cmd], cwd=work, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
    make_workdir(
        work,
        run="hostile",
        model__name_or_path=f"{HOSTILE}/model",
        data__sources=[{"path": f"{HOSTILE}/rows.jsonl"}],
        data__synthetic_rows=300,
        eval__max_rows=16,
    )
    targets = ["results/hostile/data/packed.json", "results/hostile/eval/base/metrics.json"]
    proc = snakemake(work, *targets)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not list(tmp_path.rglob("pwned*")) and not list(work.parent.glob("pwned*"))
    assert (work / "results/hostile/eval/base/metrics.json").is_file()
    rendered = (work / "results/hostile/sft/llamafactory.yaml").read_text()
    assert "m$(touch pwned)`touch pwned2`" in rendered  # the path itself reached LLaMA-Factory's YAML
