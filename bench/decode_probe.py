"""Where a batch of `eval.decoding: graphs` spends its time, phase by phase, on one GPU.

    python bench/decode_probe.py MODEL_DIR ROWS.jsonl [--rows-n 64] [--new 64] [--out RESULT.json]

The evaluation's own encoding of the first ROWS rows (template `default`), one batch, the model in
bf16. Times, each the median of a few runs after a warm-up: transformers' `generate` (dynamic
cache) on the batch; `_generate_graphs` on the batch; and inside the latter's recipe, the prompt
forward, one eager one-token step, the capture, and one replay of the captured step (the floor of
a decoding step), plus the GPU time of one replay from torch.profiler.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO))  # bench.* as a package, as tests import it

from llmft.core.io import read_jsonl  # noqa: E402
from llmft.evaluate import run as ev  # noqa: E402
from llmft.evaluate import worker  # noqa: E402

from bench.compute_ceiling import gpu_times  # noqa: E402

FIRST: dict[str, float] = {}  # each timing's first call, apart: it carries one-time set-up


def timed(fn, repeats: int = 3, name: str = "") -> float:
    times = gpu_times(fn, repeats + 1)
    if name:
        FIRST[name] = times[0]
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("rows")
    ap.add_argument("--rows-n", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out")
    ap.add_argument("--sdp", choices=["default", "no-cudnn", "flash-or-math"], default="default")
    args = ap.parse_args()
    if args.sdp != "default":  # which of torch's SDPA kernels the model may use
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.sdp == "flash-or-math":
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    from transformers import AutoModelForCausalLM, StaticCache

    tokenizer, encoded = ev.encode(read_jsonl(args.rows)[: args.rows_n], args.model, "default")
    prompts = [p for p, _ in encoded]
    device = torch.device("cuda:0")
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16, device_map={"": device}
    ).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = worker.eos_ids(tokenizer)
    job = worker.ShardJob(str(args.model), "cuda:0", encoded, [], [], args.new, eos, pad)
    res: dict = {
        "sdp": args.sdp,
        "rows": len(prompts),
        "new_tokens": args.new,
        "prompt_width": max(map(len, prompts)),
    }
    with torch.inference_mode():
        res["generate_dynamic_s"] = timed(
            lambda: worker._generate(model, prompts, job, device, "dynamic"), name="dynamic"
        )
        res["graphs_s"] = timed(lambda: worker._generate_graphs(model, prompts, job, device), name="graphs")
        # Other prompt widths (as the sorted batches of an evaluation have): new shapes for every kernel.
        shorter = [p[len(p) // 3 :] for p in prompts]
        res["graphs_new_width_s"] = timed(
            lambda: worker._generate_graphs(model, shorter, job, device), name="graphs_w"
        )
        res["dynamic_new_width_s"] = timed(
            lambda: worker._generate(model, shorter, job, device, "dynamic"), name="dyn_w"
        )
        # The recipe's phases, on the same shapes.
        n, width = len(prompts), res["prompt_width"]
        ids = torch.full((n, width), pad, dtype=torch.long, device=device)
        mask = torch.ones((n, width + args.new), dtype=torch.long, device=device)
        cache = StaticCache(config=model.config, max_cache_len=width + args.new)
        pos = torch.arange(width, device=device).expand(n, -1)

        def step(tokens, p, cp):
            kw = {"past_key_values": cache, "cache_position": cp, "use_cache": True, "logits_to_keep": 1}
            return model(input_ids=tokens, attention_mask=mask, position_ids=p, **kw).logits[:, -1].argmax(-1)

        def prompt_forward():  # into a fresh cache: the cache counts the columns it has filled
            nonlocal cache
            cache = StaticCache(config=model.config, max_cache_len=width + args.new)
            return step(ids, pos, torch.arange(width, device=device))

        res["prompt_forward_s"] = timed(prompt_forward)
        tok = ids[:, :1].clone()
        p1 = torch.full((n, 1), width, device=device)
        cp = torch.tensor([width], device=device)
        res["eager_step_s"] = timed(lambda: step(tok, p1, cp))
        graph = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        with torch.cuda.graph(graph):
            step(tok, p1, cp)
        torch.cuda.synchronize()
        res["capture_s"] = time.perf_counter() - t0
        res["replay_s"] = timed(graph.replay, repeats=20)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        res["replay_kernels"] = len(kernels)
        res["replay_gpu_ms"] = round(sum(e.device_time_total for e in kernels) / 1e3, 3)
    res = {k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}
    res["first_call_s"] = {k: round(v, 4) for k, v in FIRST.items()}
    print(json.dumps(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
