"""A run's lineage on its page and in summary.json: what it started from, the chain back to the base
model, the data delta since its parent and the tokens it trained against a full retrain."""

from __future__ import annotations

from llmft.core.draw import esc
from llmft.core.lineage import chain_text, cost_line, lineage_head


def run_lineage(cfg: dict, sft_args: dict, stats: dict, stack: dict | None = None) -> dict:
    """summary.json's `lineage`: the head render-sft recorded in the YAML's llmft block (a run
    rendered before lineage existed: from its base model), prepare_data's counts, and the hash of
    the software stack it trained on (`stack`: llmft.core.stack.run_fingerprint's; None unrecorded)."""
    head = (sft_args.get("llmft") or {}).get("lineage") or lineage_head(None, cfg["model"]["name_or_path"])
    delta = stats.get("continue") or {}
    data = {k: delta.get(k) for k in ("new", "replayed", "removed", "train_rows")}
    if not delta:  # stats.json of an older prepare_data: every train row was new
        data.update(new=stats.get("train_rows"), replayed=0, removed=0, train_rows=stats.get("train_rows"))
    # the tokens the trainer feeds, as render-sft planned them (a run rendered before: one pass)
    cost = (sft_args.get("llmft") or {}).get("cost")
    tokens = cost or delta.get("tokens") or {"trained": None, "full_retrain": None}
    stack_hash = stack.get("hash") if isinstance(stack, dict) else None
    return {**head, "data": data, "tokens": dict(tokens), "stack": stack_hash}


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
