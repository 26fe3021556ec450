"""Continue vs retrain on a nightly with 5 % new rows (the CPU demo task, the whole pipeline).

Three runs of the real workflow (`snakemake --profile profiles/local`), each in a scratch working
directory of its own, on distinct rows of the demo's synthetic task (the generator repeats rows;
repeats are dropped here so "5 % new" means 5 % new content):

- night1: from the base model on the first N rows;
- retrain: from the base model on those N rows plus 5 % appended (night 2, today's nightly);
- continue: the same rows, model.continue_from: results/night1 (a copy of that seed's night1 run:
  the new rows plus replayed rows of night1, nightly.replay_fraction of what it trains, at the
  continue learning rate).

Token ratio = full_retrain / trained of the continued run's summary.json lineage.tokens, the figure its
plan and page print: the tokens the trainer feeds each run (epochs x one pass's prompt + answer tokens
x row weight, each pass's last micro-batches filled with repeated rows; config/README.md, Continuing
from an earlier run). Beside it: the trainer's own counts (train_summary.json train_tokens,
LLaMA-Factory's num_input_tokens_seen, padding excluded) of the retrain and the continued run, and the
one-pass ratio of prepare_data's row tokens (what the figure was before it counted the fill). The
held-out metric is nightly.metric (exact match) of each tuned model on the same held-out split,
against nightly.tolerance; beside it the same gap row by row (evaluate's predictions.jsonl), with its
standard error, so a reader sees whether the gap is larger than the held-out split can resolve.

Less noise (all optional; without them the bench runs as it always did, one triple at the config's
sft.seed, and the JSON keeps its keys):

- --set KEY=VALUE (any config key, the value read as YAML) for every run, e.g. a larger held-out split
  scored whole: --set data.heldout_fraction=0.4 --set eval.max_rows=100000; or the GPU:
  --set hardware.gpus_per_node=1 --set hardware.processes_per_node=0 --set sft.precision=bf16
  (bench/continue_gpu.sh runs it so on the device machine; the demo's fp32 fails on a GPU, where the
  planner picks FlashAttention's varlen kernel);
- --seeds 1 2 3: one night1 / retrain / continue triple per training seed (sft.seed);
- --variant NAME:KEY=VALUE[,KEY=VALUE]: one more continued run per seed, from the same night1, with
  these keys (nightly.continue_learning_rate_factor, nightly.replay_fraction, sft.num_train_epochs...);
  its token ratio is the retrain's trained tokens over its own;
- --jobs N: pipelines side by side (the first run's verify_env runs alone first; the others reuse its
  verify.json, as the serial bench always did);
- --retrain-from FILE: no retrain runs; each seed's retrain is the one FILE (an earlier result of this
  bench with the same rows and settings) recorded, for trying continued runs in less device time. Its
  predictions were not recorded, so there is no row-paired gap against it: `metric_gap` is the
  difference of the two exact matches on the same held-out rows, and `night1_as_recorded` says whether
  this call's night1 scored what FILE's did (the runs repeat to the digit on one machine; if they do
  not, the recorded retrain is not this code's);
- --resume DIR: an earlier call's working directories (kept with --keep; DIR is the folder that call
  made under --scratch): its finished runs (report/summary.json written) are read, not run again, so a
  call stopped at its deadline after the night1 runs can go on to the continued runs.

`per_seed` holds each seed's runs, gaps and paired rows; `summary` each variant's mean gap over the
seeds (`paired`: retrain minus continue, both on the same held-out rows; `vs_parent`: night1 minus
continue on the held-out rows both scored, what the nightly gate compares) and three standard errors
of it: rows = the sample standard deviation over rows of each row's difference averaged over the seeds,
/ sqrt(rows); seeds = the standard deviation of the seeds' gaps / sqrt(seeds); standard_error =
sqrt(rows^2 + seeds^2), which counts the row-by-seed noise twice and so errs large. The verdict is
one-sided at 95 %, q = Student's t quantile with seeds - 1 degrees of freedom (2.92 for three seeds;
the normal 1.645 for one seed): within tolerance when gap + q x SE <= nightly.tolerance, beyond it when
gap - q x SE > tolerance, else undecided. The top-level keys are the first seed's default continued
run, as before.

    python bench/continue_bench.py --rows 2000 --out bench/results/continue_cpu2_<date>.json
    python bench/continue_bench.py --rows 6000 --seeds 1 2 3 --jobs 9 --set data.heldout_fraction=0.4 \
        --set eval.max_rows=100000 --variant lr1:nightly.continue_learning_rate_factor=1.0 --out ...
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

# One-sided 95 % quantiles of Student's t by degrees of freedom (1-30; beyond, the one for 30); with
# no df (one seed: rows alone, thousands of them), the normal one.
T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761)
T95 += (1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701)
T95 += (1.699, 1.697)
Z95 = 1.645
DEFAULT = "default"  # the continued run with the config's own nightly keys


def distinct_rows(n: int) -> list[dict]:
    from llmft.core.assets import synthetic_rows
    from llmft.data.prepare import content_key

    out, seen = [], set()
    for row in synthetic_rows(20 * n):
        if content_key(row) not in seen:
            seen.add(content_key(row))
            out.append(row)
            if len(out) == n:
                return out
    raise SystemExit(f"the demo generator has fewer than {n} distinct rows")


def dotted(pairs: list[str]) -> dict:
    """KEY=VALUE words (KEY dotted, VALUE read as YAML) as one nested mapping."""
    out: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected KEY=VALUE, got {pair!r}")
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return out


def parse_variant(text: str) -> tuple[str, dict]:
    name, sep, keys = text.partition(":")
    if not sep or not name or name == DEFAULT:
        raise SystemExit(f"--variant NAME:KEY=VALUE[,KEY=VALUE], NAME not {DEFAULT!r}; got {text!r}")
    return name, dotted(keys.split(","))


def snakemake_command() -> list[str]:
    """Snakemake beside this interpreter (a virtual environment), else on PATH; the greedy scheduler
    where PuLP (the default ILP scheduler's solver) is not installed."""
    beside = Path(sys.executable).parent / "snakemake"
    found = str(beside) if beside.is_file() else shutil.which("snakemake")
    if not found:
        raise SystemExit("no snakemake beside this python nor on PATH")
    return [found] + (["--scheduler", "greedy"] if importlib.util.find_spec("pulp") is None else [])


def config_for(data: str | None, over: dict) -> dict:
    """config/config.yaml with `over` merged in, trained on the rows of `data` (None: its own)."""
    from llmft.core.config import deep_merge

    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    if data:
        cfg["data"]["sources"] = [{"path": data, "format": "alpaca"}]
    cfg["verify"] = {"canary": False}  # the environment check is not what is measured here
    return deep_merge(cfg, over)


def run(work: Path, name: str, data: str, over: dict, targets: tuple[str, ...] = ()) -> float:
    """One pipeline run (or only `targets` of it) in `work`, Snakemake's output in work/snakemake.log
    (snakemake_targets.log); its wall seconds."""
    (work / "config").mkdir(parents=True, exist_ok=True)
    (work / "config/config.yaml").write_text(yaml.safe_dump(config_for(data, over), sort_keys=False))
    env = dict(os.environ, SLURM_CONF=os.devnull)
    cmd = [*snakemake_command(), *targets, "-s", str(REPO / "Snakefile"), "-d", str(work)]
    cmd += ["--profile", str(REPO / "profiles/local"), "--config", f"run={name}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    (work / ("snakemake_targets.log" if targets else "snakemake.log")).write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"{name} failed in {work}:\n{proc.stderr[-4000:]}")
    return round(time.perf_counter() - start, 1)


def facts(work: Path, name: str, seconds: float) -> dict:
    run_dir = work / "results" / name
    summary = json.loads((run_dir / "report/summary.json").read_text())
    train = json.loads((run_dir / "sft/train_summary.json").read_text())
    tuned = json.loads((run_dir / "eval/tuned/metrics.json").read_text())
    return {
        "pipeline_seconds": seconds,
        "lineage": summary["lineage"],
        "trainer_tokens": train.get("train_tokens"),
        "steps": train.get("steps"),
        "train_runtime_s": summary.get("train_runtime_s"),
        "heldout_rows": summary.get("heldout_rows"),
        "tuned": summary["tuned"],
        "base": summary["base"],
        # which of the demo's tasks a gap lies in (held-out exact match per task)
        "exact_match_by_task": tuned.get("exact_match_by_task"),
    }


def predictions(work: Path, name: str) -> list[dict]:
    path = work / "results" / name / "eval/tuned/predictions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def row_diffs(a: list[dict], b: list[dict], metric: str) -> list[float] | None:
    """a minus b row by row on the same held-out rows; None for a metric with no per-row value (eval_loss
    is the mean token loss, not a mean over rows) or rows that differ."""
    if not a or metric not in a[0] or [r["prompt"] for r in a] != [r["prompt"] for r in b]:
        return None
    return [x[metric] - y[metric] for x, y in zip(a, b, strict=True)]


def parent_diffs(parent: list[dict], child: list[dict], metric: str) -> list[float] | None:
    """parent minus child on the held-out rows both scored (the child's split holds the parent's and
    the new rows' held-out rows), in the child's order: what the nightly gate compares."""
    theirs = {r["prompt"]: r[metric] for r in parent if metric in r}
    diff = [theirs[r["prompt"]] - r[metric] for r in child if metric in r and r["prompt"] in theirs]
    return diff or None


def paired_gap(diff: list[float] | None, names: tuple[str, str] = ("retrain", "continue")) -> dict | None:
    """retrain minus continue on the same held-out rows, row by row (evaluate's predictions.jsonl):
    the mean difference, its standard error (sample standard deviation of the per-row differences
    over sqrt(n)), and the rows only one of them got right."""
    if not diff:
        return None
    n = len(diff)
    return {
        "rows": n,
        "gap": round(sum(diff) / n, 4),
        "standard_error": round(statistics.stdev(diff) / n**0.5, 4),
        f"only_{names[0]}": sum(d > 0 for d in diff),
        f"only_{names[1]}": sum(d < 0 for d in diff),
    }


def pooled(diffs: list[list[float]], tolerance: float) -> dict:
    """The mean gap over seeds (each seed's row-by-row differences on the same rows), its standard
    errors over rows and over seeds, their root sum of squares, and the one-sided 95 % verdict (t with
    seeds - 1 degrees of freedom: the seeds' spread is estimated from few of them)."""
    n, seeds = len(diffs[0]), len(diffs)
    gaps = [sum(d) / n for d in diffs]
    gap = sum(gaps) / seeds
    se_rows = statistics.stdev([sum(col) / seeds for col in zip(*diffs, strict=True)]) / n**0.5
    se_seeds = statistics.stdev(gaps) / seeds**0.5 if seeds > 1 else None
    se = (se_rows**2 + (se_seeds or 0.0) ** 2) ** 0.5
    q = T95[min(seeds - 1, len(T95)) - 1] if seeds > 1 else Z95
    low, high = gap - q * se, gap + q * se
    verdict = (
        "within tolerance" if high <= tolerance else "beyond tolerance" if low > tolerance else "undecided"
    )
    return {
        "rows": n,
        "seeds": seeds,
        "gaps": [round(g, 4) for g in gaps],
        "gap": round(gap, 4),
        "standard_error_rows": round(se_rows, 4),
        "standard_error_seeds": None if se_seeds is None else round(se_seeds, 4),
        "standard_error": round(se, 4),
        "quantile": q,
        "low_95": round(low, 4),
        "high_95": round(high, 4),
        "verdict": verdict,
    }


def mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


class Bench:
    """The runs of every seed and variant, their results as they finish, and the JSON made of them."""

    def __init__(self, args: argparse.Namespace, scratch: Path):
        from llmft.core.config import validate

        self.args, self.scratch = args, scratch
        self.settings = dotted(args.set)
        self.variants = {DEFAULT: {}, **dict(parse_variant(v) for v in args.variant)}
        full = validate(config_for(None, self.settings))
        self.tolerance, self.metric = full["nightly"]["tolerance"], full["nightly"]["metric"]
        self.seeds = args.seeds or [full["sft"]["seed"]]
        self.rows = distinct_rows(round(args.rows * (1 + args.new)))
        self.done: dict[tuple[int, str], dict] = {}
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.verify_json = self.work(self.seeds[0], "night1") / "results/night1/env/verify.json"
        self.recorded = recorded_runs(args.retrain_from) if args.retrain_from else {}
        if missing := [s for s in self.seeds if s not in self.recorded and args.retrain_from]:
            raise SystemExit(f"--retrain-from {args.retrain_from} has no retrain of seed(s) {missing}")
        self.start = time.perf_counter()

    def work(self, seed: int, name: str) -> Path:
        return self.scratch / f"seed{seed}" / name

    def overrides(self, seed: int, extra: dict | None = None) -> dict:
        from llmft.core.config import deep_merge

        over = deep_merge(self.settings, extra or {})
        return over if self.args.seeds is None else deep_merge(over, {"sft": {"seed": seed}})

    def prepare(self, seed: int, name: str, data: str) -> Path:
        work = self.work(seed, name)
        work.mkdir(parents=True, exist_ok=True)
        part = self.rows[: self.args.rows] if data == "night1.jsonl" else self.rows
        (work / data).write_text("".join(json.dumps(r) + "\n" for r in part))
        return work

    def verify(self) -> None:
        """The first run's verify_env alone, before any pipeline runs beside it."""
        if self.args.resume and self.verify_json.is_file():
            return
        seed = self.seeds[0]
        work = self.prepare(seed, "night1", "night1.jsonl")
        run(work, "night1", "night1.jsonl", self.overrides(seed), ("results/night1/env/verify.json",))

    def task(self, seed: int, name: str, data: str, extra: dict, parent: Future | None = None) -> None:
        try:
            if parent is not None:
                parent.result()
            if self.args.deadline and time.perf_counter() - self.start > self.args.deadline:
                raise RuntimeError(f"{name} of seed {seed} not started: past --deadline")
            done = self.work(seed, name) / "results" / name / "report/summary.json"
            if self.args.resume and done.is_file():  # a finished run of the call --resume names
                self.finish(seed, name, facts(self.work(seed, name), name, 0.0))
                return
            work = self.prepare(seed, name, data)
            if parent is not None:
                dest = work / "results/night1"
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(self.work(seed, "night1") / "results/night1", dest, symlinks=True)
            env_dir = work / "results" / name / "env"
            if not (env_dir / "verify.json").is_file():
                env_dir.mkdir(parents=True, exist_ok=True)
                shutil.copy(self.verify_json, env_dir / "verify.json")
            seconds = run(work, name, data, self.overrides(seed, extra))
            self.finish(seed, name, facts(work, name, seconds))
        except Exception as exc:
            with self.lock:
                self.errors.append(f"seed {seed} {name}: {exc}")
                print(f"seed {seed} {name}: {exc}", file=sys.stderr, flush=True)
                self.write()
            raise

    def finish(self, seed: int, name: str, got: dict) -> None:
        got["predictions"] = predictions(self.work(seed, name), name)
        seconds = got["pipeline_seconds"]
        with self.lock:
            self.done[(seed, name)] = got
            print(
                f"[{time.perf_counter() - self.start:6.0f} s] seed {seed} {name}: {seconds} s, "
                f"{self.metric} {got['tuned'].get(self.metric)}",
                flush=True,
            )
            self.write()

    def execute(self) -> None:
        self.verify()
        with ThreadPoolExecutor(max_workers=self.args.jobs) as pool:
            nights = {}
            for seed in self.seeds:
                nights[seed] = pool.submit(self.task, seed, "night1", "night1.jsonl", {})
                if seed not in self.recorded:
                    pool.submit(self.task, seed, "retrain", "night2.jsonl", {})
            for variant, keys in self.variants.items():
                extra = {**keys, "model": {**keys.get("model", {}), "continue_from": "results/night1"}}
                for seed in self.seeds:
                    pool.submit(self.task, seed, continued(variant), "night2.jsonl", extra, nights[seed])

    def retrain_of(self, seed: int) -> dict | None:
        """This call's retrain of `seed`, else the one --retrain-from recorded (no predictions)."""
        if got := self.done.get((seed, "retrain")):
            return got
        if rec := self.recorded.get(seed):
            return {**rec["retrain"], "predictions": []}
        return None

    def seed_result(self, seed: int) -> dict | None:
        night1, retrain = self.done.get((seed, "night1")), self.retrain_of(seed)
        if not retrain:
            return None
        out = {"seed": seed, "night1": slim(night1), "retrain": slim(retrain), "continue": {}, "variants": {}}
        if seed in self.recorded:
            was = self.recorded[seed]["night1"]["tuned"].get(self.metric)
            out["retrain_recorded"] = self.args.retrain_from
            out["night1_as_recorded"] = bool(night1) and night1["tuned"].get(self.metric) == was
        em = {
            "night1": night1 and night1["tuned"].get(self.metric),
            "retrain": retrain["tuned"].get(self.metric),
        }
        for variant in self.variants:
            got = self.done.get((seed, continued(variant)))
            if not got:
                continue
            out["continue"][variant] = slim(got)
            em[continued(variant)] = got["tuned"].get(self.metric)
            diff = row_diffs(retrain["predictions"], got["predictions"], self.metric)
            out["variants"][variant] = {
                "token_ratio": round(
                    retrain["lineage"]["tokens"]["trained"] / got["lineage"]["tokens"]["trained"], 2
                ),
                "trainer_token_ratio": round(retrain["trainer_tokens"] / got["trainer_tokens"], 2),
                "metric_gap": round(retrain["tuned"][self.metric] - got["tuned"][self.metric], 4),
                "paired": paired_gap(diff),
                "diffs": diff,
                "parent_diffs": night1
                and parent_diffs(night1["predictions"], got["predictions"], self.metric),
            }
        out[self.metric] = em
        return out

    def result(self) -> dict:
        args, metric = self.args, self.metric
        out = {
            "rows_night1": args.rows,
            "rows_night2": len(self.rows),
            "metric": metric,
            "tolerance": self.tolerance,
        }
        per_seed = [r for r in (self.seed_result(s) for s in self.seeds) if r]
        first = self.seeds[0]
        night1, cont = self.done.get((first, "night1")), self.done.get((first, "continue"))
        retrain = self.retrain_of(first)
        for key, got in (("night1", night1), ("retrain", retrain), ("continue", cont)):
            if got:
                out[key] = slim(got)
        if retrain and cont:
            tokens = cont["lineage"]["tokens"]
            out["token_ratio"] = round(tokens["full_retrain"] / tokens["trained"], 2)
            out["trainer_token_ratio"] = round(retrain["trainer_tokens"] / cont["trainer_tokens"], 2)
            out["one_pass_ratio"] = round(
                tokens["one_pass"]["full_retrain"] / tokens["one_pass"]["trained"], 2
            )
            gap = retrain["tuned"][metric] - cont["tuned"][metric]
            out["metric_gap"] = round(gap, 4)
            out["within_tolerance"] = gap <= self.tolerance
            out["paired"] = paired_gap(row_diffs(retrain["predictions"], cont["predictions"], metric))
        out["seeds"] = self.seeds
        out["settings"] = self.settings
        out["variants"] = self.variants
        out["summary"] = {v: self.variant_summary(v, per_seed) for v in self.variants}
        for r in per_seed:
            for v in r["variants"].values():
                v["parent_paired"] = paired_gap(v.pop("parent_diffs"), ("night1", "continue"))
                v.pop("diffs")
        out["per_seed"] = per_seed
        out["errors"] = self.errors
        out["wall_seconds"] = round(time.perf_counter() - self.start, 1)
        out["machine"] = machine()
        out["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
        out["command"] = " ".join(["python", "bench/continue_bench.py", *sys.argv[1:]])
        return out

    def variant_summary(self, variant: str, per_seed: list[dict]) -> dict:
        have = [r for r in per_seed if variant in r["variants"]]
        diffs = [r["variants"][variant]["diffs"] for r in have]
        parent = [r["variants"][variant]["parent_diffs"] for r in have]
        ratios = [r["variants"][variant]["token_ratio"] for r in have]
        gaps = [r["variants"][variant]["metric_gap"] for r in have]
        name = continued(variant)
        return {
            "metric_gap": {"per_seed": gaps, "mean": mean(gaps)},
            "overrides": self.variants[variant],
            "seeds": [r["seed"] for r in have],
            "token_ratio": {"per_seed": ratios, "mean": mean(ratios), "min": min(ratios, default=None)},
            f"mean_{self.metric}": {
                k: mean([r[self.metric][k] for r in have if r[self.metric].get(k) is not None])
                for k in ("night1", "retrain", name)
            },
            "paired": pooled(diffs, self.tolerance) if complete(diffs) else None,
            "vs_parent": pooled(parent, self.tolerance) if complete(parent) else None,
        }

    def write(self) -> None:
        if self.args.out:
            Path(self.args.out).write_text(json.dumps(self.result(), indent=2) + "\n")


def recorded_runs(path: str) -> dict[int, dict]:
    """Each seed's night1 and retrain as an earlier result of this bench recorded them."""
    return {r["seed"]: r for r in json.loads(Path(path).read_text())["per_seed"] if r.get("retrain")}


def complete(diffs: list[list[float] | None]) -> bool:
    """Every seed's differences there, on as many rows (the same data: the same held-out rows)."""
    return bool(diffs) and all(d is not None and len(d) == len(diffs[0]) for d in diffs)


def continued(variant: str) -> str:
    return "continue" if variant == DEFAULT else f"continue_{variant}"


def slim(got: dict | None) -> dict | None:
    return None if got is None else {k: v for k, v in got.items() if k != "predictions"}


@functools.cache
def machine() -> str:
    cpu = f"{platform.node()} {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
    try:
        gpus = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return cpu
    gpus = [g.strip() for g in gpus if g.strip()]
    return f"{cpu}; {len(gpus)} x {gpus[0]}" if gpus else cpu


def report(out: dict) -> None:
    metric, tolerance = out["metric"], out["tolerance"]
    if "paired" in out:
        tokens = out["continue"]["lineage"]["tokens"]
        retrain, cont = out["retrain"], out["continue"]
        print(
            f"continue trains {tokens['trained']:,} tokens, retrain {tokens['full_retrain']:,}: "
            f"{out['token_ratio']}x fewer (trainer's counts {retrain['trainer_tokens']:,} / "
            f"{cont['trainer_tokens']:,} = {out['trainer_token_ratio']}x; rows' one pass "
            f"{out['one_pass_ratio']}x); held-out {metric}: "
            f"retrain {retrain['tuned'][metric]:.4f}, continue {cont['tuned'][metric]:.4f} "
            f"(gap {out['metric_gap']:+.4f}, tolerance {tolerance})"
        )
    if out.get("paired"):
        p = out["paired"]
        print(
            f"row by row on the same {p['rows']} held-out rows: gap {p['gap']:+.4f}, standard error "
            f"{p['standard_error']:.4f}; {p['only_retrain']} rows only the retrain got right, "
            f"{p['only_continue']} only the continued run"
        )
    for r in out["per_seed"]:
        runs = {"night1": r["night1"], "retrain": r["retrain"]}
        runs.update({continued(v): got for v, got in r["continue"].items()})
        by_task = [
            f"{name} {got['exact_match_by_task']}"
            for name, got in runs.items()
            if got and got.get("exact_match_by_task")
        ]
        if by_task:
            print(f"seed {r['seed']}, {metric} by task: " + "; ".join(by_task))
    if len(out["seeds"]) == 1 and len(out["variants"]) == 1:
        return
    for variant, s in out["summary"].items():
        p, em, ratio = s["paired"], s[f"mean_{metric}"], s["token_ratio"]
        keys = f" {json.dumps(s['overrides'])}" if s["overrides"] else ""
        head = (
            f"{variant}{keys}: seeds {s['seeds']}, token ratio mean {ratio['mean']}x "
            f"(min {ratio['min']}x); mean {metric} night1 {em['night1']}, retrain {em['retrain']}, "
            f"continue {em[continued(variant)]}"
        )
        if not p:
            gap = s["metric_gap"]
            print(
                f"{head}; retrain - continue {gap['per_seed']}, mean {gap['mean']} (no row-paired "
                "gap: a recorded retrain, or rows missing)"
            )
        else:
            print(
                f"{head}; gaps {p['gaps']}, mean {p['gap']:+.4f} on {p['rows']} rows, SE "
                f"{p['standard_error']:.4f} (rows {p['standard_error_rows']}, seeds "
                f"{p['standard_error_seeds']}), 95 % one-sided [{p['low_95']:+.4f}, {p['high_95']:+.4f}] "
                f"vs tolerance {tolerance}: {p['verdict']}"
            )
        if q := s["vs_parent"]:
            print(
                f"  vs its parent night1 (what the gate compares) on the {q['rows']} rows both scored: gaps "
                f"{q['gaps']}, mean {q['gap']:+.4f}, SE {q['standard_error']:.4f}, 95 % one-sided "
                f"[{q['low_95']:+.4f}, {q['high_95']:+.4f}]: {q['verdict']}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000, help="night 1's distinct rows")
    parser.add_argument("--new", type=float, default=0.05, help="share of rows appended for night 2")
    parser.add_argument("--out", help="JSON file for the results (rewritten as each run finishes)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch working directories")
    parser.add_argument("--scratch", help="folder for the working directories (default: a new temporary one)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config key, every run"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", help="sft.seed of each triple (default: the config's)"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="one more continued run per seed with these keys",
    )
    parser.add_argument("--jobs", type=int, default=1, help="pipelines run side by side")
    parser.add_argument("--deadline", type=float, help="start no run after this many seconds")
    parser.add_argument(
        "--resume",
        metavar="DIR",
        help="an earlier call's --keep'd working directories: its finished runs reused",
    )
    parser.add_argument(
        "--retrain-from", metavar="FILE", help="no retrain runs: each seed's as FILE recorded it"
    )
    args = parser.parse_args()
    if args.scratch:
        Path(args.scratch).mkdir(parents=True, exist_ok=True)
    if args.resume:  # the working directories of an earlier call, its finished runs reused
        scratch = Path(args.resume)
    else:
        scratch = Path(tempfile.mkdtemp(prefix="llmft-continue-bench.", dir=args.scratch))
    bench = Bench(args, scratch)
    try:
        bench.execute()
    finally:
        out = bench.result()
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    report(out)
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
