"""How fast can one GPU compute an 8 B training step, with nothing else in the way?

    python bench/compute_ceiling.py --out RESULT.json [--layers 2 4] [--rows 4] [--world 2]
    python bench/compute_ceiling.py --out RESULT.json --size 1b --rows 8 --world 1 --accum 2  # ours_1b, 1 GPU

The 8 B model of `bench/sft_models.py` cut to a few decoder layers (same hidden size, heads, MLP,
vocabulary and untied head), with the kernels llmft's `auto` chose for the measured ours_8b run
(Liger RoPE, RMSNorm, SwiGLU and fused linear cross-entropy; torch's varlen FlashAttention through
`llmft.core.varlen`), fed the micro-batch that run trained on: 4 neat-packed rows of 2 048 tokens from
the bench's own row lengths, flattened into one row. Forward + backward is timed at two depths;
the difference is one layer's cost, the rest embeddings, head and loss, and the two extrapolate to
the full 32 layers. The fused AdamW step over half the 8 B parameters in fp32 (ZeRO-2's share on 2
GPUs) is timed on its own. Their sum is a step with no collectives, no data loading and no Python
between kernels: an upper bound for ours_8b's step on the same GPU, so the MFU it implies is the
most any setting of the real run could reach. No communication, so one GPU answers it.
`--size 1b` does the same for the 1.24 B model (tied head), `--accum N` for N micro-batches a step.

How far those kernels are from the chip, measured in the same call:
- `gemm_*`: every matrix product of the step alone (each linear layer's forward and both backward
  products at the micro-batch's token count, through the same cuBLAS calls as the model; the head
  unchunked), so `gemm_only_mfu` is the MFU of a step whose attention, norms, activations, loss
  and optimizer took no time at all. The fused-projection shapes (q|k|v, gate|up) are timed too.
- `kernel_ms_per_layer`: one decoder layer's GPU time by kind of kernel (torch.profiler, the
  difference of the two depths), to show where the time that is not matrix products goes.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO))  # bench.* as a package, as tests import it

from llmft.core import flops, hardware, varlen  # noqa: E402
from llmft.core.shape import shape_from_config  # noqa: E402

from bench.sft_models import llama_config  # noqa: E402

SEQ = 2048


def packed_batch(lengths: list[int], rows: int, seq: int, vocab: int, seed: int = 0) -> dict:
    """`rows` neat-packed rows of at most `seq` tokens (first fit over shuffled row lengths), as
    LLaMA-Factory's collator hands them over (attention_mask = sample index), then flattened."""
    rng = random.Random(seed)
    order = [min(n, seq) for n in lengths]
    rng.shuffle(order)
    packs: list[list[int]] = [[] for _ in range(rows)]
    for n in order:
        pack = next((p for p in packs if sum(p) + n <= seq), None)
        if pack is None:
            if all(sum(p) > seq - 64 for p in packs):
                break
            continue
        pack.append(n)
    segments = torch.zeros(rows, seq, dtype=torch.long)
    for r, pack in enumerate(packs):
        pos = 0
        for i, n in enumerate(pack, start=1):
            segments[r, pos : pos + n] = i
            pos += n
    ids = torch.randint(3, vocab, (rows, seq))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": segments}
    return varlen.flatten_packed(batch, pad_id=2)


def gpu_times(step, runs: int) -> list[float]:
    """Wall seconds of each of `runs` calls of `step()`, the GPU synchronised before and after each."""
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def median_seconds(step, warmup: int, repeats: int) -> float:
    """The (upper) median wall time of `step()` on the GPU over `repeats` runs after `warmup` untimed ones."""
    return statistics.median_high(gpu_times(step, warmup + repeats)[warmup:])


def fwd_bwd(model, batch: dict) -> None:
    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)


KINDS = (  # first match wins: FlashAttention's Hopper kernels are CUTLASS kernels too
    ("attention", ("flash", "attn", "fmha")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
    ("norm", ("rms_norm",)),
    ("swiglu", ("swiglu",)),
    ("rope", ("rope",)),
    ("loss", ("cross_entropy",)),
    ("copy", ("copy", "memcpy", "memset", "fill")),
    ("elementwise", ("elementwise", "reduce")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def profile_ms(step) -> dict[str, float]:
    """GPU milliseconds of one `step()` by kind of kernel (and the names of the attention kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    spans = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kind = kernel_kind(ev.name)
            for key in (kind, f"{kind}: {ev.name[:90]}") if kind == "attention" else (kind,):
                out[key] = out.get(key, 0.0) + ev.device_time_total / 1e3
            spans.append((ev.time_range.start, ev.time_range.end))
    if spans:  # GPU busy share between the first kernel's start and the last one's end
        busy = sum(e - s for s, e in spans)
        out["busy_share"] = busy / (max(e for _, e in spans) - min(s for s, _ in spans))
    return out


def time_fwd_bwd(size: str, layers: int, batch: dict, warmup: int, repeats: int) -> tuple[float, dict]:
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers import LlamaConfig, LlamaForCausalLM

    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    cfg = LlamaConfig(**llama_config(size, num_hidden_layers=layers))
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.set_attn_implementation(varlen.NAME)
    model.train()
    dev = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    step = functools.partial(fwd_bwd, model, dev)
    seconds = median_seconds(step, warmup, repeats)
    kinds = profile_ms(step)
    del model
    torch.cuda.empty_cache()
    return seconds, kinds


def time_linear(tokens: int, d_in: int, d_out: int, repeats: int) -> float:
    """Forward + backward (input and weight gradients) of one bias-free bf16 linear layer."""
    x = torch.randn(tokens, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, d_out, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        torch.nn.functional.linear(x, w).backward(dy)
        x.grad = w.grad = None

    return median_seconds(step, 3, repeats)


def layer_linears(shape) -> dict[str, tuple[int, int]]:
    kv = shape.kv_heads * shape.head_dim
    q = shape.heads * shape.head_dim
    h, i = shape.hidden, shape.intermediate
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i),
            "down": (i, h), "qkv_fused": (h, q + 2 * kv), "gate_up_fused": (h, 2 * i)}  # fmt: skip


def time_adamw(n_params: int, repeats: int) -> float:
    """torch's fused AdamW (what DeepSpeed's ZeRO-2 steps here) over one flat fp32 partition."""
    p = torch.nn.Parameter(torch.zeros(n_params, device="cuda"))
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-5, fused=True)
    seconds = median_seconds(opt.step, 2, repeats)
    del opt, p
    torch.cuda.empty_cache()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, nargs=2, default=[2, 4])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--size", choices=["1b", "8b"], default="8b")
    ap.add_argument("--world", type=int, default=2, help="GPUs the real run shards the optimizer over")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--measured-mfu", type=float, help="the real run's median-step MFU, as recorded")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    if args.measured_mfu is None and args.size == "8b":
        args.measured_mfu = 0.5058
    varlen.register()
    lengths = json.loads((REPO / "bench/work/sft/lengths.json").read_text())
    full_cfg = llama_config(args.size)
    batch = packed_batch(lengths, args.rows, SEQ, full_cfg["vocab_size"])
    tokens = int(batch["input_ids"].shape[1])  # as the bench counts them (<= 15 pad tokens included)
    cu = batch["cu_seq_lens_q"].long()
    seqs = torch.diff(cu)
    context = float((seqs * seqs).sum() / seqs.sum())
    lo, hi = args.layers
    t_lo, k_lo = time_fwd_bwd(args.size, lo, batch, 3, args.repeats)
    t_hi, k_hi = time_fwd_bwd(args.size, hi, batch, 3, args.repeats)
    per_layer = (t_hi - t_lo) / (hi - lo)
    rest = t_lo - lo * per_layer
    busy = {str(lo): round(k_lo.pop("busy_share", 0.0), 3), str(hi): round(k_hi.pop("busy_share", 0.0), 3)}
    kernel_ms = {k: round((k_hi.get(k, 0.0) - k_lo.get(k, 0.0)) / (hi - lo), 3) for k in sorted(k_hi)}
    full = shape_from_config(full_cfg)
    shapes = layer_linears(full)
    linears = {n: time_linear(tokens, *io, args.repeats) for n, io in shapes.items()}
    head = time_linear(tokens, full.hidden, full.vocab, args.repeats)
    gemm_layer = sum(linears[n] for n in ("q", "k", "v", "o", "gate", "up", "down"))
    gemm_layer_fused = linears["qkv_fused"] + linears["o"] + linears["gate_up_fused"] + linears["down"]
    gemm_step = full.layers * gemm_layer + head
    params = full.params
    fwd_bwd = rest + full.layers * per_layer
    adamw = time_adamw(params // args.world, 5)
    name = torch.cuda.get_device_name()
    gpu = hardware.identify_gpu(name)
    peak = gpu.peak_bf16_tflops if gpu else None
    per_token = flops.per_token(full, context).total

    step = args.accum * fwd_bwd + adamw

    def mfu(seconds: float, n_tokens: int = tokens) -> float | None:
        return round(flops.mfu(n_tokens / seconds, per_token, peak), 4) if peak else None

    doc = {
        "device": name,
        "torch": torch.__version__,
        "command": "python bench/compute_ceiling.py " + " ".join(sys.argv[1:]),
        "tokens_per_micro_batch": tokens,
        "attention_context_tokens": round(context, 1),
        "params": params,
        "fwd_bwd_seconds": {str(lo): round(t_lo, 4), str(hi): round(t_hi, 4)},
        "per_layer_seconds": round(per_layer, 5),
        "embed_head_loss_seconds": round(rest, 4),
        f"fwd_bwd_{full.layers}_layers_seconds": round(fwd_bwd, 4),
        "micro_batches_per_step": args.accum,
        "adamw_seconds": round(adamw, 4),
        "ceiling_step_seconds": round(step, 4),
        "mfu_fwd_bwd_only": mfu(fwd_bwd),
        "mfu_ceiling_step": mfu(step, args.accum * tokens),
        "gemm_ms": {n: round(t * 1e3, 3) for n, t in linears.items()} | {"head": round(head * 1e3, 3)},
        "gemm_tflops": {n: round(6 * tokens * i * o / linears[n] / 1e12, 1) for n, (i, o) in shapes.items()},
        "gemm_per_layer_seconds": round(gemm_layer, 5),
        "gemm_per_layer_fused_seconds": round(gemm_layer_fused, 5),
        "gemm_only_step_seconds": round(gemm_step, 4),
        "gemm_only_mfu": mfu(gemm_step),
        "kernel_ms_per_layer": kernel_ms,
        "gpu_busy_share": busy,
        "measured_median_step_mfu": args.measured_mfu,
        "measured_share_of_ceiling": (
            round(args.measured_mfu / mfu(step, args.accum * tokens), 3)
            if peak and args.measured_mfu
            else None
        ),
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
