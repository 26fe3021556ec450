"""Fixtures the planner's tests share (test_plan, test_preference)."""

import json

import pytest

# The benchmark's Llama-like shapes (bench/sft_models.py); parameter counts as the device reported them.
SHAPES = {
    "1b": (
        dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
        1_235_814_400,
    ),
    "8b": (
        dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
        8_030_261_248,
    ),
    "70b": (
        dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
             intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False),
        70_553_706_496,
    ),
}  # fmt: skip


@pytest.fixture
def model(tmp_path):
    def make(size: str) -> str:
        folder = tmp_path / size
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", **SHAPES[size][0]}))
        return str(folder)

    return make
