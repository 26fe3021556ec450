"""A run's lineage on its page: what it started from, the chain back to the base model, the data delta
since its parent and the tokens it trained against a full retrain (summary.json's `lineage`, from the
run's lineage.json: llmft.core.lineage_record.summary_view)."""

from __future__ import annotations

from llmft.core.draw import esc
from llmft.core.lineage import chain_text, cost_line


def lineage_html(lineage: dict) -> str:
    """The page's lines: started from, the chain, the rows and the cost."""
    if not lineage.get("parent"):
        return f"<p>Started from the base model <code>{esc(lineage.get('started_from'))}</code>.</p>"
    d = lineage["data"]
    cost = cost_line(lineage.get("tokens"))
    return (
        f"<p class='verdict'>Continued from run <b>{esc(lineage['parent'])}</b>: started from "
        f"<code>{esc(lineage.get('started_from'))}</code>. Chain: {esc(chain_text(lineage))}. "
        f"Rows: {esc(d.get('new'))} new, {esc(d.get('replayed'))} replayed, {esc(d.get('removed'))} removed "
        f"since {esc(lineage['parent'])} ({esc(d.get('train_rows'))} trained)."
        + (f" Cost: {esc(cost)} (tokens the trainer feeds, every epoch)." if cost else "")
        + "</p>"
    )
