"""Random-init models shaped like real model families, around their real tokenizers.

A real tokenizer with a model of its family's architecture (Llama for Llama-3, Qwen3, Gemma-3's
text model) but a few hundred thousand parameters besides the embedding table: small enough to
train on a CPU in a test, real enough that the template, the tokenizer and LLaMA-Factory's model
loading are the ones a user of that family gets.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

HIDDEN = 64
LAYERS = 2
HEADS = 4
HEAD_DIM = HIDDEN // HEADS

# family -> (transformers config class, what the family's config sets that a small shape keeps)
SHAPES = {
    "llama3": ("LlamaConfig", {"rope_theta": 500000.0}),
    "qwen3": ("Qwen3Config", {"rope_theta": 1000000.0}),
    "gemma3": ("Gemma3TextConfig", {"query_pre_attn_scalar": HEAD_DIM, "sliding_window": 64}),
}


def build_family_model(family: str, tokenizer_dir: str | Path, out_dir: str | Path, seed: int = 0) -> dict:
    """Write a random-init model of `family`'s architecture with the tokenizer of `tokenizer_dir`
    (its files copied as they are) to `out_dir`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in tokenizer_dir.iterdir():
        if item.is_file():
            shutil.copy2(item, out_dir / item.name)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config_class, extra = SHAPES[family]
    # Embedding rows for every id the tokenizer can produce, rounded up as the families do.
    vocab = -(-len(tok) // 64) * 64
    config = getattr(transformers, config_class)(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=HIDDEN * 4,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        tie_word_embeddings=True,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(out_dir))
    info = {
        "family": family,
        "architecture": type(model).__name__,
        "vocab_size": vocab,
        "n_params": sum(p.numel() for p in model.parameters()),
    }
    (out_dir / "llmft_family_model.json").write_text(json.dumps(info, indent=2))
    return info
