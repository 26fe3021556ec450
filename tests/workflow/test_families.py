"""The whole pipeline on CPU for three model families with their real tokenizers: Llama-3 on the
demo's alpaca tasks, Gemma-3 (its text model) on the same tasks as multi-turn sharegpt rows, and
Qwen3 on tool-calling rows (function calls, tool results, a `tools` column).

Each model is random-init, shaped like its family (tests/families.py) around the family's real
tokenizer (fetched by tests/setup-tokenizers.sh); `model.template` is left at `auto`, so the
template comes from the model folder. Training is short (the embedding tables of real vocabularies,
128 k to 262 k rows, make every CPU step cost), so "tuned beats base" is asked of the held-out loss,
which a few dozen steps move a long way; exact match needs far longer runs.
"""

import json

import pytest

from tests.conftest import make_workdir, real_tokenizer, reuse_verify, rules_run, snakemake
from tests.families import build_family_model

pytestmark = pytest.mark.workflow

# The model is the user's folder, so no base_model job; evaluate runs twice (base and tuned).
# verify_env reads no model key, so these runs take this machine's report (tests/conftest.py
# reuse_verify); test_pipeline's demo runs it.
STAGES = {"prepare_data", "pack_data", "render_sft_config", "sft", "evaluate", "report"}
# Short training that still moves the held-out loss far: a high rate, a few dozen steps.
TRAIN = {
    "sft__max_steps": 20,
    "sft__learning_rate": 5.0e-3,
    "sft__per_device_train_batch_size": 4,
    "sft__save_steps": 1000,
    "eval__max_rows": 12,  # the held-out loss is what is asked: a dozen rows show 20 steps' drop
}


def _alpaca(tmp_path):
    return {"data__synthetic_rows": 300}


def _multiturn(tmp_path):
    """The demo tasks as sharegpt conversations of two questions each."""
    from llmft.core.assets import synthetic_rows

    rows = synthetic_rows(400, seed=1)
    out = tmp_path / "multiturn.jsonl"
    with out.open("w") as fh:
        for a, b in zip(rows[::2], rows[1::2], strict=True):
            turns = []
            for row in (a, b):
                prompt = "\n".join(t for t in (row["instruction"], row["input"]) if t)
                turns += [{"from": "human", "value": prompt}, {"from": "gpt", "value": row["output"]}]
            fh.write(json.dumps({"conversations": turns}) + "\n")
    # Gemma-3's 262 k-entry vocabulary makes scoring a row most of a step's cost: two rows a step per
    # process, not four (the held-out loss still drops to about two thirds of the base's).
    return {
        "sft__per_device_train_batch_size": 2,
        "data__sources": [{"path": str(out), "format": "sharegpt", "weight": 1.0}],
    }


def _tools(tmp_path):
    from llmft.core.assets import synthetic_tool_rows

    out = tmp_path / "tools.jsonl"
    with out.open("w") as fh:
        for row in synthetic_tool_rows(300):
            fh.write(json.dumps(row) + "\n")
    # The tool prompt (the tools' JSON schema in the system turn) makes rows a few hundred tokens,
    # each scored over Qwen3's 151 k-entry vocabulary: two rows a step per process, not four.
    return {
        "sft__per_device_train_batch_size": 2,
        "data__sources": [{"path": str(out), "format": "sharegpt", "weight": 1.0}],
        "data__cutoff_len": 512,
        "eval__max_new_tokens": 40,
    }


FAMILIES = {"llama3": _alpaca, "gemma3": _multiturn, "qwen3": _tools}
# What `auto` picks: Gemma-3's text model (no processor) takes LLaMA-Factory's text-only gemma2.
PICKED = {"llama3": "llama3", "gemma3": "gemma2", "qwen3": "qwen3"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def run(request, tmp_path_factory):
    family = request.param
    tokenizer = real_tokenizer(family)
    tmp = tmp_path_factory.mktemp(family)
    model = tmp / "model"
    build_family_model(family, tokenizer, model)
    work = make_workdir(tmp / "work", model__name_or_path=str(model), **{**TRAIN, **FAMILIES[family](tmp)})
    reuse_verify(work)
    proc = snakemake(work, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return family, work / "results" / "demo", proc


def metrics(results, which):
    return json.loads((results / f"eval/{which}/metrics.json").read_text())


def test_every_stage_ran_and_tuned_beats_base(run):
    family, results, proc = run
    ran = rules_run(proc.stderr)
    assert STAGES <= set(ran) and ran.count("evaluate") == 2, ran
    base, tuned = metrics(results, "base"), metrics(results, "tuned")
    assert base["rows"] == tuned["rows"] > 0
    # A random-init model starts near log(vocabulary) (11.8 to 12.5 nats); 20 steps take it far below.
    assert tuned["eval_loss"] < 0.75 * base["eval_loss"], (family, base["eval_loss"], tuned["eval_loss"])


def test_the_template_came_from_the_model_folder(run):
    """`auto` picked the family's LLaMA-Factory template when the DAG was built, and said why."""
    family, results, proc = run
    expected = PICKED[family]
    assert f"model.template auto -> {expected} (" in proc.stderr
    stats = json.loads((results / "data" / "stats.json").read_text())
    assert stats["template"] == expected and stats["tokenizer_check"]["matches"]
