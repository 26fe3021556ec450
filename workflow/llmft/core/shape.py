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
    """Read config.json of an HF model folder (a decoder: most open models are)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config key model.name_or_path: cannot read {path}: {exc}") from None
    return shape_from_config(cfg, str(path))


# The names transformers' attribute_map gives the decoder dimensions in other families' configs
# (GPT-2/GPT-J/BigCode n_embd, MPT d_model, Falcon's old n_head/n_layer), for a model_type the
# installed transformers does not know; a known one uses its own config class's map first.
ALIASES = {
    "hidden_size": ("n_embd", "n_embed", "d_model"),
    "num_hidden_layers": ("n_layer", "n_layers", "num_layers"),
    "num_attention_heads": ("n_head", "n_heads", "num_heads"),
    "intermediate_size": ("n_inner", "ffn_hidden_size", "ffn_dim"),
    "num_key_value_heads": ("num_kv_heads", "n_head_kv"),
}
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _config_class(model_type):
    """transformers' config class of `model_type` (its own code, never a folder's remote code)."""
    if not isinstance(model_type, str):
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None


def _canonical(cfg: dict) -> dict:
    """cfg with the decoder dimensions under transformers' standard names, read through the
    aliases when the standard ones are missing (imports transformers only then)."""
    if all(k in cfg for k in REQUIRED):
        return cfg
    out = dict(cfg)
    cls = _config_class(cfg.get("model_type"))
    own = getattr(cls, "attribute_map", {}) if cls else {}
    for key, aliases in ALIASES.items():
        for alias in (own.get(key), *aliases):
            if key not in out and alias in cfg:
                out[key] = cfg[alias]
    if out.get("num_key_value_heads") is None and cfg.get("multi_query") is True:
        out["num_key_value_heads"] = 1  # Falcon-7B's multi-query attention: one K/V head
    if "tie_word_embeddings" not in cfg and cls is not None:
        out["tie_word_embeddings"] = cls().tie_word_embeddings  # GPT-2 ties by its class default
    return out


def _dimension(cfg: dict, key: str, where: str, default=None) -> int:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"config key model.name_or_path: {where} has {key}: {value!r}; it must be a positive integer"
        )
    return value


def shape_from_config(cfg: dict, where: str = "the model config") -> ModelShape:
    """The shape of a decoder from its HF config dict (config.json's contents)."""
    if not isinstance(cfg, dict):
        raise ConfigError(
            f"config key model.name_or_path: {where} holds a JSON {type(cfg).__name__}, not an object; "
            "a model's config.json is one object of its settings"
        )
    text = cfg.get("text_config")
    cfg = _canonical(text if isinstance(text, dict) else cfg)
    missing = [k for k in REQUIRED if cfg.get(k) is None]
    if missing:
        raise ConfigError(
            f"config key model.name_or_path: {where} lacks {', '.join(map(repr, missing))} (nor any of "
            "transformers' other names for it); the planner needs a decoder config"
        )
    hidden, layers, heads, vocab = (_dimension(cfg, k, where) for k in REQUIRED)
    inter = _dimension(cfg, "intermediate_size", where, 4 * hidden)
    kv = _dimension(cfg, "num_key_value_heads", where, heads)
    head_dim = _dimension(cfg, "head_dim", where, hidden // heads)
    tied = bool(cfg.get("tie_word_embeddings", False))
    model_type = cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else ""
    shape = ModelShape(model_type, hidden, layers, heads, kv, head_dim, inter, vocab, tied, 0)
    params = layers * shape.layer_params + vocab * hidden * (1 if tied else 2) + hidden
    return ModelShape(**{**asdict(shape), "params": params})
