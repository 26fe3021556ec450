"""Held-out evaluation: llmft's `evaluate` vs LLaMA-Factory's `do_predict` + `predict_with_generate`.

Same model, same held-out rows, same greedy settings, in one run, alternating the two tools so that
both see the same machine load. Prints and saves:
  - the greedy-output match rate (row by row, LLaMA-Factory's `predict` vs our `prediction`),
  - the wall-time ratio of the whole command (start-up, loading, generation, metrics),
  - the ratio of the in-process evaluation time (LLaMA-Factory's `predict_runtime` vs our loss pass
    plus generation; ours does strictly more: it also computes the eval loss).

Runs unchanged on CPU and on CUDA/ROCm: on GPUs our evaluation uses one process per visible GPU and
LLaMA-Factory's launcher starts torchrun over the same GPUs; both generate in bf16.

    python bench/eval.py --run-dir results/demo --threads 1        # the demo's tuned model, on CPU
    python bench/eval.py --model /models/llama-1b --heldout rows.json --template default \
        --max-rows 512 --max-new-tokens 128 --batch-size 64 --lf-batch-size 8 --lf-batch-size 64

LLaMA-Factory runs once per --lf-batch-size (default: 1, the value of its own example predict
config examples/train_lora/llama3_lora_predict.yaml, and our batch size). Each run is timed as a
whole command (wall and CPU seconds) and by its own in-process clock. Results go to
bench/results/eval-<cpu|gpu>-<date>.json with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from llmft.config import validate  # noqa: E402
from llmft.io import read_json, read_jsonl, write_json, write_jsonl  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_timed(cmd: list[str], log: Path, env: dict) -> dict:
    """Run a command; wall seconds and the peak RSS of its largest process (KiB -> MiB)."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        sys.exit(f"command failed ({rc}): {shlex.join(cmd)}\n{log.read_text()[-3000:]}")
    # CPU seconds (user + system, the process and its waited-for children) are the steadier measure
    # on a machine shared with other jobs: wall time there mostly measures the neighbours.
    return {
        "wall_s": round(wall, 3),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
    }


def machine() -> dict:
    import torch

    info = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_start": os.getloadavg(),
    }
    try:
        info["cpu_model"] = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", help="a finished run: uses its sft/model and data/heldout.jsonl")
    ap.add_argument("--model", help="model folder (default: RUN_DIR/sft/model)")
    ap.add_argument("--heldout", help="alpaca .jsonl or .json array (default: RUN_DIR/data/heldout.jsonl)")
    ap.add_argument("--template", default="default", help="LLaMA-Factory template of the model")
    ap.add_argument("--max-rows", type=int, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=64, help="our batch size (per process)")
    ap.add_argument(
        "--lf-batch-size",
        type=int,
        action="append",
        help="LLaMA-Factory per_device_eval_batch_size, repeatable (default: 1, as in its example "
        "predict config examples/train_lora/llama3_lora_predict.yaml, and ours)",
    )
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for both tools (0: leave as is)")
    ap.add_argument("--cutoff-len", type=int, default=4096, help="LLaMA-Factory cutoff_len (no row is cut)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-match", type=float, default=1.0, help="fail below this greedy match rate")
    ap.add_argument(
        "--out", default="", help="result JSON (default: bench/results/eval-<device>-<date>.json)"
    )
    args = ap.parse_args()

    import torch

    if not (args.run_dir or (args.model and args.heldout)):
        ap.error("give --run-dir, or --model and --heldout")
    model = Path(args.model or Path(args.run_dir) / "sft/model").resolve()
    heldout = Path(args.heldout or Path(args.run_dir) / "data/heldout.jsonl")
    lf_sizes = list(dict.fromkeys(args.lf_batch_size or [1, args.batch_size]))
    gpu = torch.cuda.is_available()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    work = (REPO / "bench/work" / f"eval-{stamp}").resolve()
    data_dir = work / "data"
    data_dir.mkdir(parents=True)

    # Both tools read the same file: the first max_rows rows, in the same order.
    rows = (json.loads(heldout.read_text()) if heldout.suffix == ".json" else read_jsonl(heldout))[
        : args.max_rows
    ]
    write_jsonl(data_dir / "heldout.jsonl", rows)
    columns = {"prompt": "instruction", "query": "input", "response": "output"}
    # Multi-turn and system-prompt rows: declared only when present (LLaMA-Factory's loader fails on
    # a declared column that no row has).
    columns |= {k: k for k in ("system", "history") if any(k in r for r in rows)}
    write_json(
        data_dir / "dataset_info.json", {"heldout": {"file_name": "heldout.jsonl", "columns": columns}}
    )

    cfg = validate(
        {
            "model": {"template": args.template},
            "eval": {
                "max_rows": len(rows),
                "batch_size": args.batch_size,
                "max_new_tokens": args.max_new_tokens,
            },
        }
    )
    ours_cmd = [
        sys.executable,
        "-m",
        "llmft",
        "evaluate",
        "--config-json",
        json.dumps(cfg),
        "--model",
        str(model),
        "--heldout",
        str(data_dir / "heldout.jsonl"),
        "--out-dir",
        str(work / "ours"),
        "--label",
        "bench",
    ]
    lf_args = {
        "model_name_or_path": str(model),
        "stage": "sft",
        "do_predict": True,
        "finetuning_type": "full",
        "eval_dataset": "heldout",
        "dataset_dir": str(data_dir),
        "template": args.template,
        "cutoff_len": args.cutoff_len,
        "max_samples": len(rows),
        "overwrite_output_dir": True,
        "predict_with_generate": True,
        "do_sample": False,
        "max_new_tokens": args.max_new_tokens,
        "report_to": "none",
    }
    if gpu:
        lf_args["bf16"] = True  # our evaluation generates in bf16 on GPUs

    env = dict(os.environ, **OFFLINE)
    env["PYTHONPATH"] = str(REPO / "workflow") + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    info = machine()
    print(f"[bench] {len(rows)} rows, model {model}, work dir {work}", flush=True)

    def lf_command(bs: int) -> list[str]:
        cfg_path = work / f"lf-bs{bs}.yaml"
        # JSON is YAML; each batch size writes its own output folder.
        cfg_path.write_text(
            json.dumps(
                {**lf_args, "per_device_eval_batch_size": bs, "output_dir": str(work / f"lf-bs{bs}")},
                indent=2,
            )
        )
        return [str(Path(sys.executable).parent / "llamafactory-cli"), "train", str(cfg_path)]

    tools = {"ours": ours_cmd} | {f"lf-bs{bs}": lf_command(bs) for bs in lf_sizes}
    runs: dict[str, list[dict]] = {name: [] for name in tools}
    names = list(tools)
    for r in range(args.repeats):
        # Rotate which tool goes first: a load spike from a neighbour hits all of them alike.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            res = run_timed(tools[name], work / f"{name}-{r}.log", env)
            if name == "ours":
                m = read_json(work / "ours/metrics.json")
                res["eval_s"] = round(m["loss_seconds"] + m["generate_seconds"], 3)
                res["generate_s"] = m["generate_seconds"]
            else:
                res["eval_s"] = round(read_json(work / name / "predict_results.json")["predict_runtime"], 3)
            runs[name].append(res)
            print(f"[bench] repeat {r} {name}: {res}", flush=True)

    def med(name, key):
        return statistics.median(r[key] for r in runs[name])

    ours = read_jsonl(work / "ours/predictions.jsonl")
    comparisons = {}
    for bs in lf_sizes:
        name = f"lf-bs{bs}"
        lf = read_jsonl(work / name / "generated_predictions.jsonl")
        if len(ours) != len(lf):
            sys.exit(f"row counts differ: ours {len(ours)}, {name} {len(lf)}")
        aligned = sum(o["reference"].strip() == p["label"].strip() for o, p in zip(ours, lf, strict=True))
        if aligned != len(ours):
            sys.exit(f"rows are not aligned: {len(ours) - aligned} references differ from {name}'s labels")
        same = [o["prediction"].strip() == p["predict"].strip() for o, p in zip(ours, lf, strict=True)]
        comparisons[name] = {
            "per_device_eval_batch_size": bs,
            "match_rate": round(sum(same) / len(same), 4),
            "identical_rows": sum(same),
            "mismatches": [
                {
                    "index": i,
                    "ours": o["prediction"],
                    "llamafactory": p["predict"],
                    "reference": o["reference"],
                }
                for i, (o, p, s) in enumerate(zip(ours, lf, same, strict=True))
                if not s
            ][:20],
            "median_wall_s": med(name, "wall_s"),
            "median_eval_s": med(name, "eval_s"),
            "median_cpu_s": med(name, "cpu_s"),
            "ratio_wall": round(med(name, "wall_s") / med("ours", "wall_s"), 2),
            "ratio_cpu": round(med(name, "cpu_s") / med("ours", "cpu_s"), 2),
            "ratio_eval": round(med(name, "eval_s") / max(med("ours", "eval_s"), 1e-6), 2),
        }

    result = {
        "bench": "held-out evaluation: llmft evaluate vs LLaMA-Factory do_predict + predict_with_generate",
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": stamp,
        "machine": {**info, "load_average_end": os.getloadavg()},
        "omp_num_threads": env.get("OMP_NUM_THREADS", "unset"),
        "model": str(model),
        "rows": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "ours": {
            "batch_size": args.batch_size,
            "processes": read_json(work / "ours/metrics.json")["processes"],
            "median_wall_s": med("ours", "wall_s"),
            "median_cpu_s": med("ours", "cpu_s"),
            "median_eval_s": med("ours", "eval_s"),
        },
        "llamafactory": comparisons,
        "repeats": args.repeats,
        "runs": runs,
    }
    device = "gpu" if gpu else "cpu"
    out = Path(args.out or REPO / f"bench/results/eval-{device}-{stamp[:8]}.json")
    write_json(out, result)
    lines = []
    ours_wall, ours_eval = med("ours", "wall_s"), med("ours", "eval_s")
    for c in comparisons.values():
        lines.append(
            f"[bench] vs LLaMA-Factory per_device_eval_batch_size {c['per_device_eval_batch_size']}: "
            f"greedy outputs identical {c['identical_rows']}/{len(ours)} (match rate {c['match_rate']:.4f}); "
            f"whole command {c['median_wall_s']:.2f}s vs ours {ours_wall:.2f}s -> {c['ratio_wall']}x "
            f"(CPU seconds {c['median_cpu_s']:.2f} vs {med('ours', 'cpu_s'):.2f} -> {c['ratio_cpu']}x); "
            f"evaluation itself {c['median_eval_s']:.2f}s vs ours {ours_eval:.2f}s -> {c['ratio_eval']}x"
        )
    print("\n".join(lines) + f"\n[bench] saved {out}")
    worst = min(c["match_rate"] for c in comparisons.values())
    return 0 if worst >= args.min_match else 1


if __name__ == "__main__":
    sys.exit(main())
