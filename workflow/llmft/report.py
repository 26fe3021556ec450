"""The run report: one self-contained HTML page (inline SVG, no network at view time).

Every piece of dataset or model text goes through `html.escape`: a row containing `<script>` shows
as text.
"""

from __future__ import annotations

import csv
import html
import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import yaml

from .io import read_json, read_jsonl, write_json, write_text

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def svg_lines(
    series: dict[str, list[tuple[float, float]]],
    title: str,
    xlabel: str,
    width: int = 460,
    height: int = 240,
) -> str:
    """A small line chart as inline SVG; `series` maps a name to (x, y) points."""
    pts = [p for s in series.values() for p in s]
    if not pts:
        return f"<p class='empty'>{esc(title)}: no data</p>"
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    left, right, top, bottom = 50, 10, 24, 34
    w, h = width - left - right, height - top - bottom

    def sx(x):
        return left + (x - x0) / (x1 - x0) * w

    def sy(y):
        return top + h - (y - y0) / (y1 - y0) * h

    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"role='img' aria-label='{esc(title)}'>",
        f"<text x='{left}' y='15' class='t'>{esc(title)}</text>",
        f"<rect x='{left}' y='{top}' width='{w}' height='{h}' fill='none' stroke='#bbb'/>",
    ]
    for frac in (0, 0.5, 1):
        yv = y0 + frac * (y1 - y0)
        parts.append(f"<text x='{left - 4}' y='{sy(yv) + 4:.1f}' class='a' text-anchor='end'>{yv:.3g}</text>")
        xv = x0 + frac * (x1 - x0)
        parts.append(
            f"<text x='{sx(xv):.1f}' y='{height - 18}' class='a' text-anchor='middle'>{xv:.3g}</text>"
        )
    parts.append(
        f"<text x='{left + w / 2}' y='{height - 4}' class='a' text-anchor='middle'>{esc(xlabel)}</text>"
    )
    for i, (name, s) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        if len(s) == 1:
            parts.append(f"<circle cx='{sx(s[0][0]):.1f}' cy='{sy(s[0][1]):.1f}' r='3' fill='{color}'/>")
        else:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
            parts.append(f"<polyline points='{path}' fill='none' stroke='{color}' stroke-width='1.8'/>")
        parts.append(
            f"<text x='{left + w - 4}' y='{top + 14 + 14 * i}' class='a' "
            f"text-anchor='end' fill='{color}'>{esc(name)}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def svg_bars(edges: list[int], counts: list[int], title: str, width=460, height=200) -> str:
    if not counts or not any(counts):
        return f"<p class='empty'>{esc(title)}: no data</p>"
    left, top, bottom = 40, 24, 30
    w, h = width - left - 10, height - top - bottom
    bw, top_count = w / len(counts), max(counts)
    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"role='img' aria-label='{esc(title)}'>",
        f"<text x='{left}' y='15' class='t'>{esc(title)}</text>",
    ]
    for i, c in enumerate(counts):
        bh = c / top_count * h
        parts.append(
            f"<rect x='{left + i * bw:.1f}' y='{top + h - bh:.1f}' width='{bw - 1:.1f}' "
            f"height='{bh:.1f}' fill='#1f77b4'><title>{edges[i]}-{edges[i + 1]}: {c}"
            "</title></rect>"
        )
    parts.append(f"<text x='{left}' y='{height - 6}' class='a'>{edges[0]}</text>")
    parts.append(
        f"<text x='{left + w}' y='{height - 6}' class='a' text-anchor='end'>{edges[-1]} tokens</text></svg>"
    )
    return "".join(parts)


def table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _benchmarks(run_dir: Path) -> dict[str, dict]:
    """Snakemake's benchmark TSVs: wall seconds and peak RSS per stage."""
    out = {}
    for tsv in sorted((run_dir / "benchmarks").glob("*.tsv")):
        with open(tsv) as fh:
            rows = list(csv.DictReader(fh, delimiter="\t"))
        if rows:
            out[tsv.stem] = {"seconds": rows[-1].get("s"), "max_rss_mb": rows[-1].get("max_rss")}
    return out


def _git_commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def build_report(cfg: dict, run_dir: str, out_html: str, out_summary: str) -> dict:
    run = Path(run_dir)
    verify = read_json(run / "env/verify.json")
    stats = read_json(run / "data/stats.json")
    train = read_json(run / "sft/train_summary.json")
    base = read_json(run / "eval/base/metrics.json")
    tuned = read_json(run / "eval/tuned/metrics.json")
    base_pred = read_jsonl(run / "eval/base/predictions.jsonl")
    tuned_pred = read_jsonl(run / "eval/tuned/predictions.jsonl")
    sft_yaml = (run / "sft/llamafactory.yaml").read_text()
    benches = _benchmarks(run)
    history = train.get("history", [])

    loss = [(h["step"], h["loss"]) for h in history if "loss" in h]
    eval_loss = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    lr = [(h["step"], h["learning_rate"]) for h in history if "learning_rate" in h]
    gnorm = [(h["step"], h["grad_norm"]) for h in history if "grad_norm" in h]
    tokens = [
        (h["step"], h["num_input_tokens_seen"])
        for h in history
        if "num_input_tokens_seen" in h and "loss" in h
    ]

    metric_names = ["eval_loss", "perplexity", "exact_match", "rouge_l", "bleu"]
    rows = [[m, base.get(m), tuned.get(m), _delta(base.get(m), tuned.get(m))] for m in metric_names]
    for task in sorted(set(base.get("exact_match_by_task", {})) | set(tuned["exact_match_by_task"])):
        b = base.get("exact_match_by_task", {}).get(task)
        t = tuned["exact_match_by_task"].get(task)
        rows.append([f"exact_match[{task or 'all'}]", b, t, _delta(b, t)])

    base_by_prompt = {p["prompt"]: p["prediction"] for p in base_pred}
    samples = [
        [
            p["prompt"],
            p["reference"],
            base_by_prompt.get(p["prompt"], ""),
            p["prediction"],
            "yes" if p["exact_match"] else "no",
        ]
        for p in tuned_pred[:24]
    ]

    world = train.get("world_size") or 1
    tps = train.get("tokens_per_second")
    throughput_rows = [
        ["world size (processes)", world],
        ["optimizer steps", train.get("steps")],
        ["train runtime (s)", train.get("train_runtime_s")],
        ["train samples/s", train.get("train_samples_per_second")],
        ["train tokens/s (all processes)", tps],
        ["train tokens/s per process", round(tps / world, 1) if tps else None],
        ["peak accelerator memory (GiB)", train.get("peak_vram_gib") or "n/a (CPU)"],
    ] + [
        [f"{name}: wall s / peak RSS MB", f"{b['seconds']} / {b['max_rss_mb']}"]
        for name, b in benches.items()
    ]

    findings = [
        [("ok" if f["ok"] else "FAIL"), f["check"], f["message"], f.get("fix", "")]
        for f in verify["findings"]
    ]
    node = verify["nodes"][0] if verify.get("nodes") else {}
    hist = stats["length_histogram"]
    data_rows = [
        [k, stats.get(k)]
        for k in (
            "rows_read",
            "invalid",
            "duplicates",
            "too_long",
            "train_rows",
            "heldout_rows",
            "mean_tokens",
            "max_tokens",
            "cutoff_len",
            "fingerprint",
        )
    ]
    provenance = [
        ["run", cfg["run"]],
        ["generated", datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")],
        ["git commit", _git_commit()],
        ["data fingerprint", stats.get("fingerprint")],
        ["torch", node.get("torch_version")],
    ] + [[pkg, ver] for pkg, ver in node.get("packages", {}).items()]

    charts = "".join(
        [
            svg_lines({"train loss": loss, "held-out loss": eval_loss}, "Loss", "step"),
            svg_lines({"learning rate": lr}, "Learning rate", "step"),
            svg_lines({"grad norm": gnorm}, "Gradient norm", "step"),
            svg_lines({"tokens seen": tokens}, "Tokens processed", "step"),
        ]
    )
    verdict = (
        f"Tuned exact match {tuned['exact_match']:.3f} vs base {base['exact_match']:.3f} "
        f"({_delta(base['exact_match'], tuned['exact_match'])}) on "
        f"{tuned['rows']} held-out rows."
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>llmft report: {esc(cfg["run"])}</title>
<style>
body{{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1000px;color:#222}}
h1{{font-size:1.5em}} h2{{font-size:1.15em;border-bottom:1px solid #ddd;margin-top:1.6em}}
table{{border-collapse:collapse;margin:.5em 0}} td,th{{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top;white-space:pre-wrap}} th{{background:#f4f4f4}}
.charts svg{{margin:4px}} .t{{font-weight:600;font-size:13px}} .a{{font-size:11px;fill:#555}}
.verdict{{font-size:1.1em;padding:.6em;background:#eef6ee;border-left:4px solid #2ca02c}}
pre{{background:#f7f7f7;padding:8px;overflow:auto}}
</style></head><body>
<h1>llmft run <code>{esc(cfg["run"])}</code></h1>
<p class="verdict">{esc(verdict)}</p>
<h2>Held-out metrics: base vs tuned</h2>
{table(["metric", "base", "tuned", "change"], rows)}
<h2>Training curves</h2><div class="charts">{charts}</div>
<h2>Throughput and memory</h2>{table(["what", "value"], throughput_rows)}
<h2>Sample generations (held-out)</h2>
{table(["prompt", "reference", "base", "tuned", "tuned exact"], samples)}
<h2>Data</h2><div class="charts">{
        svg_bars(hist["edges"], hist["counts"], "Token length of rows (prompt + answer)")
    }</div>
{table(["what", "value"], data_rows)}
<h2>Environment (verify_env: {"passed" if verify["ok"] else "FAILED"})</h2>
{table(["", "check", "finding", "fix"], findings)}
<h2>Provenance</h2>{table(["what", "value"], provenance)}
<h2>Config</h2><pre>{esc(yaml.safe_dump(cfg, sort_keys=False))}</pre>
<h2>Rendered LLaMA-Factory arguments</h2><pre>{esc(sft_yaml)}</pre>
</body></html>
"""
    write_text(out_html, page)
    summary = {
        "run": cfg["run"],
        "base": {m: base.get(m) for m in metric_names},
        "tuned": {m: tuned.get(m) for m in metric_names},
        "exact_match_gain": round(tuned["exact_match"] - base["exact_match"], 4),
        "tokens_per_second": tps,
        "world_size": world,
        "data_fingerprint": stats.get("fingerprint"),
        "verify_ok": verify["ok"],
    }
    write_json(out_summary, summary)
    print(json.dumps(summary))
    return summary


def _delta(b, t) -> str:
    if not isinstance(b, (int, float)) or not isinstance(t, (int, float)):
        return ""
    return f"{t - b:+.4g}"
