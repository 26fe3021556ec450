"""Standard benchmarks base vs tuned (results/{run}/benchmarks/): per task, lm-eval's metric with its
standard error, and a verdict naming every task whose tuned score fell beyond its noise."""

from __future__ import annotations

import math
from pathlib import Path

from llmft.core.draw import esc, table
from llmft.core.io import read_optional

# A drop counts as a regression past this many standard errors of the difference (about 95 %).
NOISE_SE = 2.0


def _primary(task: dict) -> str | None:
    """The task's headline metric: lm-eval's first reported metric (its metric_list order)."""
    return next(iter(task.get("metrics", {})), None)


def _side_by_side(b: dict, t: dict, metric: str) -> dict:
    """One metric base vs tuned: values, standard errors, change, noise, whether it regressed."""
    bv, tv = b["metrics"][metric], t["metrics"][metric]
    bs, ts = b.get("stderr", {}).get(metric) or 0.0, t.get("stderr", {}).get(metric) or 0.0
    higher = t.get("higher_is_better", {}).get(metric, True)
    noise = NOISE_SE * math.hypot(bs, ts)
    worse = (bv - tv) if higher else (tv - bv)
    return {
        "metric": metric,
        "higher_is_better": higher,
        "base": bv,
        "base_stderr": bs,
        "tuned": tv,
        "tuned_stderr": ts,
        "change": round(tv - bv, 6),
        "noise": round(noise, 6),
        "regressed": worse > noise,
    }


def compare(base: dict, tuned: dict) -> dict:
    """summary.json's "benchmarks": per task base vs tuned on its headline metric (the verdict's and
    the nightly gate's), with every metric both models reported under `all`."""
    rows = {}
    for name, t in tuned.get("tasks", {}).items():
        metric = _primary(t)
        b = base.get("tasks", {}).get(name, {})
        if metric is None or metric not in b.get("metrics", {}):
            continue
        every = [m for m in t["metrics"] if m in b["metrics"]]
        rows[name] = _side_by_side(b, t, metric) | {"all": [_side_by_side(b, t, m) for m in every]}
    regressed = [n for n, r in rows.items() if r["regressed"]]
    return {"tasks": rows, "regressed": regressed, "verdict": verdict(rows, regressed)}


def verdict(rows: dict, regressed: list[str]) -> str:
    if not rows:
        return "no benchmark scores"
    if not regressed:
        return f"no benchmark regressed beyond its noise ({len(rows)} task(s))"
    named = "; ".join(
        f"{n}: {rows[n]['metric']} {rows[n]['base']:.4f} -> {rows[n]['tuned']:.4f} "
        f"(noise ±{rows[n]['noise']:.4f})"
        for n in regressed
    )
    return f"regressed beyond noise: {named}"


def load(run_dir: Path) -> dict | None:
    """The comparison of the run's two benchmark jobs, or None when it has none."""
    base = read_optional(run_dir / "benchmarks/base/scores.json")
    tuned = read_optional(run_dir / "benchmarks/tuned/scores.json")
    if not base or not tuned:
        return None
    return compare(base, tuned) | {"lm_eval": tuned.get("lm_eval")}


def section(cmp: dict | None) -> str:
    """The page's table: every metric each task reported, its headline metric (the verdict's and
    the nightly gate's) first and marked."""
    if not cmp:
        return ""
    rows = []
    for n, head in cmp["tasks"].items():
        for r in head.get("all") or [head]:
            rows.append(
                [
                    n,
                    r["metric"] + (" (headline)" if r["metric"] == head["metric"] else ""),
                    f"{r['base']:.4f} ± {r['base_stderr']:.4f}",
                    f"{r['tuned']:.4f} ± {r['tuned_stderr']:.4f}",
                    f"{r['change']:+.4f}",
                    "regressed" if r["regressed"] else "",
                ]
            )
    return f"""<h2 id="benchmarks">Standard benchmarks: base vs tuned</h2>
<p><strong>{esc(cmp["verdict"])}</strong></p>
{table(["task", "metric", "base ± stderr", "tuned ± stderr", "change", ""], rows)}
<p class="muted">lm-eval {esc(cmp.get("lm_eval"))}; every metric a task reports; a metric regressed
when its drop exceeds {NOISE_SE:g} standard errors of the difference. The verdict and the nightly
gate read each task's headline metric (the first its metric_list names).</p>
"""


def trend_section(runs: list[dict]) -> str:
    """The trend page's benchmark table: each run's tuned score per task and its verdict."""
    benched = [s for s in runs if isinstance(s.get("benchmarks"), dict)]
    if not benched:
        return ""
    tasks = sorted({t for s in benched for t in s["benchmarks"].get("tasks", {})})
    rows = []
    for s in benched:
        got = s["benchmarks"].get("tasks", {})
        cells = [f"{got[t]['tuned']:.4f}" if t in got else "" for t in tasks]
        rows.append([s["run"], *cells, s["benchmarks"].get("verdict", "")])
    return f"""<h2>Standard benchmarks across runs (tuned)</h2>
{table(["run", *tasks, "verdict"], rows)}
"""
