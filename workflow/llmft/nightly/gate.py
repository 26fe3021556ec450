"""The nightly gate, decided here only: whether tonight's model may replace the promoted one.

With nightly.compare_with (set by the nightly when a model is promoted) the gate rule
(rules/gate.smk) runs `llmft gate`, which writes results/<run>/nightly/gate.json (write_gate): the
metric's kind (a held-out metric evaluate scores, or a preference metric the preference stage scores
on its held-out pairs), both models' scores on the same rows (`gate`: this run's, `compared_with`:
the promoted run's, with exact match per task where the rows name several), the benchmark budget per
task, and the verdict. The report renders it; the nightly (run.py) acts on it (night_verdict). A night
with nothing promoted compares with nothing: its verdict is made from its summary.json (decide with
no current model).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmft.core.config import GATE_FILE, HELDOUT_METRICS, ConfigError, is_preference_metric
from llmft.core.io import read_json, read_optional, write_json
from llmft.core.settings import Config, Nightly

LOWER_IS_BETTER = {"eval_loss"}
# A preference metric's two sides: (config, run folder) -> (gate, compared_with), each model's scores on
# the gate's pairs (tuned, heldout_rows, heldout_fingerprint, rows_unit) as the preference stage scores
# them (llmft.preference.page.gate_blocks, given by the CLI: a stage imports no other).
Sides = Callable[[Config, Path], tuple[dict, dict]]


def kind(metric: str) -> str:
    """nightly.metric's kind: `preference` (the preference models on the held-out pairs) or `heldout`
    (evaluate's scores on the held-out rows)."""
    return "preference" if is_preference_metric(metric) else "heldout"


def promoted_problem(night: Nightly, results: Path, promoted: str | None) -> str | None:
    """Before any job: why the promoted run cannot be compared on nightly.metric tonight (a preference
    metric needs its preference model), or None."""
    metric = night.metric
    if not promoted or kind(metric) != "preference":
        return None
    model = results / promoted / "preference" / "model"
    if model.is_dir():
        return None
    return (
        f"nightly.metric {metric}: the promoted run {promoted} has no preference model ({model} does "
        "not exist) to score on tonight's held-out pairs; promote a run with a preference stage "
        "(`llmft promote RUN`) or gate on another metric"
    )


def gate(new: dict, current: dict | None, metric: str, tolerance: float) -> tuple[bool, str]:
    """Promote unless the new model is worse than the current one by more than `tolerance`; `new`
    is gate_view(summary): its scores on the rows (or pairs) `current`'s were scored on. A score
    that is missing is a rejection naming the metric and the run, never a promotion."""
    value = (new.get("tuned") or {}).get(metric)
    if value is None:
        return False, f"rejected: run {new['run']} has no {metric} score in its summary.json (nightly.metric)"
    if current is None:
        return True, f"first promoted model ({metric} {value:.4f})"
    ref = (current.get("tuned") or {}).get(metric)
    if ref is None:
        return False, (
            f"rejected: not compared: the promoted run {current['run']} has no {metric} score "
            f"(nightly.metric) on the rows run {new['run']} was scored on"
        )
    unit = new.get("rows_unit") or "rows"
    rows = f" on {new['heldout_rows']} held-out {unit}" if new.get("heldout_rows") else ""
    ok = value <= ref + tolerance if metric in LOWER_IS_BETTER else value >= ref - tolerance
    verdict = "promoted" if ok else "rejected"
    return ok, (
        f"{verdict}: {metric} {value:.4f} vs current {ref:.4f} (run {current['run']}){rows}; "
        f"{_change(metric, value, ref)}, tolerance {tolerance}"
    )


def _change(metric: str, value: float, ref: float) -> str:
    """ "better by 0.0175" / "worse by 0.0040": the difference of the two scores as printed, so the
    words agree with the numbers beside them."""
    gain = round(value, 4) - round(ref, 4)
    gain = -gain if metric in LOWER_IS_BETTER else gain
    if abs(gain) < 0.00005:
        return "the same to 4 decimals"
    return f"{'better' if gain > 0 else 'worse'} by {abs(gain):.4f}"


def benchmark_rows(new: dict, current: dict | None, budget: dict) -> list[dict]:
    """Per benchmark task with a budget (nightly.max_benchmark_drop: the task's, else `*`) that both
    models were scored on with the same headline metric: both scores, the drop and whether it is over
    the budget. A task the promoted model was not scored on is not gated."""
    if not budget or current is None:
        return []
    ours = (new.get("benchmarks") or {}).get("tasks") or {}
    theirs = current.get("benchmarks") or {}
    rows = []
    for task, row in ours.items():
        limit = budget.get(task, budget.get("*"))
        ref = theirs.get(task)
        if limit is None or ref is None or ref.get("metric") != row["metric"]:
            continue
        drop = (ref["tuned"] - row["tuned"]) if row["higher_is_better"] else (row["tuned"] - ref["tuned"])
        rows.append(
            {"task": task, "metric": row["metric"], "tuned": row["tuned"], "current": ref["tuned"]}
            | {"drop": drop, "budget": limit, "over": drop > limit}
        )
    return rows


def benchmark_gate(new: dict, current: dict | None, budget: dict) -> tuple[bool, str]:
    """Refuse a model whose benchmark score fell below the promoted model's by more than the task's
    budget (benchmark_rows); (True, "") without a budget or a promoted model."""
    if not budget or current is None:
        return True, ""
    rows = benchmark_rows(new, current, budget)
    over = [
        f"{r['task']} {r['metric']} {r['tuned']:.4f} vs current {r['current']:.4f}: "
        f"dropped {r['drop']:.4f}, budget {r['budget']}"
        for r in rows
        if r["over"]
    ]
    if over:
        return False, f"rejected: benchmark forgetting (run {current['run']}): " + "; ".join(over)
    return True, f"benchmarks within budget ({len(rows)} task(s))"


def gate_view(summary: dict) -> dict:
    """The new model's scores the gate compares: its `gate` scores (eval/gate: every held-out row, or
    nightly.gate_max_rows) when the night scored them, else the page's (eval.max_rows rows)."""
    scores = summary.get("gate") or summary
    return {
        "run": summary["run"],
        "tuned": scores.get("tuned"),
        "heldout_rows": scores.get("heldout_rows"),
        "heldout_fingerprint": scores.get("heldout_fingerprint"),
        "rows_unit": scores.get("rows_unit"),  # pairs (or KTO rows) on a preference metric
    }


def same_rows_reference(summary: dict, current: dict | None) -> tuple[dict | None, str | None]:
    """The promoted model's held-out scores on the rows the new model was scored on: (reference,
    None), or (None, why not) when no such scores exist; (None, None) when nothing is promoted.

    The split never moves (rows are assigned by content), but appended rows add held-out rows, so
    the promoted model's own summary scored other rows than tonight's. The nightly therefore has
    tonight's run score the promoted model too (nightly.compare_with -> eval/promoted, `compared_with`),
    and its own tuned model again (eval/gate, `gate`), both on every held-out row; the fingerprint of
    the rows each evaluation scored must match.
    """
    if current is None:
        return None, None
    promoted = current["run"]
    ref = {"run": promoted, "tuned": current.get("tuned"), "benchmarks": current.get("benchmarks")}
    fingerprint = current.get("heldout_fingerprint")
    compared = summary.get("compared_with") or {}
    if compared.get("run") == promoted:  # the promoted model, scored in tonight's run
        ref["tuned"], fingerprint = compared["tuned"], compared.get("heldout_fingerprint")
    ours = gate_view(summary)["heldout_fingerprint"]
    if ours is None or ours != fingerprint:
        return None, (
            f"rejected: not compared: run {summary['run']} was scored on held-out rows {ours} and the "
            f"promoted run {promoted} on {fingerprint}; the gate compares scores on the same rows only "
            f"(nightly.compare_with scores the promoted model on this run's held-out split)"
        )
    return ref, None


def promoted_record(summary: dict) -> dict:
    """What a later night's gate compares against, from a promoted run's summary.json (results/
    current.json holds it, with why): its scores on the gate's rows when its night scored them (else
    the page's), their fingerprint, and its benchmark scores per task for the forgetting budget."""
    scores = summary.get("gate") or summary
    record = {
        "run": summary.get("run"),
        "tuned": scores.get("tuned"),
        "heldout_fingerprint": scores.get("heldout_fingerprint"),
    }
    if summary.get("benchmarks"):
        record["benchmarks"] = summary["benchmarks"]["tasks"]
    return record


def score_block(scores: dict) -> dict:
    """One model's scores on the gate's rows (an evaluate metrics.json), with exact match per task
    (the rows' `task` field) where the rows name more than one task: which skill a refused night lost
    shows there."""
    block = {
        "tuned": {m: scores.get(m) for m in HELDOUT_METRICS},
        "heldout_rows": scores.get("rows"),
        "heldout_fingerprint": scores.get("heldout_fingerprint"),
    }
    by_task = scores.get("exact_match_by_task") or {}
    if len(by_task) > 1:
        block["exact_match_by_task"] = by_task
    return block


def heldout_sides(run_dir: Path, promoted: str) -> tuple[dict, dict]:
    """A held-out metric's two sides: this run's tuned model (eval/gate) and the promoted run's
    (eval/promoted), both on the gate's rows (every row of this run's split, or nightly.gate_max_rows)."""
    ours = score_block(read_json(run_dir / "eval" / "gate" / "metrics.json"))
    theirs = score_block(read_json(run_dir / "eval" / "promoted" / "metrics.json"))
    return ours, {"run": promoted, **theirs}


def bench_tasks(run_dir: Path) -> dict | None:
    """This run's tuned model per benchmark task (benchmarks/), on the task's headline metric (the first
    lm-eval reports) where the base model has it too; None without both benchmark jobs."""
    base = read_optional(run_dir / "benchmarks" / "base" / "scores.json")
    tuned = read_optional(run_dir / "benchmarks" / "tuned" / "scores.json")
    if not base or not tuned:
        return None
    tasks = {}
    for name, t in tuned.get("tasks", {}).items():
        metric = next(iter(t.get("metrics", {})), None)
        if metric is None or metric not in base.get("tasks", {}).get(name, {}).get("metrics", {}):
            continue
        higher = t.get("higher_is_better", {}).get(metric, True)
        tasks[name] = {"metric": metric, "higher_is_better": higher, "tuned": t["metrics"][metric]}
    return tasks


def decide(n: Nightly, night: dict, current: dict | None) -> dict:
    """The verdict (gate.json): `night` holds the new model's scores in summary.json's form (`gate` and
    `compared_with` when the night scored both models, `benchmarks`), `current` the promoted model's
    record (promoted_record; None: nothing promoted, the first model is promoted when it has a score)."""
    metric, budget = n.metric, n.max_benchmark_drop
    reference, mismatch = same_rows_reference(night, current)
    if mismatch:
        ok, reason = False, mismatch
    else:
        ok, reason = gate(gate_view(night), reference, metric, n.tolerance)
    if ok:
        ok, why = benchmark_gate(night, reference, budget)
        reason = why if not ok else "; ".join(filter(None, [reason, why]))
    return {
        "run": night["run"],
        "promoted_run": current["run"] if current else None,
        "metric": metric,
        "kind": kind(metric),
        "tolerance": n.tolerance,
        "status": "promoted" if ok else "rejected",
        "reason": reason,
        "score": {metric: (gate_view(night)["tuned"] or {}).get(metric)},
        "gate": night.get("gate"),
        "compared_with": night.get("compared_with"),
        "benchmarks": benchmark_rows(night, reference, budget) if reference else [],
    }


def write_gate(cfg: Config, run_dir: Path, out: Path, preference_sides: Sides | None = None) -> dict:
    """`llmft gate`: tonight's model against the promoted run (nightly.compare_with) on the same rows,
    the verdict written to `out` (gate.json)."""
    promoted = Path(cfg.nightly.compare_with)
    if kind(cfg.nightly.metric) == "preference":
        if preference_sides is None or cfg.preference is None:
            raise ConfigError(f"config key nightly.metric: {cfg.nightly.metric} needs a preference stage")
        ours, theirs = preference_sides(cfg, run_dir)
    else:
        ours, theirs = heldout_sides(run_dir, promoted.name)
    night = {"run": cfg.run, "gate": ours, "compared_with": theirs}
    tasks = bench_tasks(run_dir) if cfg.eval.benchmarks else None
    if tasks is not None:
        night["benchmarks"] = {"tasks": tasks}
    summary = read_optional(promoted / "report" / "summary.json", {}) or {}
    current = {**promoted_record(summary), "run": promoted.name}
    verdict = decide(cfg.nightly, night, current)
    write_json(out, verdict)
    return verdict


def night_verdict(n: Nightly, run_dir: Path, current: dict | None) -> dict:
    """What the nightly acts on once the run finished: its gate.json when a model was promoted
    (`current`: results/current.json), else the first model's verdict from its summary.json. A
    missing gate.json, or one judged against another run than the promoted one, is a rejection."""
    summary = read_json(run_dir / "report" / "summary.json")
    if current is None:
        return decide(n, summary, None)
    path = run_dir / GATE_FILE
    verdict = read_optional(path)
    if not isinstance(verdict, dict):
        why = f"the night's gate wrote no {path} (the gate rule runs with nightly.compare_with)"
    elif verdict.get("promoted_run") != current["run"]:
        why = f"{path} compared with run {verdict.get('promoted_run')}, not the promoted run {current['run']}"
    else:
        return verdict
    return {
        **decide(n, summary, None),
        "promoted_run": current["run"],
        "status": "rejected",
        "reason": f"rejected: not compared: {why}",
    }
