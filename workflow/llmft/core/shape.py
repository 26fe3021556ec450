"""A model's shape (the dimensions that decide memory and FLOPs), read from its config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from llmft.core import flops
from llmft.core.config import ConfigError


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide memory and FLOPs, read from a model's config.json."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    params: int

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        return int(flops.layer_matmul(self)) + 2 * self.hidden  # the projections and two norms


def model_shape(model_dir: str | Path) -> ModelShape:
    """Read config.json of an HF model folder (Llama-like decoder: most open models are)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config key model.name_or_path: cannot read {path}: {exc}") from None
    return shape_from_config(cfg, str(path))


def shape_from_config(cfg: dict, where: str = "the model config") -> ModelShape:
    """The shape of a decoder from its HF config dict (config.json's contents)."""
    cfg = cfg.get("text_config", cfg)
    try:
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        inter = int(cfg.get("intermediate_size") or 4 * hidden)
        vocab = int(cfg["vocab_size"])
    except KeyError as exc:
        raise ConfigError(
            f"config key model.name_or_path: {where} lacks {exc}; the planner needs a decoder config"
        ) from None
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    tied = bool(cfg.get("tie_word_embeddings", False))
    shape = ModelShape(cfg.get("model_type", ""), hidden, layers, heads, kv, head_dim, inter, vocab, tied, 0)
    params = layers * shape.layer_params + vocab * hidden * (1 if tied else 2) + hidden
    return ModelShape(**{**asdict(shape), "params": params})
