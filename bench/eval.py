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
bench/results/eval_<machine>_<date>T<time>.json (machine: cpu<cores> or <gpu>x<count>, e.g. h200x1)
with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from llmft.core.config import validate  # noqa: E402
from llmft.core.io import read_json, read_jsonl, write_json, write_jsonl  # noqa: E402
from llmft.sft.run import worker_pids  # noqa: E402

# Seconds of a --budget kept for reading the outputs and writing the result.
BUDGET_MARGIN_S = 3
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_timed(cmd: list[str], log: Path, env: dict, timeout: float = 0) -> dict:
    """Run a command; wall seconds and the peak RSS of its largest process (KiB -> MiB). Past
    `timeout` seconds (0: none) its whole process group is killed and the run says so."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if timeout and time.perf_counter() - t0 > timeout:
                # torchrun puts its workers in sessions of their own: the whole tree, then the group.
                for pid in [*worker_pids(proc.pid), proc.pid]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                os.wait4(proc.pid, 0)
                return {"timed_out": True, "wall_s": round(time.perf_counter() - t0, 3)}
            time.sleep(0.05)
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


def machine_tag(info: dict) -> str:
    """The machine part of a result's name (bench/README.md): h200x1, h200x2, cpu2."""
    gpus = info.get("gpus") or []
    if gpus:
        return f"{gpus[0].split()[-1].lower()}x{len(gpus)}"
    return f"cpu{info.get('cpu_count')}"


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


def fp32_view(model: Path, folder: Path) -> Path:
    """The model as a float32 checkpoint for LLaMA-Factory, which loads the dtype the config names
    (torch_dtype "auto"; its infer_dtype does not reach the load): the same weight files linked,
    with a config.json that says float32. Ours reads the same folder."""
    cfg = json.loads((model / "config.json").read_text())
    if cfg.get("dtype", cfg.get("torch_dtype")) == "float32":
        return model
    folder.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f.resolve())
    cfg["dtype"] = "float32"
    cfg.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


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
    ap.add_argument(
        "--ours-decoding",
        action="append",
        choices=["dynamic", "static", "graphs", "auto", "static:inductor", "static:cudagraphs"],
        help="our eval.decoding, repeatable: each is its own tool; the first is the one LLaMA-Factory's "
        "outputs are matched against (default: auto, the config default: graphs on GPUs, dynamic on CPU); "
        "static:BACKEND also sets the compiler of the decoding step (LLMFT_EVAL_COMPILE_BACKEND). "
        "Variants after the first run after LLaMA-Factory within a repeat",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=0,
        help="seconds for the whole bench: each run gets what is left (less a margin), and runs that "
        "no longer fit are recorded as timed out (0: no limit)",
    )
    ap.add_argument(
        "--tool-timeout",
        type=float,
        default=0,
        help="seconds one tool run may take; a run past it is killed and recorded, and that tool is "
        "left out of the comparisons (0: no limit)",
    )
    ap.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="both tools' weights and compute: our eval.precision, LLaMA-Factory's bf16 flag or "
        "infer_dtype float32 (auto: bf16 on GPUs, fp32 on CPU)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-match", type=float, default=1.0, help="fail below this greedy match rate")
    ap.add_argument(
        "--out", default="", help="result JSON (default: bench/results/eval_<machine>_<date>T<time>.json)"
    )
    args = ap.parse_args()

    import torch

    if not (args.run_dir or (args.model and args.heldout)):
        ap.error("give --run-dir, or --model and --heldout")
    model = Path(args.model or Path(args.run_dir) / "sft/model").resolve()
    heldout = Path(args.heldout or Path(args.run_dir) / "data/heldout.jsonl")
    lf_sizes = list(dict.fromkeys(args.lf_batch_size or [1, args.batch_size]))
    decodings = list(dict.fromkeys(args.ours_decoding or ["auto"]))
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

    def ours_command(spec: str, out_dir: Path) -> list[str]:
        decoding = spec.split(":")[0]
        cfg = validate(
            {
                "model": {"template": args.template},
                "eval": {
                    "max_rows": len(rows),
                    "batch_size": args.batch_size,
                    "max_new_tokens": args.max_new_tokens,
                    "decoding": decoding,
                    "precision": precision,
                },
            }
        )
        return [
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
            str(out_dir),
            "--label",
            "bench",
        ]

    # The first decoding is "ours"; the others are "ours-<decoding>", each writing its own folder.
    ours_dirs = {
        ("ours" if k == 0 else f"ours-{d.replace(':', '-')}"): work
        / ("ours" if k == 0 else f"ours-{d.replace(':', '-')}")
        for k, d in enumerate(decodings)
    }
    precision = args.precision if args.precision != "auto" else ("bf16" if gpu else "fp32")
    if precision == "fp32":
        model = fp32_view(model, work / "model-fp32")
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
    if precision == "bf16":
        lf_args["bf16"] = True
    else:
        lf_args["infer_dtype"] = "float32"  # predict-only: LLaMA-Factory's compute dtype

    env = dict(os.environ, **OFFLINE)
    env["PYTHONPATH"] = str(REPO / "workflow") + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    t_bench = time.perf_counter()
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
        # Next to this Python in a venv; on PATH where the wheels went elsewhere (pip --target).
        cli = Path(sys.executable).parent / "llamafactory-cli"
        return [
            str(cli) if cli.exists() else shutil.which("llamafactory-cli") or str(cli),
            "train",
            str(cfg_path),
        ]

    ours_tools = {
        name: ours_command(d, ours_dirs[name]) for name, d in zip(ours_dirs, decodings, strict=True)
    }
    lf_tools = {f"lf-bs{bs}": lf_command(bs) for bs in lf_sizes}
    # Our main variant, then LLaMA-Factory, then our other variants (with a budget, the extras are
    # the ones that may not fit).
    tools = {"ours": ours_tools["ours"]} | lf_tools | ours_tools
    tool_env = {
        name: dict(env, LLMFT_EVAL_COMPILE_BACKEND=d.split(":")[1]) if ":" in d else env
        for name, d in zip(ours_dirs, decodings, strict=True)
    }
    runs: dict[str, list[dict]] = {name: [] for name in tools}
    names = list(tools)
    timed_out: set[str] = set()
    for r in range(args.repeats):
        # Rotate which tool goes first: a load spike from a neighbour hits all of them alike.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name in timed_out:
                continue
            limit = args.tool_timeout or float("inf")
            if args.budget:
                limit = min(limit, args.budget - (time.perf_counter() - t_bench) - BUDGET_MARGIN_S)
                if limit < 1:
                    timed_out.add(name)
                    print(f"[bench] repeat {r} {name}: skipped, the budget is spent", flush=True)
                    continue
            res = run_timed(
                tools[name],
                work / f"{name}-{r}.log",
                tool_env.get(name, env),
                0 if limit == float("inf") else limit,
            )
            if res.get("timed_out"):
                timed_out.add(name)
                print(f"[bench] repeat {r} {name}: killed after {res['wall_s']:.0f}s", flush=True)
                continue
            if name in ours_dirs:
                m = read_json(ours_dirs[name] / "metrics.json")
                res["eval_s"] = round(m["loss_seconds"] + m["generate_seconds"], 3)
                res["generate_s"] = m["generate_seconds"]
                res["first_batch_s"] = m.get("first_batch_seconds")
                for key in ("setup", "start_delay", "load"):
                    res[f"{key}_s"] = m.get(f"{key}_seconds")
                res["setup_breakdown_s"] = m.get("setup_breakdown_seconds")
                res["decoding"] = m.get("decoding")
                res["processes"] = m["processes"]
            else:
                res["eval_s"] = round(read_json(work / name / "predict_results.json")["predict_runtime"], 3)
            runs[name].append(res)
            print(f"[bench] repeat {r} {name}: {res}", flush=True)

    def med(name, key):
        return statistics.median(r[key] for r in runs[name])

    def same_rows(a: list[dict], b: list[dict], key_b: str) -> list[bool]:
        return [x["prediction"].strip() == y[key_b].strip() for x, y in zip(a, b, strict=True)]

    def ratios(name: str) -> dict:
        """LLaMA-Factory's time over each of our variants' (median of the repeats)."""
        out = {}
        for ours_name in done_ours:
            suffix = "" if ours_name == "ours" else "_vs_" + ours_name
            out[f"ratio_wall{suffix}"] = round(med(name, "wall_s") / med(ours_name, "wall_s"), 2)
            out[f"ratio_cpu{suffix}"] = round(med(name, "cpu_s") / med(ours_name, "cpu_s"), 2)
            out[f"ratio_eval{suffix}"] = round(med(name, "eval_s") / max(med(ours_name, "eval_s"), 1e-6), 2)
        return out

    if "ours" in timed_out:
        sys.exit(f"our evaluation ({decodings[0]}) did not finish in time: {runs}")
    done_ours = [n for n in ours_dirs if n not in timed_out]
    ours = read_jsonl(work / "ours/predictions.jsonl")
    variants = {}
    for name in done_ours:
        m = read_json(ours_dirs[name] / "metrics.json")
        other = read_jsonl(ours_dirs[name] / "predictions.jsonl")
        same = same_rows(other, ours, "prediction")
        variants[name] = {
            "decoding_asked": decodings[list(ours_dirs).index(name)],
            "decoding_ran": m.get("decoding"),
            "processes": m["processes"],
            "identical_to_ours": sum(same),
            "median_wall_s": med(name, "wall_s"),
            "median_cpu_s": med(name, "cpu_s"),
            "median_eval_s": med(name, "eval_s"),
            "median_generate_s": med(name, "generate_s"),
            # The first batch carries torch.compile's and the cache's set-up with static decoding.
            "median_first_batch_s": med(name, "first_batch_s"),
        }
    comparisons = {}
    for bs in lf_sizes:
        name = f"lf-bs{bs}"
        if name in timed_out:
            comparisons[name] = {"per_device_eval_batch_size": bs, "timed_out_after_s": args.tool_timeout}
            continue
        lf = read_jsonl(work / name / "generated_predictions.jsonl")
        if len(ours) != len(lf):
            sys.exit(f"row counts differ: ours {len(ours)}, {name} {len(lf)}")
        aligned = sum(o["reference"].strip() == p["label"].strip() for o, p in zip(ours, lf, strict=True))
        if aligned != len(ours):
            sys.exit(f"rows are not aligned: {len(ours) - aligned} references differ from {name}'s labels")
        same = same_rows(ours, lf, "predict")
        comparisons[name] = {
            "per_device_eval_batch_size": bs,
            "match_rate": round(sum(same) / len(same), 4),
            "identical_rows": sum(same),
            "identical_rows_by_ours_variant": {
                v: sum(same_rows(read_jsonl(ours_dirs[v] / "predictions.jsonl"), lf, "predict"))
                for v in done_ours
            },
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
            **ratios(name),
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
        "precision": precision,
        "ours": {"batch_size": args.batch_size, **variants["ours"]},
        "ours_variants": variants,
        "timed_out": sorted(timed_out),
        "budget_s": args.budget or None,
        "bench_seconds": round(time.perf_counter() - t_bench, 1),
        "llamafactory": comparisons,
        "repeats": args.repeats,
        "runs": runs,
    }
    out = Path(args.out or REPO / f"bench/results/eval_{machine_tag(result['machine'])}_{stamp}.json")
    write_json(out, result)
    lines = []
    for name, v in variants.items():
        lines.append(
            f"[bench] {name} ({v['decoding_ran']} decoding): whole command {v['median_wall_s']:.2f}s "
            f"({v['median_cpu_s']:.2f} CPU s), evaluation {v['median_eval_s']:.2f}s (generation "
            f"{v['median_generate_s']:.2f}s, first batch {v['median_first_batch_s']:.2f}s); "
            f"identical to ours {v['identical_to_ours']}/{len(ours)}"
        )
    ours_wall, ours_eval = med("ours", "wall_s"), med("ours", "eval_s")
    for c in comparisons.values():
        if "timed_out_after_s" in c:
            lines.append(f"[bench] LLaMA-Factory batch {c['per_device_eval_batch_size']}: timed out")
            continue
        lines.append(
            f"[bench] vs LLaMA-Factory per_device_eval_batch_size {c['per_device_eval_batch_size']}: "
            f"greedy outputs identical {c['identical_rows']}/{len(ours)} (match rate {c['match_rate']:.4f}); "
            f"whole command {c['median_wall_s']:.2f}s vs ours {ours_wall:.2f}s -> {c['ratio_wall']}x "
            f"(CPU seconds {c['median_cpu_s']:.2f} vs {med('ours', 'cpu_s'):.2f} -> {c['ratio_cpu']}x); "
            f"evaluation itself {c['median_eval_s']:.2f}s vs ours {ours_eval:.2f}s -> {c['ratio_eval']}x"
            + "".join(
                f"; vs {v}: whole {c['ratio_wall_vs_' + v]}x, evaluation {c['ratio_eval_vs_' + v]}x"
                for v in done_ours
                if v != "ours"
            )
        )
    print("\n".join(lines) + f"\n[bench] saved {out}")
    rates = [c["match_rate"] for c in comparisons.values() if "match_rate" in c]
    return 0 if rates and min(rates) >= args.min_match else 1


if __name__ == "__main__":
    sys.exit(main())
