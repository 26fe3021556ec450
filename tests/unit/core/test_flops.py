"""The one training-FLOP count (llmft.core.flops), against numbers that can be worked out by hand."""

import pytest
from llmft.core import flops
from llmft.core.shape import shape_from_config

LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
LLAMA32_1B = {
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
}


def test_matrix_weights_count_the_head_once_and_not_the_embedding_lookup():
    big, small = shape_from_config(LLAMA3_8B), shape_from_config(LLAMA32_1B)
    layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
    assert flops.matmul_params(big) == 32 * layer + 128256 * 4096  # 7.50 B
    # untied: M is the parameter count less the embedding table (and the norms)
    assert big.params - flops.matmul_params(big) == 128256 * 4096 + (2 * 32 + 1) * 4096
    # tied: the one table is the head, counted once
    assert small.params - flops.matmul_params(small) == (2 * 16 + 1) * 2048


def test_full_training_is_6m_plus_causal_attention():
    shape = shape_from_config(LLAMA3_8B)
    count = flops.per_token(shape, 2048)
    m = flops.matmul_params(shape)
    # causal: a token at position t attends t keys, the mean is S/2: 6 * layers * heads * head_dim * S
    assert count.total == pytest.approx(6 * m + 6 * 32 * 32 * 128 * 2048)
    assert count.attention == pytest.approx(6 * 32 * 32 * 128 * 2048)
    assert count.forward == pytest.approx(count.total / 3)


def test_lora_has_no_weight_gradients_for_frozen_weights():
    shape = shape_from_config(LLAMA3_8B)
    # LLaMA-Factory prints 20,971,520 trainable parameters for Llama-3-8B at rank 8 on all linears
    assert flops.lora_params(shape, 8, "all") == 20_971_520
    assert flops.lora_params(shape, 8, "q_proj,v_proj") == 32 * 8 * ((4096 + 4096) + (4096 + 1024))
    tuning = flops.tuning_of({"finetuning_type": "lora", "lora_rank": 8, "lora_target": "all"}, shape)
    count = flops.per_token(shape, 1000, tuning)
    m = flops.matmul_params(shape)
    assert count.total == pytest.approx(4 * m + 6 * 32 * 32 * 128 * 1000 + 6 * 20_971_520)
    assert count.total < flops.per_token(shape, 1000).total * 0.7


def test_freeze_runs_the_backward_pass_only_through_the_trainable_layers():
    shape = shape_from_config(LLAMA32_1B)
    layer, head = flops.layer_matmul(shape), 128256 * 2048
    attn_layer = 2 * 32 * 64 * 500
    last_two = flops.per_token(shape, 500, flops.tuning_of({"finetuning_type": "freeze"}, shape))
    forward = 2 * (16 * layer + head) + 16 * attn_layer
    backward = 2 * (head + 2 * layer) + 2 * 2 * attn_layer + 2 * 2 * layer
    assert last_two.total == pytest.approx(forward + backward)
    # the first two layers trainable: the backward pass goes all the way down
    first_two = flops.per_token(
        shape, 500, flops.tuning_of({"finetuning_type": "freeze", "freeze_trainable_layers": -2}, shape)
    )
    assert last_two.total < first_two.total < flops.per_token(shape, 500).total


def test_span_is_the_pack_for_plain_packing_and_the_token_weighted_row_length_otherwise():
    stats = {"attention_span_tokens": 300.0, "mean_tokens": 200.0}
    assert flops.attention_span({"packing": True, "neat_packing": False, "cutoff_len": 2048}, stats) == 2048
    assert flops.attention_span({"packing": True, "neat_packing": True, "cutoff_len": 2048}, stats) == 300
    assert flops.attention_span({}, stats) == 300
    # rows of 100 and 300 tokens: 3 of 4 tokens sit in the long row
    assert flops.span_of_lengths([100, 300]) == pytest.approx((100**2 + 300**2) / 400)


def test_mfu_against_the_peak():
    assert flops.mfu(10_000, 6e9, 989.0) == pytest.approx(10_000 * 6e9 / 989e12)
    assert flops.mfu(10_000, 6e9, None) == 0.0


def test_the_committed_h200_run_page_mfu_is_the_formulas():
    """bench/results/pipeline_h200x1_20261201_flops.*: the whole pipeline on one H200 (1.24 B, tied).
    The page's MFU is tokens/s/GPU x F / 989 TFLOP/s with F counted again here from the model's
    shape, and the tuned folder holds the base's 1 235 814 400 parameters."""
    import json
    from pathlib import Path

    import yaml

    from bench.sft_models import llama_config

    repo = Path(__file__).resolve().parents[3]

    stem = repo / "bench/results/pipeline_h200x1_20261201_flops"
    page = json.loads(Path(f"{stem}.summary.json").read_text())
    args = yaml.safe_load(Path(f"{stem}.llamafactory.yaml").read_text())
    shape = shape_from_config(llama_config("1b"))
    count = flops.per_token(shape, page["attention_span_tokens"], flops.tuning_of(args, shape))
    assert page["flops_per_token"] == pytest.approx(count.total, rel=1e-6)
    assert page["mfu"] == pytest.approx(
        flops.mfu(page["tokens_per_second_per_gpu"], count.total, 989.0), abs=1e-4
    )
    check = json.loads(Path(f"{stem}.flops_check.json").read_text())
    assert check["page_mfu"] == check["bench_mfu_at_page_tokens_per_s"]
    assert page["n_params"] == check["base_params"]["n_params"] == shape.params == 1_235_814_400
