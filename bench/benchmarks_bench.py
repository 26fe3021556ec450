"""llmft's lm-eval backend against plain lm-eval `hf` on the same model, tasks and machine, one call.

    python bench/benchmarks_bench.py --model DIR --work DIR --out RESULT.json [--mc 1000 --gen 200]

Two tasks are written into --work (lm-eval task folders, read with include_path, nothing downloaded):
`bench_mc`, a 1 000-question five-way multiple choice (log-likelihood), and `bench_gen`, 200
greedy generations of up to --gen-tokens tokens. Each backend scores both tasks through
lm_eval.simple_evaluate with log_samples on:
- `hf`: lm-eval's HFLM with batch_size "auto" (lm-eval's own search for the largest batch), max_length
  2048 for both;
- `llmft`: llmft.benchmarks.backend.LlmftLM, batch_size 64 (eval.batch_size's default).
Time is wall time of simple_evaluate per task, after one warm-up task on each backend (CUDA context,
kernels, llmft's graph capture at the first batch shape are paid by the warm-up, not by the timed run).
Same outputs: per-request log-likelihoods (max absolute difference, and whether every question picks
the same choice) and generated strings (fraction identical). The ratio printed is hf seconds / llmft
seconds for each task.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

MC_YAML = """task: bench_mc
custom_dataset: !function docs.mc
test_split: test
output_type: multiple_choice
doc_to_text: "Question: Which group does the word {{word}} belong to?\\nAnswer:"
doc_to_choice: ["animal", "fruit", "color", "tool", "vehicle"]
doc_to_target: label
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""
GEN_YAML = """task: bench_gen
custom_dataset: !function docs.gen
test_split: test
output_type: generate_until
doc_to_text: "Repeat the words in order.\\n{{words}}\\nAnswer:"
doc_to_target: "{{words}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: GEN_TOKENS
  do_sample: false
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
"""
DOCS = """import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _load(name):
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}


def mc(**_):
    return _load("mc.jsonl")


def gen(**_):
    return _load("gen.jsonl")
"""


# Both backends see the same context window; lm-eval's batch-size search for `hf` sizes its trial
# batches by it (the model's own 131 072 positions would make every trial a huge forward pass).
MAX_LENGTH = 2048


def write_tasks(work: Path, n_mc: int, n_gen: int, gen_tokens: int) -> Path:
    rng = random.Random(1234)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def word() -> str:
        return "".join(rng.choice(letters) for _ in range(rng.randint(3, 9)))

    tasks = work / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    (tasks / "bench_mc.yaml").write_text(MC_YAML)
    (tasks / "bench_gen.yaml").write_text(GEN_YAML.replace("GEN_TOKENS", str(gen_tokens)))
    (tasks / "docs.py").write_text(DOCS)
    mc = [{"word": word(), "label": rng.randrange(5)} for _ in range(n_mc)]
    gen = [{"words": " ".join(word() for _ in range(rng.randint(8, 40)))} for _ in range(n_gen)]
    (tasks / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    (tasks / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gen))
    return tasks


def run_backend(name: str, model: str, tasks: Path, device: str, dtype: str) -> dict:
    import torch
    from llmft.benchmarks.backend import LlmftLM
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    cls, batch = (HFLM, "auto") if name == "hf" else (LlmftLM, 64)
    tm = TaskManager(include_path=str(tasks))
    t0 = time.perf_counter()
    lm = cls(pretrained=model, device=device, dtype=dtype, batch_size=batch, max_length=MAX_LENGTH)
    load_s = time.perf_counter() - t0
    out = {"backend": name, "batch_size": batch, "load_s": round(load_s, 2), "tasks": {}}
    # warm-up: a few requests of each kind, untimed
    simple_evaluate(model=lm, tasks=["bench_mc", "bench_gen"], limit=8, task_manager=tm, log_samples=False)
    cuda = device.startswith("cuda")
    for task in ("bench_mc", "bench_gen"):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = simple_evaluate(model=lm, tasks=[task], task_manager=tm, log_samples=True)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        samples = res["samples"][task]
        if task == "bench_mc":
            resps = [[float(r[0][0]) for r in s["resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])]
        else:
            resps = [s["resps"][0][0] for s in sorted(samples, key=lambda s: s["doc_id"])]
        out["tasks"][task] = {"seconds": round(seconds, 2), "requests": len(samples), "resps": resps}
        print(f"{name} {task}: {seconds:.2f} s, {len(samples)} docs", flush=True)
    out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
    del lm
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def compare(hf: dict, ours: dict) -> dict:
    a, b = hf["tasks"]["bench_mc"]["resps"], ours["tasks"]["bench_mc"]["resps"]
    diff = max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    same_pick = sum(ra.index(max(ra)) == rb.index(max(rb)) for ra, rb in zip(a, b, strict=True))
    ga, gb = hf["tasks"]["bench_gen"]["resps"], ours["tasks"]["bench_gen"]["resps"]
    same_gen = sum(x == y for x, y in zip(ga, gb, strict=True))
    return {
        "mc_max_abs_loglik_diff": round(diff, 4),
        "mc_same_choice": f"{same_pick}/{len(a)}",
        "gen_identical": f"{same_gen}/{len(ga)}",
        "mc_speedup": round(hf["tasks"]["bench_mc"]["seconds"] / ours["tasks"]["bench_mc"]["seconds"], 2),
        "gen_speedup": round(hf["tasks"]["bench_gen"]["seconds"] / ours["tasks"]["bench_gen"]["seconds"], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the model folder (bf16 safetensors + tokenizer)")
    ap.add_argument("--work", required=True, help="a scratch folder for the task files")
    ap.add_argument("--out", required=True, help="the result JSON to write")
    ap.add_argument("--mc", type=int, default=1000, help="multiple-choice questions")
    ap.add_argument("--gen", type=int, default=200, help="generation prompts")
    ap.add_argument("--gen-tokens", type=int, default=128, help="max_gen_toks of the generation task")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the same path")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 (speed), or float32 (same outputs)")
    args = ap.parse_args()
    tasks = write_tasks(Path(args.work), args.mc, args.gen, args.gen_tokens)
    hf = run_backend("hf", args.model, tasks, args.device, args.dtype)
    ours = run_backend("llmft", args.model, tasks, args.device, args.dtype)
    result = {"model": args.model, "dtype": args.dtype, "mc": args.mc, "gen": args.gen}
    result["gen_tokens"] = args.gen_tokens
    result |= compare(hf, ours)
    result["seconds"] = {
        b["backend"]: {t: v["seconds"] for t, v in b["tasks"].items()} | {"load": b["load_s"]}
        for b in (hf, ours)
    }
    result["peak_gib"] = {hf["backend"]: hf["peak_gib"], ours["backend"]: ours["peak_gib"]}
    result["samples"] = {b["backend"]: {t: v["resps"][:3] for t, v in b["tasks"].items()} for b in (hf, ours)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
    main()
