"""The run's page: section functions over one LoadedRun, and summary.json."""

from __future__ import annotations

import csv
import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml
from llmft.core import flops, lineage_record
from llmft.core import stack as stack_fp
from llmft.core.config import GATE_FILE, HELDOUT_METRICS
from llmft.core.draw import CSP, STYLE, esc, fmt, svg_bars, svg_lines, table, tsv
from llmft.core.io import read_json, read_jsonl, read_optional, write_json, write_text
from llmft.core.lineage import LINEAGE_FILE
from llmft.core.platform import Platform
from llmft.core.settings import Config
from llmft.core.throughput import THROUGHPUT_FORMULA
from llmft.report.benchmarks import load as load_benchmarks
from llmft.report.benchmarks import section as benchmarks_section
from llmft.report.lineage import lineage_html
from llmft.report.trend import build_trend

REPO = Path(__file__).resolve().parents[3]


# Data stats shown by name, in this order; any other numeric key (an engineer may add
# near-duplicate or decontamination counts) is listed after them, generically.
DATA_KEYS = [
    "rows_read",
    "invalid",
    "duplicates",
    "near_duplicates",
    "decontaminated",
    "too_long",
    "train_rows",
    "heldout_rows",
    "mean_tokens",
    "max_tokens",
    "cutoff_len",
    "heldout_fraction",
]


# Non-scalar or separately shown stats keys, kept out of the generic list.
DATA_SHOWN_ELSEWHERE = {"length_histogram", "sources", "invalid_examples", "fingerprint", "continue"}


FIGURES = ["loss", "learning_rate", "grad_norm", "throughput", "mfu", "length_histogram"]


# A cell longer than this (or of more lines) shows its start and opens on a click (<details>: no script).


def _benchmarks(run_dir: Path) -> dict[str, dict]:
    """Snakemake's benchmark TSVs: wall seconds and peak RSS per stage."""
    out = {}
    for path in sorted((run_dir / "timings").glob("*.tsv")):
        with open(path) as fh:
            rows = list(csv.DictReader(fh, delimiter="\t"))
        if rows:
            out[path.stem] = {"seconds": _num(rows[-1].get("s")), "max_rss_mb": _num(rows[-1].get("max_rss"))}
    return out


def _cell(value):
    """A table cell from any JSON value: scalars as they are, None empty, the rest as JSON."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    return json.dumps(value, ensure_ascii=False)


def _num(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def git_state() -> dict:
    """Commit of the code that wrote the report, and whether the checkout had local changes."""

    def git(*args):
        proc = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
        return proc.stdout.strip() if proc.returncode == 0 else None

    try:
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"commit": commit or "unknown", "dirty": bool(dirty) if dirty is not None else None}


def run_shape(model_dir: Path):
    """The trained model's shape (plan.ModelShape) from its config.json; None when unreadable."""
    from llmft.core.config import ConfigError
    from llmft.core.shape import shape_from_config

    cfg = read_optional(model_dir / "config.json", None)
    try:
        return shape_from_config(cfg, str(model_dir / "config.json")) if cfg else None
    except ConfigError:
        return None


def flop_count(shape, sft_args: dict, stats: dict) -> flops.FlopCount | None:
    """Training FLOPs per token of the run (flops.py: the one count the planner and bench/ use),
    from the model's shape, the fine-tuning kind and the span each token attends over."""
    if shape is None:
        return None
    return flops.per_token(shape, flops.attention_span(sft_args, stats), flops.tuning_of(sft_args, shape))


def finetuning_rows(train: dict) -> list[list]:
    """What trained (train_summary.json): the fine-tuning type, its trainable parameters, LoRA's
    adapter settings and the published sizes."""
    kind = train.get("finetuning_type") or "full"
    rows = [["fine-tuning", kind], ["trainable parameters", train.get("trainable_params")]]
    if kind == "freeze":
        rows.append(
            ["trainable decoder layers (freeze_trainable_layers)", train.get("freeze_trainable_layers")]
        )
    adapter = train.get("adapter") or {}
    if adapter:
        modules = ", ".join(adapter.get("target_modules") or []) or adapter.get("lora_target")
        settings = (
            f"rank {adapter.get('lora_rank')}, alpha {adapter.get('lora_alpha')}, "
            f"dropout {adapter.get('lora_dropout')}, on {modules}"
            + (f", {adapter['quantization_bit']}-bit base" if adapter.get("quantization_bit") else "")
        )
        rows += [["LoRA adapter", settings], ["adapter size (MB)", _mb(adapter.get("adapter_bytes"))]]
    if train.get("fp8"):  # counted on the model that trained (llmft.core.fp8), not the setting
        rows.append(["FP8 matmuls", train["fp8"].get("summary")])
    if train.get("model_bytes"):
        label = "merged model size (MB)" if adapter else "model size (MB)"
        rows.append([label, _mb(train.get("model_bytes"))])
    return rows


def runtime(train: dict) -> dict:
    """Training time over every attempt, and whether the run resumed. After a stop, a preemption or a
    failure, LLaMA-Factory's train_runtime is the last attempt's alone; llmft's steps file times each
    attempt (attempts_summary in sft/publish.py)."""
    attempt = train.get("attempt") or {}
    starts = attempt.get("starts") or []
    if len(starts) < 2 or attempt.get("runtime_s") is None:
        return {"seconds": train.get("train_runtime_s"), "attempts": len(starts) or 1, "note": None}
    return {
        "seconds": attempt["runtime_s"],
        "attempts": len(starts),
        "note": f"resumed: {len(starts)} attempts, started at steps {', '.join(map(str, starts))}; "
        f"the last attempt alone {fmt(train.get('train_runtime_s'))} s",
    }


def _runtime_text(rt: dict) -> str | float | None:
    return f"{fmt(rt['seconds'])} ({rt['note']})" if rt["note"] else rt["seconds"]


def _mb(nbytes) -> float | None:
    return round(nbytes / 1e6, 1) if isinstance(nbytes, (int, float)) else None


def throughput_series(history: list[dict], world: int) -> list[tuple[float, float]]:
    """Tokens/s per GPU over each logging interval.

    `num_input_tokens_seen` is summed over all ranks by the Trainer; `train_runtime` in each log
    entry is the wall clock since training started. Their differences give the rate of each
    interval, not the running average that `train_tokens_per_second` holds. A held-out evaluation
    runs right after the step it is logged at, inside the next interval: its `eval_runtime` is
    taken out of that interval, so evaluations do not show as training slowdowns.
    """
    eval_time: dict[int, float] = {}
    for h in history:
        if "eval_runtime" in h:
            eval_time[h["step"]] = eval_time.get(h["step"], 0.0) + h["eval_runtime"]
    logs = [h for h in history if "loss" in h and "num_input_tokens_seen" in h]
    out = []
    prev_step, prev_tokens, prev_time = 0, 0, 0.0
    for h in logs:
        tokens, t = h["num_input_tokens_seen"], h.get("train_runtime")
        if t is not None and t > prev_time:
            busy = (t - prev_time) - sum(v for s, v in eval_time.items() if prev_step <= s < h["step"])
            if busy > 0:
                out.append((h["step"], (tokens - prev_tokens) / busy / world))
            prev_step, prev_tokens, prev_time = h["step"], tokens, t
        elif h.get("train_tokens_per_second"):
            out.append((h["step"], h["train_tokens_per_second"] / world))
    return out


def peak_flops(platform: Platform | None) -> tuple[float | None, str]:
    """Dense bf16 peak TFLOP/s of the GPU the run trained on (the platform its plan was made for,
    hardware.py's table); None on CPU or for an unknown GPU."""
    if platform is None or not platform.on_gpu:
        return None, "n/a: CPU run (no accelerator peak to compare with)"
    spec = platform.spec
    if spec is None:
        return None, f"n/a: no peak FLOP/s known for {platform.gpu}"
    return spec.peak_bf16_tflops, f"{spec.name}, dense bf16 peak {spec.peak_bf16_tflops:g} TFLOP/s"


# Below this many held-out rows a gain in exact match is mostly noise (one row moves it by 2 %).
MIN_HELDOUT_ROWS = 50


def data_loss_line(stats: dict) -> str:
    """What prepare_data dropped, as a share of the rows it read."""
    read = stats.get("rows_read") or 0
    if not read:
        return ""
    parts = {
        k: stats.get(k) or 0
        for k in ("invalid", "too_long", "duplicates", "near_duplicates", "decontaminated")
    }
    dropped = sum(parts.values())
    named = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in parts.items() if v)
    return (
        f"Data: {dropped} of {read} rows read dropped ({dropped / read:.1%}{': ' + named if named else ''})."
    )


def verdict_caution(stats: dict, heldout_rows) -> str:
    """A warning instead of a green verdict for a run whose numbers rest on little data."""
    read = stats.get("rows_read") or 0
    lost = ((stats.get("invalid") or 0) + (stats.get("too_long") or 0)) / read if read else 0
    notes = []
    if heldout_rows is not None and heldout_rows < MIN_HELDOUT_ROWS:
        notes.append(f"only {heldout_rows} held-out rows: the metrics are noisy")
    if lost > 0.1:
        notes.append(f"{lost:.0%} of the rows were dropped as invalid or too long")
    return (" Caution: " + "; ".join(notes) + ".") if notes else ""


def canary_figure(nodes: list[dict]) -> str:
    """Each node's numerics-canary loss curve against the golden one (verify_env, llmft.env.canary)."""
    series: dict[str, list[tuple[float, float]]] = {}
    gold = None
    for facts in nodes:
        can = facts.get("canary") or {}
        losses = (can.get("run") or {}).get("losses")
        if losses:
            series[f"canary on {facts.get('host', '?')}"] = list(enumerate(losses, 1))
            gold = gold or (can.get("golden") or {})
    if not series:
        return ""
    if gold and gold.get("losses"):
        series[f"golden ({gold.get('recorded_on', '')})"] = list(enumerate(gold["losses"], 1))
    tol = (gold or {}).get("tolerance", {})
    note = (
        f"tolerance {tol['loss_rel']:.1%} of the loss at every step" if tol else "no golden curve: not judged"
    )
    return (
        "<h3>Numerics canary: a fixed model through this node's kernels</h3>"
        + svg_lines(series, "canary loss vs golden", "step")
        + f"<p class='muted'>{esc(note)}</p>"
    )


def _numeric_leaves(value, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted key, number) for every numeric leaf of nested dicts; lists and text are skipped."""
    if isinstance(value, (int, float)):
        return [(prefix, value)]
    if isinstance(value, dict):
        return [
            leaf for k, v in value.items() for leaf in _numeric_leaves(v, f"{prefix}.{k}" if prefix else k)
        ]
    return []


def data_rows(stats: dict) -> list[list]:
    """Known stats first, then every other numeric value (nested dicts flattened with dots)."""
    rows = [[k, stats[k]] for k in DATA_KEYS if k in stats]
    for key, value in stats.items():
        if key not in DATA_KEYS and key not in DATA_SHOWN_ELSEWHERE:
            rows += [list(leaf) for leaf in _numeric_leaves(value, key)]
    return rows


def pick_samples(
    base_pred: list[dict], tuned_pred: list[dict], per_task: int = 5, cap: int = 30
) -> list[list]:
    """Side by side: up to `per_task` rows of each task (held-out order), base and tuned output."""
    base_by = {p.get("index", i): p for i, p in enumerate(base_pred)}
    taken: dict[str, int] = {}
    out = []
    for i, t in enumerate(tuned_pred):
        task = t.get("task", "")
        if taken.get(task, 0) >= per_task:
            continue
        taken[task] = taken.get(task, 0) + 1
        b = base_by.get(t.get("index", i), {})
        out.append(
            [
                task,
                t["prompt"],
                t["reference"],
                b.get("prediction", ""),
                t["prediction"],
                bool(t["exact_match"]),
            ]
        )
        if len(out) >= cap:
            break
    return out


def _delta(b, t) -> str:
    if not isinstance(b, (int, float)) or not isinstance(t, (int, float)):
        return ""
    return f"{t - b:+.4g}"


METRICS = list(HELDOUT_METRICS)


@dataclass
class LoadedRun:
    """Every input of one run's report, each file read once, and the measures derived from them."""

    cfg: Config
    # the validated config as the command read it (its keys in that order): the page's Config block
    validated: dict
    run: Path
    verify: dict
    stats: dict
    train: dict
    base: dict
    tuned: dict
    base_pred: list[dict]
    tuned_pred: list[dict]
    sft_yaml: str
    sft_args: dict
    benches: dict[str, dict]
    promotion: object  # the night's outcome: promotion.json (a move made), else gate.json's verdict
    gate: dict | None  # nightly/gate.json (nightly.compare_with): the gate's comparison and verdict
    n_params: int | None
    platform: Platform | None
    shape: object  # plan.ModelShape or None
    count: flops.FlopCount | None
    peak: float | None
    peak_note: str
    tps: list[tuple[float, float]]
    tps_gpu: float | None  # the run's one throughput figure (core.throughput)
    mfu_mean: float | None
    stack: dict | None  # the software stack it trained on (llmft.core.stack), from verify.json
    lineage: dict  # summary.json's `lineage`, from the run's lineage.json (llmft.core.lineage_record)

    @property
    def history(self) -> list[dict]:
        return self.train.get("history", [])

    @property
    def world(self) -> int:
        return self.train.get("world_size") or 1

    @property
    def on_gpu(self) -> bool:
        return bool(self.platform and self.platform.on_gpu)

    @property
    def unit(self) -> str:
        return "GPU" if self.on_gpu else "process"

    @property
    def per_token(self) -> float:
        return self.count.total if self.count else 0.0


def load_run(cfg: Config, run_dir: str | Path, validated: dict | None = None) -> LoadedRun:
    """Read the run's inputs; the optional ones (an older run, a stage that wrote less) as empty.
    `validated`: the dict `cfg` was built from (None: cfg.to_dict(), its keys in the schema's order)."""
    validated = cfg.to_dict() if validated is None else validated
    run = Path(run_dir)
    verify = read_optional(run / "env/verify.json", {}) or {}
    stats = read_optional(run / "data/stats.json", {}) or {}
    train = read_optional(run / "sft/train_summary.json", {}) or {}
    base = read_optional(run / "eval/base/metrics.json", {}) or {}
    tuned = read_json(run / "eval/tuned/metrics.json")
    base_pred = (
        read_jsonl(run / "eval/base/predictions.jsonl")
        if (run / "eval/base/predictions.jsonl").exists()
        else []
    )
    tuned_pred = read_jsonl(run / "eval/tuned/predictions.jsonl")
    gate = read_json(run / GATE_FILE) if cfg.nightly.compare_with else None
    sft_yaml_path = run / "sft/llamafactory.yaml"
    sft_yaml = sft_yaml_path.read_text() if sft_yaml_path.exists() else ""
    sft_args = yaml.safe_load(sft_yaml) if sft_yaml else {}
    n_params = tuned.get("n_params") or base.get("n_params")
    if not n_params and (run / "sft/model").is_dir():
        from llmft.core.modelfiles import safetensors_stats

        n_params = safetensors_stats(run / "sft/model")["n_params"] or None
    ours = sft_args.get("llmft") or {}
    platform = Platform.from_json(ours["platform"]) if ours.get("platform") else None
    tps = throughput_series(train.get("history", []), train.get("world_size") or 1)
    peak, peak_note = peak_flops(platform)
    shape = run_shape(run / "sft/model")
    count = flop_count(shape, sft_args, stats)
    per_token = count.total if count else 0.0
    tps_gpu = train.get("tokens_per_second_per_gpu")  # core.throughput
    mfu_mean = flops.mfu(tps_gpu, per_token, peak) if (tps_gpu and peak and per_token) else None
    stack = stack_fp.of_report(verify)
    record = lineage_record.read_for(
        run / LINEAGE_FILE, cfg, stats, stack=stack.get("hash") if isinstance(stack, dict) else None
    )
    return LoadedRun(
        cfg=cfg,
        validated=validated,
        run=run,
        verify=verify,
        stats=stats,
        train=train,
        base=base,
        tuned=tuned,
        base_pred=base_pred,
        tuned_pred=tuned_pred,
        sft_yaml=sft_yaml,
        sft_args=sft_args,
        benches=_benchmarks(run),
        promotion=read_optional(run / "promotion.json") or _verdict(gate),
        gate=gate,
        n_params=n_params,
        platform=platform,
        shape=shape,
        count=count,
        peak=peak,
        peak_note=peak_note,
        tps=tps,
        tps_gpu=tps_gpu,
        mfu_mean=mfu_mean,
        stack=stack,
        lineage=lineage_record.summary_view(record),
    )


def _verdict(gate: dict | None) -> dict | None:
    """The page's promotion line from the gate's verdict (gate.json), which the nightly acts on: the
    status the night records (promoted or rejected) and why. None without a gate."""
    return {k: gate.get(k) for k in ("status", "reason")} if isinstance(gate, dict) else None


def report_figures(r: LoadedRun) -> dict[str, str]:
    """Every figure of FIGURES as SVG: the training curves, throughput, MFU, the length histogram."""
    history = r.history
    loss = [(h["step"], h["loss"]) for h in history if "loss" in h]
    eval_loss = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    lr = [(h["step"], h["learning_rate"]) for h in history if "learning_rate" in h]
    gnorm = [(h["step"], h["grad_norm"]) for h in history if h.get("grad_norm") is not None]
    per_token, peak, unit = r.per_token, r.peak, r.unit
    mfu = [(s, flops.mfu(v, per_token, peak)) for s, v in r.tps] if peak and per_token else []
    hist = r.stats.get("length_histogram") or {}
    return {
        "loss": svg_lines({"train loss": loss, "held-out loss": eval_loss}, "Loss", "optimizer step"),
        "learning_rate": svg_lines({"learning rate": lr}, "Learning rate", "optimizer step"),
        "grad_norm": svg_lines({"grad norm": gnorm}, "Gradient norm (before clipping)", "optimizer step"),
        "throughput": svg_lines(
            {f"tokens/s per {unit}": r.tps},
            f"Training tokens/s per {unit}, each logging interval",
            "optimizer step",
        ),
        "mfu": svg_lines(
            {"MFU": mfu}, "Model FLOPs utilisation", "optimizer step", na="" if mfu else r.peak_note
        ),
        "length_histogram": svg_bars(hist.get("edges", []), hist.get("counts", []), "Token length of rows"),
    }


def overview_section(r: LoadedRun, results_dir: str | None) -> str:
    """The page's head: title, navigation, the verdict, and the nightly promotion if there was one."""
    tuned, base = r.tuned, r.base
    base_em, tuned_em = base.get("exact_match"), tuned.get("exact_match")
    verdict = (
        f"Tuned exact match {fmt(tuned_em, 3)} vs base {fmt(base_em, 3)} ({_delta(base_em, tuned_em)}); "
        f"held-out loss {fmt(tuned.get('eval_loss'))} vs {fmt(base.get('eval_loss'))} "
        f"on {tuned.get('rows')} held-out rows. " + data_loss_line(r.stats)
    )
    caution = verdict_caution(r.stats, tuned.get("rows"))
    trend_link = "<a href='trend.html'>trend across runs</a>" if results_dir else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>llmft report: {esc(r.cfg.run)}</title>
<style>{STYLE}</style></head><body>
<h1>llmft run <code>{esc(r.cfg.run)}</code></h1>
<nav><a href="#heldout">held-out</a><a href="#training">training</a><a href="#throughput">throughput</a>
<a href="#samples">samples</a><a href="#data">data</a><a href="#environment">environment</a>
<a href="#provenance">provenance</a>{trend_link}</nav>
<p class="verdict{" warn" if caution else ""}">{esc(verdict)}{esc(caution)}</p>
{promotion_html(r.promotion)}
{lineage_html(r.lineage)}
"""


def metric_rows(r: LoadedRun) -> list[list]:
    """Base vs tuned per metric, then exact match per task (heldout_metrics.tsv and the page)."""
    base, tuned = r.base, r.tuned
    rows = [[m, base.get(m), tuned.get(m), _delta(base.get(m), tuned.get(m))] for m in METRICS]
    base_tasks, tuned_tasks = base.get("exact_match_by_task", {}), tuned.get("exact_match_by_task", {})
    for task in sorted(set(base_tasks) | set(tuned_tasks)):
        b, t = base_tasks.get(task), tuned_tasks.get(task)
        rows.append([f"exact_match[{task or 'all'}]", b, t, _delta(b, t)])
    return rows


def heldout_section(r: LoadedRun, metrics: list[list]) -> str:
    """The held-out metrics table and the evaluation's own speed and memory."""
    tuned = r.tuned
    speed_header = [
        "model",
        "rows",
        "device",
        "processes",
        "batch",
        "generate s",
        "new tokens/s",
        "wall s",
        f"peak memory GiB ({tuned.get('peak_memory_kind', '')})",
    ]
    speed_keys = ["rows", "device", "processes", "batch_size", "generate_seconds"]
    speed_keys += ["new_tokens_per_second", "wall_seconds", "peak_memory_gib"]
    eval_speed = [
        [label, *(m.get(k) for k in speed_keys)] for label, m in (("base", r.base), ("tuned", tuned)) if m
    ]
    source = tuned.get("metrics_source") or "metrics as evaluate computed them"
    return f"""<h2 id="heldout">Held-out metrics: base vs tuned</h2>
{table(["metric", "base", "tuned", "change"], metrics)}
<p class="muted">Greedy decoding, at most {esc(tuned.get("max_new_tokens"))} new tokens; exact match after
whitespace and case normalisation; {esc(source)}.</p>
{table(speed_header, eval_speed)}
"""


def curves_section(figures: dict[str, str]) -> str:
    fig = figures
    return f"""<h2 id="training">Training curves</h2>
<div class="charts">{fig["loss"]}{fig["learning_rate"]}{fig["grad_norm"]}</div>
"""


def throughput_label(train: dict, unit: str) -> str:
    """The throughput row's label: the formula (core.throughput, stated once) and the steps it
    measured in this run."""
    steps = train.get("throughput_steps")
    here = f"here steps {steps[0]}-{steps[1]}" if steps else "n/a: this run recorded no measured steps"
    return f"{THROUGHPUT_FORMULA.replace('per GPU', f'per {unit}')}; {here}"


def throughput_rows(r: LoadedRun) -> list[list]:
    """What trained, how fast, the FLOPs count behind MFU, and memory: accelerator, plan, host."""
    train, count = r.train, r.count
    plain_packs = r.sft_args.get("packing") and not r.sft_args.get("neat_packing")
    span_kind = "the whole pack" if plain_packs else "the row's own length, token-weighted mean"
    mfu_text = f"{r.mfu_mean:.2%}" if r.mfu_mean is not None else r.peak_note
    return (
        finetuning_rows(train)
        + [
            ["world size (processes)", r.world],
            ["optimizer steps", train.get("steps")],
            ["train runtime (s), all attempts", _runtime_text(runtime(train))],
            ["train tokens (all processes, incl. padding)", train.get("train_tokens")],
            [throughput_label(train, r.unit), r.tps_gpu],
            ["parameters (the tuned model's files)", r.n_params],
            [
                "matrix weights M (output head once, embedding lookup not counted)",
                round(count.matmul_params) if count else "n/a",
            ],
            ["attention span S (tokens)", f"{fmt(count.span)} ({span_kind})" if count else "n/a"],
            ["training FLOPs per token F (forward + backward)", f"{count.total:.4g}" if count else "n/a"],
            [flops.FORMULA, mfu_text],
            [
                "peak accelerator memory (GiB)",
                train.get("peak_vram_gib") if train.get("peak_vram_gib") else "n/a (CPU run)",
            ],
            ["memory planner's predicted peak per GPU (GiB)", train.get("predicted_peak_gib") or "n/a"],
            ["peak host memory of sft (MB RSS)", r.benches.get("sft", {}).get("max_rss_mb")],
        ]
        + [
            [f"stage {name}: wall s / peak RSS MB", f"{fmt(b['seconds'])} / {fmt(b['max_rss_mb'])}"]
            for name, b in r.benches.items()
        ]
    )


def throughput_section(r: LoadedRun, figures: dict[str, str]) -> str:
    fig = figures
    return f"""<h2 id="throughput">Throughput and memory</h2>
<div class="charts">{fig["throughput"]}{fig["mfu"]}</div>
{table(["what", "value"], throughput_rows(r))}
<p class="muted">Tokens counted by the Trainer include padding. MFU peak: {esc(r.peak_note)}.</p>
"""


def samples_section(samples: list[list]) -> str:
    classes = ["good" if s[-1] else "bad" for s in samples]
    header = ["task", "prompt", "reference", "base", "tuned", "tuned exact"]
    return f"""<h2 id="samples">Sample generations (held-out, side by side)</h2>
{table(header, samples, classes, "samples")}
"""


def data_section(r: LoadedRun, figures: dict[str, str]) -> str:
    """The length histogram, stats.json's figures, the sources and the invalid rows."""
    stats = r.stats
    hist = stats.get("length_histogram") or {}
    # Sources and invalid rows: whatever fields prepare_data records, as columns, in its order.
    sources = [src for src in stats.get("sources", []) if isinstance(src, dict)]
    source_header = list(dict.fromkeys(k for src in sources for k in src))
    source_rows = [[src.get(k) for k in source_header] for src in sources]
    invalid = [e if isinstance(e, dict) else {"message": e} for e in stats.get("invalid_examples", [])]
    invalid_header = list(dict.fromkeys(k for e in invalid for k in e))
    invalid_examples = [[i + 1] + [_cell(e.get(k)) for k in invalid_header] for i, e in enumerate(invalid)]
    return f"""<h2 id="data">Data</h2>
<div class="charts">{figures["length_histogram"]}</div>
{table(["what", "value"], data_rows(stats))}
{table(source_header, source_rows) if source_rows else ""}
<h3>Invalid rows ({esc(stats.get("invalid", 0))})</h3>
{table(["#", *invalid_header], invalid_examples) if invalid_examples else "<p class='muted'>none</p>"}
<p class="muted">Length histogram bin width: {esc(hist.get("bin_width", ""))} tokens; cutoff
{esc(stats.get("cutoff_len", ""))}.</p>
"""


def environment_section(r: LoadedRun) -> str:
    """verify_env's first node, its findings, the measured collectives and the canary figure."""
    verify, platform = r.verify, r.platform
    node = (verify.get("nodes") or [{}])[0]
    findings = [
        [("ok" if f.get("ok") else "FAIL"), f.get("check"), f.get("message"), f.get("fix", "")]
        for f in verify.get("findings", [])
    ]
    devices = ", ".join(f"{d.get('name')} ({d.get('arch')})" for d in node.get("devices", []))
    env_rows = [
        ["nodes checked", len(verify.get("nodes") or [])],
        ["host", node.get("host")],
        ["build", node.get("build")],
        ["torch", node.get("torch_version")],
        ["HIP / CUDA", node.get("hip_version") or node.get("cuda_version") or "none (CPU build)"],
        ["devices", devices or "none (CPU)"],
        ["python", node.get("python")],
        ["platform", node.get("platform")],
        ["planned for", f"{platform.describe()} ({platform.source})" if platform else "n/a"],
    ] + [[f"measured {k}", v] for k, v in _numeric_leaves(verify.get("collectives") or {})]
    finding_classes = ["" if f[0] == "ok" else "bad" for f in findings]
    verdict = "passed" if verify.get("ok") else "FAILED or missing"
    return f"""<h2 id="environment">Environment (verify_env: {verdict})</h2>
{table(["what", "value"], env_rows)}
{stack_html(r.stack)}
{table(["", "check", "finding", "fix"], findings, finding_classes)}
{canary_figure(verify.get("nodes") or [])}
"""


def stack_html(stack: dict | None) -> str:
    """The software stack the run trained on (llmft.core.stack): its hash, one row per component,
    and the components the nodes disagree on."""
    if not stack:
        return "<p class='muted'>Software stack: not recorded (no verify_env nodes).</p>"
    fp = stack.get("fingerprint") or {}
    rows = [[k, stack_fp.show(fp.get(k))] for k in stack_fp.FIELDS if k in fp]
    differs = stack.get("differs") or []
    note = (
        f"<p class='verdict bad'>The nodes' stacks differ in: {esc(', '.join(differs))}.</p>"
        if differs
        else ""
    )
    return f"<h3 id='stack'>Software stack <code>{esc(stack.get('hash'))}</code></h3>{note}" + table(
        ["component", "value"], rows, ["bad" if r[0] in differs else "" for r in rows]
    )


def provenance_section(r: LoadedRun, generated: str, git: dict) -> str:
    """What made the report: run, time, commit, data, model, packages, the config and the rendered
    LLaMA-Factory arguments; the page's end."""
    shape = r.shape
    packages = (r.verify.get("nodes") or [{}])[0].get("packages", {}) or {}
    provenance = [
        ["run", r.cfg.run],
        ["generated", generated],
        ["git commit", git["commit"] + (" (with local changes)" if git["dirty"] else "")],
        ["data fingerprint", r.stats.get("fingerprint")],
        ["model (tuned)", str(r.run / "sft/model")],
        [
            "model shape",
            f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, vocab {shape.vocab}"
            + (", tied head" if shape.tied else "")
            if shape
            else "n/a",
        ],
    ] + [[f"package {pkg}", ver or "not installed"] for pkg, ver in packages.items()]
    return f"""<h2 id="provenance">Provenance</h2>{table(["what", "value"], provenance)}
<h3>Config</h3><pre>{esc(yaml.safe_dump(r.validated, sort_keys=False))}</pre>
<h3>Rendered LLaMA-Factory arguments</h3><pre>{esc(r.sft_yaml)}</pre>
</body></html>
"""


def report_summary(r: LoadedRun, generated: str, git: dict) -> dict:
    """summary.json: the headline figures the trend page and the nightly gate read."""
    base, tuned, train, count = r.base, r.tuned, r.train, r.count
    base_em, tuned_em = base.get("exact_match"), tuned.get("exact_match")
    summary = {
        "run": r.cfg.run,
        "generated": generated,
        "git_commit": git["commit"],
        "base": {m: base.get(m) for m in METRICS},
        "tuned": {m: tuned.get(m) for m in METRICS},
        "exact_match_gain": round(tuned_em - base_em, 4) if None not in (tuned_em, base_em) else None,
        "heldout_rows": tuned.get("rows"),
        "heldout_fingerprint": tuned.get("heldout_fingerprint"),
        "tokens_per_second_per_gpu": r.tps_gpu,
        "throughput_steps": train.get("throughput_steps"),
        "mfu": round(r.mfu_mean, 4) if r.mfu_mean is not None else None,
        "flops_per_token": round(r.per_token) if r.per_token else None,
        "attention_span_tokens": round(count.span, 2) if count else None,
        "peak_tflops": r.peak,
        "world_size": r.world,
        "device": "gpu" if r.on_gpu else "cpu",
        "n_params": r.n_params,
        # over every attempt; the attempts and the step each started from say whether it resumed
        "train_runtime_s": runtime(train)["seconds"],
        "train_runtime_s_last_attempt": train.get("train_runtime_s"),
        "attempts": runtime(train)["attempts"],
        "attempt_starts": (train.get("attempt") or {}).get("starts") or [0],
        "peak_vram_gib": train.get("peak_vram_gib"),
        # layers that ran in float8, counted on the model that trained (sft/train_summary.json)
        "fp8_layers": (train.get("fp8") or {}).get("float8_layers"),
        "fp8": (train.get("fp8") or {}).get("summary"),
        "eval_generate_seconds": tuned.get("generate_seconds"),
        "eval_new_tokens_per_second": tuned.get("new_tokens_per_second"),
        "data_fingerprint": r.stats.get("fingerprint"),
        "verify_ok": r.verify.get("ok"),
        "lineage": r.lineage,
        # the software stack verify_env measured on the nodes that trained (llmft.core.stack)
        "stack": r.stack,
    }
    if isinstance(r.promotion, dict):
        summary["promotion"] = {k: r.promotion.get(k) for k in ("status", "reason")}
    return summary


# Around the page's promotion line, so that `llmft promote` / `llmft rollback` can rewrite it.
PROMOTION_MARKS = ("<!-- promotion -->", "<!-- /promotion -->")


def promotion_html(promotion) -> str:
    """The page's promotion line: promotion.json (the move the nightly or a person made), else the
    gate's verdict (gate.json), which the nightly acts on."""
    line = ""
    if isinstance(promotion, dict):
        line = (
            f"<p class='verdict'>Nightly promotion: <b>{esc(promotion.get('status', ''))}</b> "
            f"({esc(promotion.get('reason', ''))})</p>"
        )
    return PROMOTION_MARKS[0] + line + PROMOTION_MARKS[1]


def set_promotion(report_dir: Path, promotion: dict) -> bool:
    """After results/current moved: the run's summary.json `promotion` and its page's promotion line
    say so. False when the page has no marked line (made before it had one); summary.json is
    rewritten either way."""
    summary = read_optional(report_dir / "summary.json")
    if isinstance(summary, dict):
        summary["promotion"] = {k: promotion.get(k) for k in ("status", "reason")}
        write_json(report_dir / "summary.json", summary)
    try:
        page = (report_dir / "index.html").read_text(encoding="utf-8")
    except OSError:
        return False
    start, end = page.find(PROMOTION_MARKS[0]), page.find(PROMOTION_MARKS[1])
    if start < 0 or end < start:
        return False
    write_text(
        report_dir / "index.html",
        page[:start] + promotion_html(promotion) + page[end + len(PROMOTION_MARKS[1]) :],
    )
    return True


def gate_section(summary: dict, metric: str) -> str:
    """The nightly gate's comparison: this run's model and the promoted one on the same held-out rows
    (summary.json's `gate` and `compared_with`), every score both carry, the gate's metric first;
    "" when the run compared with nothing."""
    gate, other = summary.get("gate"), summary.get("compared_with")
    if not isinstance(gate, dict) or not isinstance(other, dict):
        return ""
    names = [m for m in (gate.get("tuned") or {}) if m in (other.get("tuned") or {})]
    names.sort(key=lambda m: m != metric)
    tasks = sorted(set(gate.get("exact_match_by_task") or {}) & set(other.get("exact_match_by_task") or {}))
    head = "".join(f"<th>{esc(m)}{' (gate)' if m == metric else ''}</th>" for m in names)
    head += "".join(f"<th>exact_match[{esc(t or 'no task')}]</th>" for t in tasks)
    rows = ""
    for label, block in (("this run", gate), (f"promoted: {other.get('run', '')}", other)):
        cells = "".join(f"<td>{fmt((block.get('tuned') or {}).get(m), 4)}</td>" for m in names)
        cells += "".join(f"<td>{fmt(block['exact_match_by_task'][t], 4)}</td>" for t in tasks)
        rows += f"<tr><td>{esc(label)}</td>{cells}</tr>"
    unit = gate.get("rows_unit", "rows")
    same = gate.get("heldout_fingerprint") and gate.get("heldout_fingerprint") == other.get(
        "heldout_fingerprint"
    )
    note = (
        f"both on the same {gate.get('heldout_rows')} held-out {unit} (fingerprint "
        f"{gate.get('heldout_fingerprint')})"
        if same
        else "the two were not scored on the same held-out rows: the gate refuses to compare them"
    )
    return f"""<h2 id="gate">Nightly gate</h2>
<p>nightly.metric {esc(metric)}: {esc(note)}.</p>
<table><tr><th>model</th>{head}</tr>{rows}</table>
"""


def build_report(
    cfg: Config,
    run_dir: str,
    out_dir: str,
    results_dir: str | None = None,
    stage_pages: Sequence = (),
    validated: dict | None = None,
) -> dict:
    """Write index.html, summary.json, figures/*.svg, heldout_metrics.tsv, samples.tsv and
    trend.html into `out_dir`; return the summary. `stage_pages`: another training stage's part of
    the page (llmft.preference.page), each with load(cfg, run_dir) -> its block or None,
    section(block) -> HTML and add_to_summary(summary, block). With nightly.compare_with the gate's
    comparison and verdict come from nightly/gate.json, rendered as they are. `validated`: the dict
    `cfg` was built from, shown on the page as read (None: cfg.to_dict())."""
    r = load_run(cfg, run_dir, validated)
    out = Path(out_dir)
    figures = report_figures(r)
    metrics = metric_rows(r)
    samples = pick_samples(r.base_pred, r.tuned_pred)
    # eval.benchmarks: only a run configured with them shows them (a stale benchmarks/ folder is not read)
    benchmarks = load_benchmarks(r.run) if cfg.eval.benchmarks else None
    stages = [(stage_page, stage_page.load(cfg, Path(run_dir))) for stage_page in stage_pages]
    git = git_state()
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    summary = report_summary(r, generated, git)
    if r.gate is not None:  # both models on the gate's rows, as the gate compared them
        summary["gate"], summary["compared_with"] = r.gate["gate"], r.gate["compared_with"]
    page = "".join(
        [
            overview_section(r, results_dir),
            gate_section(summary, cfg.nightly.metric),
            heldout_section(r, metrics),
            benchmarks_section(benchmarks),
            *(stage_page.section(block) for stage_page, block in stages),
            curves_section(figures),
            throughput_section(r, figures),
            samples_section(samples),
            data_section(r, figures),
            environment_section(r),
            provenance_section(r, generated, git),
        ]
    )
    if benchmarks:
        summary["benchmarks"] = benchmarks
    for stage_page, block in stages:
        if block:
            stage_page.add_to_summary(summary, block)
    write_text(out / "index.html", page)
    write_json(out / "summary.json", summary)
    for name in FIGURES:
        write_text(out / "figures" / f"{name}.svg", figures[name])
    write_text(out / "heldout_metrics.tsv", tsv(["metric", "base", "tuned", "change"], metrics))
    write_text(
        out / "samples.tsv", tsv(["task", "prompt", "reference", "base", "tuned", "tuned_exact"], samples)
    )
    if results_dir:
        build_trend(results_dir, out / "trend.html")
    print(json.dumps(summary))
    return summary
