"""Continue vs retrain on a nightly with 5 % new rows (the CPU demo task, the whole pipeline).

Three runs of the real workflow (`snakemake --profile profiles/local`) in a scratch working directory,
on distinct rows of the demo's synthetic task (the generator repeats rows; repeats are dropped here so
"5 % new" means 5 % new content):

- night1: from the base model on the first N rows;
- retrain: from the base model on those N rows plus 5 % appended (night 2, today's nightly);
- continue: the same rows, model.continue_from: results/night1 (the new rows plus replayed rows of
  night1, nightly.replay_fraction of what it trains, at the continue learning rate).

Token ratio = full_retrain / trained of the continued run's summary.json lineage.tokens, the figure its
plan and page print: the tokens the trainer feeds each run (epochs x one pass's prompt + answer tokens
x row weight, each pass's last micro-batches filled with repeated rows; config/README.md, Continuing
from an earlier run). Beside it: the trainer's own counts (train_summary.json train_tokens,
LLaMA-Factory's num_input_tokens_seen, padding excluded) of the retrain and the continued run, and the
one-pass ratio of prepare_data's row tokens (what the figure was before it counted the fill). The
held-out metric is nightly.metric (exact match) of each tuned model on the same held-out split,
against nightly.tolerance; beside it the same gap row by row (evaluate's predictions.jsonl), with its
standard error, so a reader sees whether the gap is larger than the held-out split can resolve.

    python bench/continue_bench.py --rows 2000 --out bench/results/continue_cpu2_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))


def distinct_rows(n: int) -> list[dict]:
    from llmft.data.assets import synthetic_rows
    from llmft.data.prepare import content_key

    out, seen = [], set()
    for row in synthetic_rows(20 * n):
        if content_key(row) not in seen:
            seen.add(content_key(row))
            out.append(row)
            if len(out) == n:
                return out
    raise SystemExit(f"the demo generator has fewer than {n} distinct rows")


def run(work: Path, name: str, data: str, extra: dict) -> float:
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg["data"]["sources"] = [{"path": data, "format": "alpaca"}]
    cfg["model"].update(extra.get("model", {}))
    cfg["verify"] = {"canary": False}  # the environment check is not what is measured here
    (work / "config").mkdir(exist_ok=True)
    (work / "config/config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    first = work / "results/night1/env/verify.json"
    if first.is_file() and name != "night1":  # the same machine: night 1's verify_env serves the others
        (work / "results" / name / "env").mkdir(parents=True, exist_ok=True)
        shutil.copy(first, work / "results" / name / "env/verify.json")
    env = dict(os.environ, SLURM_CONF=os.devnull)
    cmd = [str(Path(sys.executable).parent / "snakemake"), "-s", str(REPO / "Snakefile"), "-d", str(work)]
    cmd += ["--profile", str(REPO / "profiles/local"), "--config", f"run={name}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
    return round(time.perf_counter() - start, 1)


def facts(work: Path, name: str, seconds: float) -> dict:
    run_dir = work / "results" / name
    summary = json.loads((run_dir / "report/summary.json").read_text())
    train = json.loads((run_dir / "sft/train_summary.json").read_text())
    return {
        "pipeline_seconds": seconds,
        "lineage": summary["lineage"],
        "trainer_tokens": train.get("train_tokens"),
        "steps": train.get("steps"),
        "train_runtime_s": summary.get("train_runtime_s"),
        "heldout_rows": summary.get("heldout_rows"),
        "tuned": summary["tuned"],
        "base": summary["base"],
    }


def paired_gap(work: Path, metric: str) -> dict | None:
    """retrain minus continue on the same held-out rows, row by row (evaluate's predictions.jsonl):
    the mean difference, its standard error (sample standard deviation of the per-row differences
    over sqrt(n)), and the rows only one of them got right. None for a metric with no per-row value
    (eval_loss is the mean token loss, not a mean over rows)."""
    import statistics

    rows = {}
    for name in ("retrain", "continue"):
        path = work / "results" / name / "eval/tuned/predictions.jsonl"
        rows[name] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    a, b = rows["retrain"], rows["continue"]
    if not a or metric not in a[0] or [r["prompt"] for r in a] != [r["prompt"] for r in b]:
        return None
    diff = [x[metric] - y[metric] for x, y in zip(a, b, strict=True)]
    n = len(diff)
    return {
        "rows": n,
        "gap": round(sum(diff) / n, 4),
        "standard_error": round(statistics.stdev(diff) / n**0.5, 4),
        "only_retrain": sum(d > 0 for d in diff),
        "only_continue": sum(d < 0 for d in diff),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000, help="night 1's distinct rows")
    parser.add_argument("--new", type=float, default=0.05, help="share of rows appended for night 2")
    parser.add_argument("--out", help="JSON file for the results")
    parser.add_argument("--keep", action="store_true", help="keep the scratch working directory")
    args = parser.parse_args()
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    from llmft.core.config import validate

    full = validate(cfg)
    tolerance, metric = full["nightly"]["tolerance"], full["nightly"]["metric"]
    rows = distinct_rows(round(args.rows * (1 + args.new)))
    work = Path(tempfile.mkdtemp(prefix="llmft-continue-bench."))
    for name, part in (("night1.jsonl", rows[: args.rows]), ("night2.jsonl", rows)):
        (work / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    out = {"rows_night1": args.rows, "rows_night2": len(rows), "metric": metric, "tolerance": tolerance}
    out["night1"] = facts(work, "night1", run(work, "night1", "night1.jsonl", {}))
    out["retrain"] = facts(work, "retrain", run(work, "retrain", "night2.jsonl", {}))
    seconds = run(work, "continue", "night2.jsonl", {"model": {"continue_from": "results/night1"}})
    out["continue"] = facts(work, "continue", seconds)
    tokens = out["continue"]["lineage"]["tokens"]
    out["token_ratio"] = round(tokens["full_retrain"] / tokens["trained"], 2)
    out["trainer_token_ratio"] = round(
        out["retrain"]["trainer_tokens"] / out["continue"]["trainer_tokens"], 2
    )
    out["one_pass_ratio"] = round(tokens["one_pass"]["full_retrain"] / tokens["one_pass"]["trained"], 2)
    gap = out["retrain"]["tuned"][metric] - out["continue"]["tuned"][metric]
    out["metric_gap"] = round(gap, 4)
    out["within_tolerance"] = gap <= tolerance
    out["paired"] = paired_gap(work, metric)
    out["machine"] = f"{platform.node()} {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
    out["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    out["command"] = " ".join(["python", "bench/continue_bench.py", *sys.argv[1:]])
    print(
        f"continue trains {tokens['trained']:,} tokens, retrain {tokens['full_retrain']:,}: "
        f"{out['token_ratio']}x fewer (trainer's counts {out['retrain']['trainer_tokens']:,} / "
        f"{out['continue']['trainer_tokens']:,} = {out['trainer_token_ratio']}x; rows' one pass "
        f"{out['one_pass_ratio']}x); held-out {metric}: "
        f"retrain {out['retrain']['tuned'][metric]:.4f}, continue {out['continue']['tuned'][metric]:.4f} "
        f"(gap {gap:+.4f}, tolerance {tolerance})"
    )
    if out["paired"]:
        p = out["paired"]
        print(
            f"row by row on the same {p['rows']} held-out rows: gap {p['gap']:+.4f}, standard error "
            f"{p['standard_error']:.4f}; {p['only_retrain']} rows only the retrain got right, "
            f"{p['only_continue']} only the continued run"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
