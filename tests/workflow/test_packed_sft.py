"""Packing on: pack_data packs prepare_data's tokenized rows on the CPU side and sft loads them as
they are (LLaMA-Factory neither tokenizes nor packs again). Real LLaMA-Factory + DeepSpeed, a few steps."""

import json
import re

import pytest
import yaml

from tests.conftest import make_workdir, reuse_verify, rules_run, snakemake

pytestmark = pytest.mark.workflow

RUN = "packed"
TARGET = f"results/{RUN}/sft/train_summary.json"
PACKED = f"results/{RUN}/data/packed.json"  # pack_data's stamp
# The template the demo's builtin model gets (and what `auto` picks for this folder, a Llama
# without a chat template), whose prompt length decides how many rows a pack holds.
SMALL = {
    "run": RUN,
    "model__template": "default",
    "data__synthetic_rows": 800,
    "sft__max_steps": 4,
    "sft__logging_steps": 2,
}


@pytest.fixture(scope="module")
def packed_run(tmp_path_factory):
    """Trains an untied model (the demo's is tied) so that both kinds of head are checked."""
    from llmft.core.assets import build_tiny_model

    root = tmp_path_factory.mktemp("packed")
    build_tiny_model(root / "untied-base", tied=False)
    SMALL["model__name_or_path"] = str(root / "untied-base")
    work = make_workdir(root, sft__packing="neat", **SMALL)
    reuse_verify(work, RUN)  # this machine's verify_env report: nothing here asserts on it
    proc = snakemake(work, TARGET)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return work, proc


def test_sft_loads_the_packed_rows_without_preprocessing_again(packed_run):
    from datasets import load_from_disk

    work, proc = packed_run
    assert "pack_data" in rules_run(proc.stderr + proc.stdout)
    run = work / f"results/{RUN}"
    args = yaml.safe_load((run / "sft/llamafactory.yaml").read_text())
    path = args["tokenized_path"]
    assert path.startswith(f"results/{RUN}/data/packed-") and args["neat_packing"] is True
    sft_log = (run / "logs/sft.log").read_text()
    assert f"Loaded tokenized dataset from {path}" in sft_log
    assert "Running tokenizer on dataset" not in sft_log  # neither tokenized nor packed on the nodes
    stamp = json.loads((work / path / "llmft_packing.json").read_text())
    assert stamp["args"]["neat_packing"] and stamp["args"]["cutoff_len"] == args["cutoff_len"]
    packed = load_from_disk(str(work / path))
    assert stamp["rows"] == {"train": len(packed["train"]), "validation": len(packed["validation"])}
    # The trainer saw pack_data's rows: its example count is the packed train split's.
    seen = re.search(r"Num examples = ([\d,]+)", sft_log)
    assert seen and int(seen.group(1).replace(",", "")) == stamp["rows"]["train"], sft_log[-3000:]
    stats = json.loads((run / "data/stats.json").read_text())
    assert stamp["rows"]["train"] < stats["train_rows"] / 2  # really packed
    # neat packing: the attention mask numbers the samples inside each pack
    assert max(max(m) for m in packed["train"][:50]["attention_mask"]) > 1
    summary = json.loads((run / "sft/train_summary.json").read_text())
    assert summary["steps"] == SMALL["sft__max_steps"]


def test_tuned_untied_model_keeps_its_own_head_and_the_bases_structure(packed_run):
    from llmft.core.modelfiles import HEAD, safetensors_stats, structure_difference, tensor_index

    work, _ = packed_run
    tuned, base = work / f"results/{RUN}/sft/model", work / "untied-base"
    assert HEAD in tensor_index(tuned) and structure_difference(tuned, base) == []
    assert safetensors_stats(tuned) == safetensors_stats(base)


def test_only_what_a_packing_or_training_change_touches_reruns(packed_run):
    work, _ = packed_run
    proc = snakemake(work, "-n", TARGET)
    assert rules_run(proc.stderr + proc.stdout) == []  # nothing changed: nothing reruns
    make_workdir(work, sft__packing="plain", **SMALL)
    proc = snakemake(work, "-n", TARGET)
    ran = rules_run(proc.stderr + proc.stdout)
    assert {"pack_data", "render_sft_config", "sft"} <= set(ran) and "prepare_data" not in ran
    # a new learning rate re-renders the YAML; pack_data runs for it (its stamp the target: the
    # training it leads to is the one the first build ran) and reuses the packed rows; sft is due next
    make_workdir(work, sft__packing="neat", **{**SMALL, "sft__learning_rate": 0.002})
    proc = snakemake(work, PACKED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(rules_run(proc.stderr + proc.stdout)) == {"render_sft_config", "pack_data"}
    stamp = json.loads((work / PACKED).read_text())
    assert stamp["packed"] and stamp["reused"]
    proc = snakemake(work, "-n", TARGET)
    assert rules_run(proc.stderr + proc.stdout) == ["sft"], (proc.stdout + proc.stderr)[-3000:]
    make_workdir(work, sft__packing="off", **SMALL)
    proc = snakemake(work, "-n", TARGET)
    ran = rules_run(proc.stderr + proc.stdout)
    assert {"render_sft_config", "pack_data", "sft"} <= set(ran) and "prepare_data" not in ran
