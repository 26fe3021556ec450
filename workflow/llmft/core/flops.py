"""One count of training FLOPs per token, for the planner's step time, the report, summary.json and
bench/. Model FLOPs (what the model's maths needs), not hardware FLOPs: a recomputed forward under
gradient checkpointing is not counted (the step-time estimate adds it itself).

    F = forward + backward, per token, from the model config's shape:
      M   matrix weights: each layer's q, k, v, o and MLP projections, plus the output head once
          (tied or not); the input embedding is a lookup and norms are elementwise: neither counts
      A   causal attention: a query at position t scores t keys (QK^T) and mixes t values (AV), 4·t
          FLOPs per head dimension per layer; the mean t is S/2 for a sequence of S tokens, so
          forward attention is 2·layers·heads·head_dim·S per token
      forward   2·M + A (+ 2·adapter for LoRA)
      backward  input gradients 2·(head + the layers the backward pass goes through) + 2·A there,
                weight gradients 2·(trainable matrix weights), LoRA adapters 4·adapter
    Full fine-tuning: F = 6·M + 3·A, the usual 6N + causal attention. LoRA: 4·M + 3·A + 6·adapter
    (frozen weights get no weight gradients). Freeze with the last n layers trainable: the
    backward pass stops below them.

S, the span a token's attention covers: its own row for unpacked rows and neat packing (the
token-weighted mean row length, sum(L^2) / sum(L), over the train rows), the whole pack
(cutoff_len) for plain packing.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMULA = (
    "MFU = tokens/s per GPU × F / peak; F = 6·M + 6·layers·heads·head_dim·S for full training "
    "(M: matrix weights with the output head once, embedding lookup not counted; S: the span a "
    "token attends over, causal); adapters: no weight gradients for frozen weights"
)


@dataclass(frozen=True)
class Tuning:
    """Which weights train: full, LoRA (an adapter of `adapter` parameters on every layer) or
    freeze (`layers` trainable: the last n when positive, the first n when negative)."""

    kind: str = "full"
    adapter: float = 0.0
    layers: int = 0


FULL = Tuning()


def layer_matmul(shape) -> float:
    """Matrix weights of one decoder layer (attention projections and MLP)."""
    attn = shape.hidden * shape.heads * shape.head_dim * 2 + shape.hidden * shape.kv_dim * 2
    return float(attn + 3 * shape.hidden * shape.intermediate)


def matmul_params(shape) -> float:
    """M: every layer's matrix weights and the output head once."""
    return shape.layers * layer_matmul(shape) + float(shape.vocab * shape.hidden)


def lora_module_dims(shape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear module of a Llama-like decoder layer, by module name."""
    q, kv, h, i = shape.heads * shape.head_dim, shape.kv_dim, shape.hidden, shape.intermediate
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def lora_params(shape, rank: int, target="all") -> float:
    """Adapter parameters: rank x (in + out) per adapted matrix and layer (A is rank x in, B out x
    rank); `all` is every linear layer but the output head (LLaMA-Factory's meaning); a name this
    table does not know (another architecture's) counts as a hidden x hidden matrix."""
    dims = lora_module_dims(shape)
    names = [n.strip() for n in (target.split(",") if isinstance(target, str) else target) if n.strip()]
    if names in ([], ["all"]):
        names = list(dims)
    square = (shape.hidden, shape.hidden)
    return float(shape.layers * sum(rank * sum(dims.get(n.split(".")[-1], square)) for n in names))


def tuning_of(args: dict, shape) -> Tuning:
    """The Tuning a LLaMA-Factory argument dict (the rendered YAML) asks for."""
    kind = args.get("finetuning_type", "full")
    if kind == "lora":
        return Tuning(
            "lora", adapter=lora_params(shape, int(args.get("lora_rank", 8)), args.get("lora_target", "all"))
        )
    if kind == "freeze":
        return Tuning("freeze", layers=int(args.get("freeze_trainable_layers", 2)))
    return FULL


@dataclass(frozen=True)
class FlopCount:
    """Training FLOPs per token, split as the module docstring says."""

    forward: float
    backward: float
    attention: float  # forward + backward attention, included in the two above
    matmul_params: float
    span: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def per_token(shape, span: float, tuning: Tuning = FULL) -> FlopCount:
    """Training FLOPs per token of a model of this shape, sequences spanning `span` tokens."""
    m_layer, head = layer_matmul(shape), float(shape.vocab * shape.hidden)
    layers = shape.layers
    attn_layer = 2.0 * shape.heads * shape.head_dim * max(float(span), 0.0)  # forward, per layer
    if tuning.kind == "freeze":
        n = max(-layers, min(layers, tuning.layers))
        through = abs(n) if n > 0 else layers  # the last n: backward stops below them
        trainable = abs(n) * m_layer
        adapter = 0.0
    elif tuning.kind == "lora":
        through, trainable, adapter = layers, 0.0, float(tuning.adapter)
    else:
        through, trainable, adapter = layers, layers * m_layer + head, 0.0
    forward = 2.0 * (layers * m_layer + head) + layers * attn_layer + 2.0 * adapter
    backward = 2.0 * (head + through * m_layer) + 2.0 * through * attn_layer + 2.0 * trainable + 4.0 * adapter
    return FlopCount(
        forward=forward,
        backward=backward,
        attention=(layers + 2 * through) * attn_layer,
        matmul_params=layers * m_layer + head,
        span=float(span),
    )


def attention_span(lf_args: dict, stats: dict) -> float:
    """S for a run: the pack for plain packing, else the token-weighted mean train row length."""
    if lf_args.get("packing") and not lf_args.get("neat_packing"):
        return float(lf_args.get("cutoff_len") or 0)
    return float(stats.get("attention_span_tokens") or stats.get("mean_tokens") or 0)


def span_of_lengths(lengths) -> float:
    """sum(L^2) / sum(L): the mean, over tokens, of the length of the row each token is in."""
    total = sum(lengths)
    return sum(n * n for n in lengths) / total if total else 0.0


def mfu(tokens_per_s_per_gpu: float, flops_per_token: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation against the GPU's dense bf16 peak."""
    if not peak_tflops or peak_tflops <= 0:
        return 0.0
    return tokens_per_s_per_gpu * flops_per_token / (peak_tflops * 1e12)
