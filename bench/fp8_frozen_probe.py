"""LoRA's frozen base weights in FP8: torchao's Float8Linear against weights cast to FP8 once.

For a LoRA run the base weights never change, yet torchao's float8 training casts each of them to
FP8 again in every forward and backward (amax, scale, cast: reading 2 bytes and writing 1 per weight,
twice a step). `cast_once` casts each frozen weight at conversion: e4m3 with one scale per tensor, in
both layouts torch._scaled_mm needs (W for the forward, W^T for the input gradient; no weight
gradient is ever needed); since 2312bd4 (2026-12-04) this is llmft's own layer (llmft.core.fp8,
FrozenFloat8Linear), which the training entry uses below ZeRO-3. Per step only the activations and
the output gradients are cast.

Timed: a stack of Llama decoder layers (transformers' LlamaDecoderLayer, SDPA), LoRA adapters (rank
16, bf16) on all seven projections, forward + backward of micro-batch x sequence tokens, each layer
under torch.compile; the median of the timed steps. Also: each FP8 variant's output and input
gradient against bf16's (relative error of the whole stack).

    python bench/fp8_frozen_probe.py --shape 8b --layers 4 --batch 4 --seq 2048

`--trainable` times full fine-tuning's layers instead: no adapters, every weight trained (its weight
gradient computed), bf16 against torchao's float8 training with the tensorwise and the rowwise
recipe (each layer compiled as above). What FP8 can give a full fine-tuning step at most: the
decoder layers' share of the step times this speed-up.

    python bench/fp8_frozen_probe.py --trainable --shape 1b --layers 8 --batch 8 --seq 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
}


def cast_once(linear: torch.nn.Linear) -> torch.nn.Module:
    """The frozen layer as llmft trains it (llmft.core.fp8.frozen_linear, its weight cast to float8
    once, in both layouts torch._scaled_mm takes)."""
    from llmft.core import fp8

    layer = fp8.frozen_linear(linear)
    layer.cast_weight()
    return layer


class LoRALinear(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear, rank: int = 16, alpha: int = 32):
        super().__init__()
        base.weight.requires_grad_(False)
        self.base_layer = base
        self.lora_A = torch.nn.Linear(
            base.in_features, rank, bias=False, dtype=base.weight.dtype, device=base.weight.device
        )
        self.lora_B = torch.nn.Linear(
            rank, base.out_features, bias=False, dtype=base.weight.dtype, device=base.weight.device
        )
        torch.nn.init.normal_(self.lora_B.weight, std=0.02)
        self.scaling = alpha / rank

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build(shape: str, layers: int, variant: str, seed: int = 0, trainable: bool = False):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(seed)
    cfg = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    stack = torch.nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(layers)).cuda().bfloat16()
    if trainable:  # full fine-tuning: every weight trained, the seven projections in float8 or not
        if variant != "bf16":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(
                stack,
                module_filter_fn=lambda m, fqn: fqn.rsplit(".", 1)[-1] in PROJ,
                config=Float8LinearConfig.from_recipe_name(variant),
            )
        return stack, LlamaRotaryEmbedding(cfg).cuda()
    for layer in stack:
        for block in (layer.self_attn, layer.mlp):
            for name in PROJ:
                if hasattr(block, name):
                    setattr(block, name, LoRALinear(getattr(block, name)))
        for p in layer.parameters():
            p.requires_grad_(False)
        for m in layer.modules():
            if isinstance(m, LoRALinear):
                m.lora_A.weight.requires_grad_(True)
                m.lora_B.weight.requires_grad_(True)
    if variant == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            stack,
            module_filter_fn=lambda m, fqn: fqn.endswith("base_layer"),
            config=Float8LinearConfig.from_recipe_name("tensorwise"),
        )
    elif variant == "cast_once":
        for m in stack.modules():
            if isinstance(m, LoRALinear):
                m.base_layer = cast_once(m.base_layer)
    rope = LlamaRotaryEmbedding(cfg).cuda()
    return stack, rope


def step(stack, rope, x, pos):
    h = x
    cos_sin = rope(h, pos)
    for layer in stack:
        out = layer(h, position_embeddings=cos_sin, position_ids=pos)
        h = out[0] if isinstance(out, tuple) else out
    return h


def measure(shape, layers, batch, seq, variant, iters, compile_, trainable=False, dynamic=False):
    stack, rope = build(shape, layers, variant, trainable=trainable)
    if compile_:
        for i, layer in enumerate(stack):
            stack[i] = torch.compile(layer, dynamic=dynamic or None)
    torch.manual_seed(1)
    x = torch.randn(batch, seq, SHAPES[shape]["hidden_size"], device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(batch, -1)
    times = []
    for i in range(iters + 5):
        x.grad = None
        stack.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        y = step(stack, rope, x, pos)
        y.float().pow(2).mean().backward()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - t)
    y = step(stack, rope, x, pos)
    x.grad = None
    y.float().pow(2).mean().backward()
    peak = torch.cuda.max_memory_allocated() / 2**30
    out = {"ms": round(1000 * statistics.median(times), 2), "peak_gib": round(peak, 2)}
    result = (y.detach().float(), x.grad.detach().float())
    del stack
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return out, result


def rel(a, b):
    return round(((a - b).norm() / b.norm()).item(), 4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b", choices=SHAPES)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument(
        "--dynamic", action="store_true", help="compile with dynamic shapes, as varying lengths do"
    )
    ap.add_argument(
        "--trainable",
        action="store_true",
        help="full fine-tuning's layers: no adapters, every weight trained",
    )
    args = ap.parse_args()
    rows, ref = {}, None
    variants = ("bf16", "tensorwise", "rowwise") if args.trainable else ("bf16", "torchao", "cast_once")
    for variant in variants:
        out, res = measure(
            args.shape,
            args.layers,
            args.batch,
            args.seq,
            variant,
            args.iters,
            not args.eager,
            args.trainable,
            args.dynamic,
        )
        if ref is None:
            ref = res
        else:
            out["speedup"] = round(rows["bf16"]["ms"] / out["ms"], 3)
            out["rel_err_out"] = rel(res[0], ref[0])
            out["rel_err_grad_x"] = rel(res[1], ref[1])
        rows[variant] = out
        print(variant, json.dumps(out), flush=True)
    print(
        json.dumps(
            {
                "args": vars(args),
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
