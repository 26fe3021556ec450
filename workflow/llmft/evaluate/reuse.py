"""Scores an evaluation already made: the nightly gate's pass over this run's tuned model takes the
page's (eval/tuned) when it would score the same model on the same held-out rows, instead of loading
the model and generating the same answers again. Reads JSON only (no torch)."""

from __future__ import annotations

from pathlib import Path

from llmft.core.heldout import heldout_fingerprint, heldout_rows
from llmft.core.io import read_json, read_jsonl, write_json, write_jsonl
from llmft.core.settings import Config


def reuse(cfg: Config, model: str, heldout: str, max_rows, source: str, out_dir: str, label: str) -> bool:
    """Copy `source`'s predictions and metrics into `out_dir` as `label`'s when `source` scored the
    folder `model` on the rows this evaluation would score (their fingerprint); False, writing
    nothing, otherwise (the caller evaluates)."""
    src = Path(source)
    try:
        metrics = read_json(src / "metrics.json")
        predictions = read_jsonl(src / "predictions.jsonl")
    except (OSError, ValueError):
        return False
    rows = heldout_rows(heldout, cfg.eval.max_rows, max_rows)
    if metrics.get("model") != str(model) or metrics.get("heldout_fingerprint") != heldout_fingerprint(rows):
        return False
    if len(predictions) != len(rows):
        return False
    out = Path(out_dir)
    write_jsonl(out / "predictions.jsonl", predictions)
    write_json(out / "metrics.json", {**metrics, "label": label, "scores_of": metrics.get("label")})
    return True
