"""LoRA and freeze through the whole DAG on the local executor: the embedded default (builtin:tiny,
ZeRO-3 on 2 CPU processes) with sft.finetuning_type lora, then freeze in the same working directory
(only render, pack, sft, the tuned evaluation and the report rerun). Real LLaMA-Factory training.
Both start from a copy of the session's demo run: its environment check, model, data and base
evaluation are the same jobs as theirs.

LoRA on the random-init tiny model learns far less than full training (its frozen random embeddings
and final norm bound the logits), so the run uses a high rank and rate for a few epochs; the test
asks the tuned model to beat the base on held-out exact match, not to match full training.
"""

import json

import pytest
import torch
import yaml

from tests.conftest import DEMO, make_workdir, rules_run, shared_run, snakemake

pytestmark = pytest.mark.workflow

LORA = {
    "sft__finetuning_type": "lora",
    "sft__lora_rank": 64,
    "sft__learning_rate": 3.0e-3,
    "sft__num_train_epochs": 3.0,
}
FREEZE = {"sft__finetuning_type": "freeze", "sft__learning_rate": 1.0e-3, "sft__num_train_epochs": 2.0}
# fp32 on CPU: x W' with W' = W + s B A merged, against x W + s (x A^T) B^T, differ by rounding only.
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    work = shared_run("demo", **DEMO).copy_to(tmp_path_factory.mktemp("lora"), **LORA)
    proc = snakemake(work)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return work


@pytest.fixture(scope="module")
def freeze(lora):
    """The same working directory switched to freeze; the LoRA results are read first (test order)."""
    make_workdir(lora, **DEMO, **FREEZE)
    proc = snakemake(lora)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return lora, proc


def metrics(run, which):
    return json.loads((run / f"eval/{which}/metrics.json").read_text())


def heldout(run, n=24):
    """The first n held-out rows as evaluate encodes them: (prompt ids, answer ids) each."""
    from llmft.evaluate.run import encode

    rows = [json.loads(x) for x in (run / "data/heldout.jsonl").read_text().splitlines()[:n]]
    return encode(rows, str(run / "sft/model"), "default")


def padded(seqs, pad_id, left=False):
    width = max(len(s) for s in seqs)
    ids = [([pad_id] * (width - len(s)) + s) if left else (s + [pad_id] * (width - len(s))) for s in seqs]
    mask = [
        ([0] * (width - len(s)) + [1] * len(s)) if left else ([1] * len(s) + [0] * (width - len(s)))
        for s in seqs
    ]
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


def test_lora_publishes_the_adapter_and_a_plain_merged_model(lora):
    from transformers import AutoModelForCausalLM

    run = lora / "results/demo"
    adapter = json.loads((run / "sft/adapter/adapter_config.json").read_text())
    assert adapter["r"] == 64 and adapter["lora_alpha"] == 128
    assert set(adapter["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert (run / "sft/adapter/adapter_model.safetensors").is_file()
    model_dir = run / "sft/model"
    assert not (model_dir / "adapter_config.json").exists() and not list(run.glob("sft/.model.*"))
    base = AutoModelForCausalLM.from_pretrained(run / "base_model")
    merged = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(merged) is type(base) and merged.dtype == base.dtype == torch.float32
    assert sum(p.numel() for p in merged.parameters()) == sum(p.numel() for p in base.parameters())
    assert [n for n, _ in merged.named_parameters()] == [n for n, _ in base.named_parameters()]
    assert merged.config.tie_word_embeddings and merged.lm_head.weight is merged.model.embed_tokens.weight
    # the adapter changed the adapted layers only: embeddings and norms are the base's
    assert torch.equal(merged.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert torch.equal(merged.model.norm.weight, base.model.norm.weight)
    assert not torch.equal(
        merged.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight
    )


def test_merged_model_gives_base_plus_adapter_logits_and_outputs(lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = lora / "results/demo"
    tok, rows = heldout(run)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(run / "base_model"), run / "sft/adapter"
    )
    merged = AutoModelForCausalLM.from_pretrained(run / "sft/model")
    batch = padded([p + a for p, a in rows], pad)
    with torch.no_grad():
        a = peft(**batch).logits
        b = merged(**batch).logits
    mask = batch["attention_mask"].bool()
    diff = (a - b).abs()[mask].max().item()
    assert diff < LOGIT_TOLERANCE, diff
    assert torch.equal(a.argmax(-1)[mask], b.argmax(-1)[mask])
    # greedy answers to the held-out prompts: the same tokens from base + adapter as from the merged model
    prompts = padded([p for p, _ in rows[:8]], pad, left=True)
    gen = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": pad}
    with torch.no_grad():
        assert torch.equal(peft.generate(**prompts, **gen), merged.generate(**prompts, **gen))


def test_lora_tuned_beats_base_and_the_summary_says_what_trained(lora):
    from llmft.core.shape import model_shape
    from llmft.sft.plan import trainable_params

    run = lora / "results/demo"
    base, tuned = metrics(run, "base"), metrics(run, "tuned")
    assert tuned["rows"] == base["rows"] > 100
    assert tuned["exact_match"] - base["exact_match"] >= 0.1, (base["exact_match"], tuned["exact_match"])
    assert tuned["eval_loss"] < base["eval_loss"]
    summary = json.loads((run / "sft/train_summary.json").read_text())
    shape = model_shape(run / "base_model")
    assert summary["finetuning_type"] == "lora"
    # counted on the model LLaMA-Factory trained (ZeRO-3 partitions counted whole) = the planner's count
    assert summary["trainable_params"] == trainable_params(shape, "lora", lora_rank=64) > 0
    assert summary["adapter"]["lora_rank"] == 64 and summary["adapter"]["lora_alpha"] == 128
    assert summary["adapter"]["lora_dropout"] == 0.0 and summary["adapter"]["lora_target"] == "all"
    assert len(summary["adapter"]["target_modules"]) == 7 and summary["adapter"]["quantization_bit"] is None
    assert summary["model_bytes"] == (run / "sft/model/model.safetensors").stat().st_size
    assert (
        summary["adapter"]["adapter_bytes"] == (run / "sft/adapter/adapter_model.safetensors").stat().st_size
    )
    assert summary["model_files"]["checked"]  # the merged folder has the base's structure
    page = (run / "report/index.html").read_text()
    assert "LoRA adapter" in page and "rank 64, alpha 128" in page and "merged model size (MB)" in page
    # the page counts LoRA's FLOPs as they run (4 M + attention + 6 x adapter: no weight gradients for
    # frozen weights; at rank 64 the tiny model's adapters outweigh it)
    from llmft.core import flops

    report = json.loads((run / "report/summary.json").read_text())
    lora_count = flops.per_token(
        shape, report["attention_span_tokens"], flops.Tuning("lora", adapter=summary["trainable_params"])
    )
    assert report["flops_per_token"] == pytest.approx(lora_count.total, rel=1e-6)


def test_freeze_reruns_only_training_and_publishes_a_full_model(freeze):
    from llmft.core.shape import model_shape
    from transformers import AutoModelForCausalLM

    work, proc = freeze
    run = work / "results/demo"
    ran = rules_run(proc.stderr + proc.stdout)
    # the lineage too: its tokens are counted under the plan, which the finetuning type changes
    assert set(ran) == {"lineage", "render_sft_config", "pack_data", "sft", "evaluate", "report", "all"}
    assert ran.count("evaluate") == 1
    rendered = yaml.safe_load((run / "sft/llamafactory.yaml").read_text())
    assert rendered["finetuning_type"] == "freeze" and rendered["freeze_trainable_layers"] == 2
    assert "lora_rank" not in rendered
    assert not (run / "sft/adapter").exists()  # the LoRA config's adapter is not this model's
    base = AutoModelForCausalLM.from_pretrained(run / "base_model")
    tuned = AutoModelForCausalLM.from_pretrained(run / "sft/model")
    assert sum(p.numel() for p in tuned.parameters()) == sum(p.numel() for p in base.parameters())
    # the decoder layers trained, the embeddings and final norm stayed frozen
    assert torch.equal(tuned.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert torch.equal(tuned.model.norm.weight, base.model.norm.weight)
    assert not torch.equal(tuned.model.layers[1].mlp.up_proj.weight, base.model.layers[1].mlp.up_proj.weight)
    summary = json.loads((run / "sft/train_summary.json").read_text())
    shape = model_shape(run / "base_model")
    assert summary["finetuning_type"] == "freeze" and summary["freeze_trainable_layers"] == 2
    assert summary["trainable_params"] == 2 * shape.layer_params and summary["adapter"] is None
    base_m, tuned_m = metrics(run, "base"), metrics(run, "tuned")
    assert tuned_m["exact_match"] - base_m["exact_match"] >= 0.1, (
        base_m["exact_match"],
        tuned_m["exact_match"],
    )
    assert tuned_m["eval_loss"] < base_m["eval_loss"]
