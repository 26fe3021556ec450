"""The gate's pass takes the page's scores only for the same model on the same held-out rows."""

from __future__ import annotations

from llmft.core.config import validate
from llmft.core.heldout import heldout_fingerprint
from llmft.core.io import read_json, read_jsonl, write_json, write_jsonl
from llmft.core.settings import Config
from llmft.evaluate.reuse import reuse

MODEL = "results/n2/sft/model"


def _tuned(tmp_path, rows: int = 4, model: str = MODEL):
    """A held-out split of 6 rows and the page's evaluation of `model` on its first `rows`."""
    heldout = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(6)]
    write_jsonl(tmp_path / "heldout.jsonl", heldout)
    tuned = tmp_path / "eval" / "tuned"
    write_jsonl(tuned / "predictions.jsonl", [{"prediction": f"a{i}"} for i in range(rows)])
    metrics = {"label": "tuned", "model": model, "exact_match": 0.75}
    write_json(
        tuned / "metrics.json", {**metrics, "heldout_fingerprint": heldout_fingerprint(heldout[:rows])}
    )
    return str(tmp_path / "heldout.jsonl"), str(tuned)


def test_the_same_model_on_the_same_rows_is_taken_as_the_gates(tmp_path):
    heldout, tuned = _tuned(tmp_path)
    cfg = Config.from_dict(validate({"eval": {"max_rows": 4}}))
    out = tmp_path / "eval" / "gate"
    assert reuse(cfg, MODEL, heldout, 4, tuned, str(out), "gate")
    metrics = read_json(out / "metrics.json")
    assert metrics["label"] == "gate" and metrics["scores_of"] == "tuned" and metrics["exact_match"] == 0.75
    assert read_jsonl(out / "predictions.jsonl") == read_jsonl(f"{tuned}/predictions.jsonl")


def test_other_rows_another_model_or_a_missing_folder_are_evaluated(tmp_path):
    heldout, tuned = _tuned(tmp_path)
    cfg = Config.from_dict(validate({"eval": {"max_rows": 4}}))
    out = tmp_path / "eval" / "gate"
    assert not reuse(cfg, MODEL, heldout, "all", tuned, str(out), "gate")  # 6 rows, not the page's 4
    assert not reuse(cfg, MODEL, heldout, 3, tuned, str(out), "gate")
    assert not reuse(cfg, "results/n1/sft/model", heldout, 4, tuned, str(out), "gate")
    assert not reuse(cfg, MODEL, heldout, 4, str(tmp_path / "nowhere"), str(out), "gate")
    assert not out.exists()
