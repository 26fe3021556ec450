"""A move of results/current by hand (`llmft promote` / `llmft rollback`) on the runs it concerns:
their promotion.json, summary.json and page, and the trend page."""

from __future__ import annotations

from pathlib import Path

from llmft.core.io import read_optional, write_json
from llmft.report.page import set_promotion
from llmft.report.trend import build_trend


def show_move(results: Path, entry: dict, statuses: dict) -> list[str]:
    """After a move by hand: each run's promotion.json, summary.json and page say what happened to
    it, and results/trend.html is drawn again. Returns a note for each page it could not rewrite."""
    verb = "rolled back" if entry["action"] == "rollback" else "moved"
    how = f"by hand ({entry['who']}, {entry['at']}): {entry['why']}"
    notes = []
    for run, status in statuses.items():
        if not run or not (results / run).is_dir():
            continue
        if status == "promoted":
            reason = f"results/current {verb} here from {entry['from'] or 'none'} {how}"
        else:
            reason = f"results/current {verb} from here to {entry['to']} {how}"
        path = results / run / "promotion.json"
        earlier = read_optional(path, {}) or {}
        earlier = earlier if isinstance(earlier, dict) else {}
        moved = {**earlier, "status": status, "reason": reason}
        moved.setdefault("gate", {k: earlier.get(k) for k in ("status", "reason")} if earlier else None)
        write_json(path, moved)
        if not set_promotion(results / run / "report", moved):
            notes.append(
                f"run {run}: its page has no promotion line to rewrite (made before it had one); "
                f"`snakemake --forcerun report --config run={run}` draws it again"
            )
    build_trend(results, results / "trend.html")
    return notes
