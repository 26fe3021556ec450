"""The trend page across runs: every results/*/report/summary.json, promoted runs marked."""

from __future__ import annotations

import logging
import os
from datetime import datetime, timezone
from pathlib import Path

from llmft.core import stack as stack_fp
from llmft.core.config import RESERVED_RUNS, is_run_name
from llmft.core.draw import CSP, STYLE, esc, svg_lines, table
from llmft.core.io import read_optional, write_text
from llmft.report.benchmarks import trend_section

log = logging.getLogger("llmft.trend")


def _promotion(results: Path, run: str, summary: dict) -> str:
    """The nightly promotion decision, if any: results/{run}/promotion.json (the gate's verdict, or
    a later promote or rollback), else summary.json's optional `promotion` key (a string or a dict
    with status/reason). Older runs have neither."""
    promo = read_optional(results / run / "promotion.json")
    if promo is None:
        promo = summary.get("promotion")
    if isinstance(promo, dict):
        status = promo.get("status") or promo.get("decision") or ""
        reason = promo.get("reason") or ""
        return f"{status}: {reason}".strip(": ")
    return "" if promo is None else str(promo)


def _continued(summary: dict) -> str:
    """The parent a continued run started from, with its token saving; "" for a run from its base."""
    lineage = summary.get("lineage") if isinstance(summary.get("lineage"), dict) else {}
    if not lineage.get("parent"):
        return ""
    tokens = lineage.get("tokens") or {}
    n, m = tokens.get("trained"), tokens.get("full_retrain")
    saving = f" ({m / n:.1f}x fewer tokens)" if isinstance(n, int) and n and isinstance(m, int) else ""
    return f"continued from {lineage['parent']}{saving}"


def stack_changes(runs: list[dict]) -> list[str]:
    """Per run (oldest first): its stack hash, and when it differs from the last earlier run that
    recorded one, which components changed (llmft.core.stack.diff); "" for a run without a stack."""
    out, last = [], None
    for s in runs:
        stack = s.get("stack") if isinstance(s.get("stack"), dict) else {}
        if not stack.get("hash"):
            out.append("")
            continue
        line = str(stack["hash"])
        if last is not None and last.get("hash") != stack["hash"]:
            changes = stack_fp.diff(last.get("fingerprint"), stack.get("fingerprint"))
            line = f"changed ({stack_fp.diff_text(changes) or 'same components, new hash'}): {line}"
        out.append(line)
        last = stack
    return out


def collect_runs(results_dir: str | Path) -> list[dict]:
    """Every results/*/report/summary.json of a folder named as a run can be, oldest first (by
    generation time, then name)."""
    results = Path(results_dir)
    runs = []
    for path in sorted(results.glob("*/report/summary.json")):
        folder = path.parts[-3]
        if folder in RESERVED_RUNS:  # the nightly's link to the promoted run and its state: not runs
            continue
        if not is_run_name(folder):
            # No run is named so; its name would become a link (a `javascript:` folder, a scheme).
            log.warning("trend: %s is not a run folder (not a run name); left out", results / folder)
            continue
        summary = read_optional(path)
        if not isinstance(summary, dict):
            continue
        run = summary.get("run") or folder
        summary["_promotion"] = _promotion(results, folder, summary)
        summary["_dir"] = folder
        summary.setdefault("run", run)
        runs.append(summary)
    runs.sort(key=lambda s: (str(s.get("generated") or ""), str(s["run"])))
    return runs


def _metric(summary: dict, which: str, name: str):
    value = (summary.get(which) or {}).get(name)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _trend_charts(runs: list[dict]) -> str:
    """Exact match, loss, throughput and MFU per run, as SVG, runs along x."""
    ticks = [(i, str(s["run"])) for i, s in enumerate(runs)]

    def series(which: str, name: str) -> list[tuple[float, float]]:
        return [(i, v) for i, s in enumerate(runs) if (v := _metric(s, which, name)) is not None]

    def top(key: str) -> list[tuple[float, float]]:
        return [(i, s[key]) for i, s in enumerate(runs) if isinstance(s.get(key), (int, float))]

    return "".join(
        [
            svg_lines(
                {"tuned": series("tuned", "exact_match"), "base": series("base", "exact_match")},
                "Held-out exact match",
                "run",
                xticks=ticks,
            ),
            svg_lines(
                {"tuned": series("tuned", "eval_loss"), "base": series("base", "eval_loss")},
                "Held-out loss",
                "run",
                xticks=ticks,
            ),
            svg_lines(
                {"tokens/s per GPU": top("tokens_per_second_per_gpu")},
                "Training throughput",
                "run",
                xticks=ticks,
            ),
            svg_lines({"MFU": top("mfu")}, "Model FLOPs utilisation", "run", xticks=ticks),
        ]
    )


def build_trend(results_dir: str | Path, out_html: str | Path) -> list[dict]:
    """A page of held-out metrics and throughput per run, with links to each run's report."""
    runs = collect_runs(results_dir)
    out_html = Path(out_html)
    charts = _trend_charts(runs)
    rows, links = [], []
    stacks = stack_changes(runs)
    for s, stack in zip(runs, stacks, strict=True):
        rows.append(
            [
                s["run"],
                s.get("generated"),
                _metric(s, "base", "exact_match"),
                _metric(s, "tuned", "exact_match"),
                _metric(s, "tuned", "rouge_l"),
                _metric(s, "tuned", "eval_loss"),
                s.get("tokens_per_second_per_gpu"),
                f"{s['mfu']:.2%}" if isinstance(s.get("mfu"), (int, float)) else "n/a",
                s.get("data_fingerprint"),
                s.get("git_commit", "")[:10] if isinstance(s.get("git_commit"), str) else "",
                s["_promotion"],
                _continued(s),
                stack,
            ]
        )
        href = os.path.relpath(Path(results_dir) / s["_dir"] / "report" / "index.html", out_html.parent)
        links.append(f"<li><a href='{esc(href)}'>{esc(s['run'])}</a></li>")
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<title>llmft: trend across runs</title><style>{STYLE}</style></head><body>
<h1>llmft: trend across {len(runs)} run(s)</h1>
<p class="muted">Read from {esc(results_dir)}/*/report/summary.json at
{esc(datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))}.</p>
<div class="charts">{charts}</div>
{
        table(
            [
                "run",
                "generated",
                "base EM",
                "tuned EM",
                "tuned ROUGE-L",
                "tuned loss",
                "tokens/s/GPU",
                "MFU",
                "data fingerprint",
                "commit",
                "promotion",
                "continued from",
                "software stack",
            ],
            rows,
            ["warn" if x.startswith("changed") else "" for x in stacks],
        )
    }
{trend_section(runs)}
<h2>Run reports</h2><ul>{"".join(links)}</ul>
</body></html>
"""
    write_text(out_html, page)
    return runs
