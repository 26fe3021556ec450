"""No config value or path reaches a shell unquoted: a model folder and a dataset whose path holds
spaces, quotes, `$(...)`, backticks and a newline go through the real workflow, one run through every
rule the paths reach (verify_env, data preparation, rendering, packing, sft's torchrun launch, both
evaluations, the report), and nothing in them is ever run."""

from __future__ import annotations

import html
import json
import subprocess
import sys

import pytest

from tests.conftest import make_workdir, rules_run, snakemake

pytestmark = pytest.mark.workflow

HOSTILE = "My Models/m$(touch pwned)`touch pwned2`'q\"\nline two"


@pytest.mark.reliability(
    fault="model and data paths holding spaces, quotes, `$(...)`, backticks and a newline",
    seen=(
        "the whole run goes through, every stage to the report; nothing in the names is ever run "
        "(every path is quoted or passed in a file)"
    ),
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
        sft__max_steps=4,
        sft__logging_steps=2,
    )
    proc = snakemake(work)  # the default target: every stage, the report last
    assert proc.returncode == 0, proc.stderr[-4000:]
    ran = rules_run(proc.stderr + proc.stdout)
    stages = {"verify_env", "prepare_data", "render_sft_config", "pack_data", "sft", "evaluate", "report"}
    assert stages <= set(ran) and ran.count("evaluate") == 2, ran
    assert not list(tmp_path.rglob("pwned*")) and not list(work.parent.glob("pwned*"))
    run = work / "results/hostile"
    rendered = (run / "sft/llamafactory.yaml").read_text()
    assert "m$(touch pwned)`touch pwned2`" in rendered  # the path itself reached LLaMA-Factory's YAML
    first_line = HOSTILE.split("\n")[0]
    # LLaMA-Factory, under sft's torchrun, loaded the weights from that folder
    assert f"loading weights file {first_line}" in (run / "logs/sft.log").read_text()
    tuned = json.loads((run / "eval/tuned/metrics.json").read_text())
    assert tuned["rows"] == json.loads((run / "eval/base/metrics.json").read_text())["rows"] > 0
    assert html.escape(first_line) in (run / "report/index.html").read_text()  # shown, as text
