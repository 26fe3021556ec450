"""The nightly gate's one home (llmft.nightly.gate): gate.json from the night's evaluation files, on
each kind of nightly.metric, and the verdict the nightly acts on."""

import json

import pytest
from llmft.core.config import GATE_FILE, validate
from llmft.core.io import write_json
from llmft.core.settings import Config, replace
from llmft.nightly.gate import kind, night_verdict, promoted_problem, write_gate


def _eval(run_dir, which, fingerprint="rows-a", rows=40, **scores):
    write_json(
        run_dir / "eval" / which / "metrics.json",
        {"rows": rows, "heldout_fingerprint": fingerprint, **scores},
    )


def _promoted(results, run="n1", benchmarks=None):
    """The promoted run's summary.json, as its night's report wrote it."""
    summary = {"run": run, "tuned": {"exact_match": 0.1}, "heldout_fingerprint": "old"}
    if benchmarks:
        summary["benchmarks"] = {"tasks": benchmarks}
    write_json(results / run / "report" / "summary.json", summary)


def _cfg(**nightly):
    return Config.from_dict(validate({"run": "n2", "nightly": {"compare_with": "results/n1", **nightly}}))


@pytest.fixture
def night(tmp_path, monkeypatch):
    """results/n1 promoted, results/n2 tonight's run, the job's working directory above them."""
    monkeypatch.chdir(tmp_path)
    _promoted(tmp_path / "results")
    return tmp_path / "results" / "n2"


def _write(cfg, run_dir, **kw):
    verdict = write_gate(cfg, run_dir, run_dir / GATE_FILE, **kw)
    assert json.loads((run_dir / GATE_FILE).read_text()) == verdict
    return verdict


def test_the_metric_kind_is_decided_in_one_place():
    assert kind("preference_accuracy") == kind("reward_margin") == "preference"
    assert kind("exact_match") == kind("eval_loss") == "heldout"


@pytest.mark.parametrize(
    ("metric", "theirs", "ours", "ok"),
    [
        ("exact_match", 0.75, 0.5, True),  # worse by exactly the tolerance: promoted
        ("exact_match", 0.75, 0.4999, False),  # a hair more: refused
        ("eval_loss", 1.0, 1.25, True),  # lower is better: higher by exactly the tolerance
        ("eval_loss", 1.0, 1.2501, False),
    ],
)
def test_a_heldout_metric_passes_up_to_the_tolerance_and_is_refused_past_it(night, metric, theirs, ours, ok):
    _eval(night, "promoted", **{metric: theirs}, exact_match_by_task={"a": 0.5, "b": 1.0})
    _eval(night, "gate", **{metric: ours}, exact_match_by_task={"a": 0.25, "b": 1.0})
    verdict = _write(_cfg(metric=metric, tolerance=0.25), night)
    assert verdict["status"] == ("promoted" if ok else "rejected") and verdict["kind"] == "heldout"
    assert verdict["reason"].startswith(
        f"{verdict['status']}: {metric} {ours:.4f} vs current {theirs:.4f} (run n1)"
    )
    assert "on 40 held-out rows" in verdict["reason"] and "tolerance 0.25" in verdict["reason"]
    assert verdict["score"] == {metric: ours} and verdict["promoted_run"] == "n1"
    # both models on the same rows, with the per-task breakdown the page shows
    assert verdict["gate"]["tuned"][metric] == ours and verdict["compared_with"]["run"] == "n1"
    assert verdict["compared_with"]["exact_match_by_task"] == {"a": 0.5, "b": 1.0}
    assert verdict["gate"]["heldout_fingerprint"] == verdict["compared_with"]["heldout_fingerprint"]


def test_scores_on_other_rows_are_not_compared(night):
    _eval(night, "promoted", fingerprint="rows-a", exact_match=0.1)
    _eval(night, "gate", fingerprint="rows-b", exact_match=0.9)
    verdict = _write(_cfg(), night)
    assert verdict["status"] == "rejected" and verdict["reason"].startswith("rejected: not compared: run n2")


def test_a_missing_score_is_a_refusal_naming_the_metric_and_the_run(night):
    _eval(night, "promoted", exact_match=0.5)
    _eval(night, "gate")  # tonight's model has no exact_match
    verdict = _write(_cfg(), night)
    assert verdict["status"] == "rejected"
    assert (
        verdict["reason"] == "rejected: run n2 has no exact_match score in its summary.json (nightly.metric)"
    )
    _eval(night, "gate", exact_match=0.5)
    _eval(night, "promoted")  # the promoted model has none
    verdict = _write(_cfg(), night)
    assert (
        verdict["status"] == "rejected"
        and "the promoted run n1 has no exact_match score" in verdict["reason"]
    )


def _bench(run_dir, which, acc):
    tasks = {"arc": {"metrics": {"acc": acc}, "higher_is_better": {"acc": True}}}
    write_json(run_dir / "benchmarks" / which / "scores.json", {"tasks": tasks})


def test_the_benchmark_budget_refuses_a_drop_past_it_per_task(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = tmp_path / "results"
    _promoted(results, benchmarks={"arc": {"metric": "acc", "higher_is_better": True, "tuned": 0.6}})
    run = results / "n2"
    _eval(run, "promoted", exact_match=0.5)
    _eval(run, "gate", exact_match=0.9)  # better on the held-out metric ...
    _bench(run, "base", 0.3)
    cfg = Config.from_dict(
        validate(
            {"run": "n2", "eval": {"benchmarks": [{"task": "arc"}]}}
            | {"nightly": {"compare_with": "results/n1", "max_benchmark_drop": {"arc": 0.1}}}
        )
    )
    _bench(run, "tuned", 0.45)  # ... but arc fell 0.15, over its budget
    verdict = _write(cfg, run)
    assert verdict["status"] == "rejected"
    assert verdict["reason"] == (
        "rejected: benchmark forgetting (run n1): "
        "arc acc 0.4500 vs current 0.6000: dropped 0.1500, budget 0.1"
    )
    [row] = verdict["benchmarks"]
    assert row["task"] == "arc" and row["over"] and row["budget"] == 0.1
    _bench(run, "tuned", 0.55)  # within the budget
    verdict = _write(cfg, run)
    assert verdict["status"] == "promoted" and verdict["reason"].endswith(
        "; benchmarks within budget (1 task(s))"
    )
    assert not verdict["benchmarks"][0]["over"]


def test_a_preference_metric_compares_the_preference_models_the_stage_scored(night):
    """The preference stage's scores of both sides (given by the CLI); the gate judges them."""
    calls = []

    def sides(cfg, run_dir):
        calls.append(run_dir)
        block = {"heldout_rows": 4, "heldout_fingerprint": "pairs", "rows_unit": "pairs"}
        return (
            {"tuned": {"preference_accuracy": 0.75}, **block},
            {"run": "n1", "tuned": {"preference_accuracy": 1.0}, **block},
        )

    cfg = Config.from_dict(
        validate(
            {"run": "n2", "preference": {}}
            | {"nightly": {"metric": "preference_accuracy", "compare_with": "results/n1", "tolerance": 0.25}}
        )
    )
    verdict = _write(cfg, night, preference_sides=sides)
    assert calls == [night] and verdict["kind"] == "preference" and verdict["status"] == "promoted"
    assert verdict["reason"].startswith(
        "promoted: preference_accuracy 0.7500 vs current 1.0000 (run n1) on 4"
    )
    assert "held-out pairs" in verdict["reason"]
    cfg = replace(cfg, "nightly.tolerance", 0.2)
    verdict = _write(cfg, night, preference_sides=sides)
    assert verdict["status"] == "rejected" and "worse by 0.2500, tolerance 0.2" in verdict["reason"]


def test_a_promoted_run_without_a_preference_model_is_named_before_any_job(tmp_path):
    night = Config.from_dict(validate({"preference": {}, "nightly": {"metric": "reward_margin"}})).nightly
    why = promoted_problem(night, tmp_path, "n1")
    assert why.startswith("nightly.metric reward_margin: the promoted run n1 has no preference model")
    (tmp_path / "n1" / "preference" / "model").mkdir(parents=True)
    assert promoted_problem(night, tmp_path, "n1") is None and promoted_problem(night, tmp_path, None) is None
    assert promoted_problem(Config().nightly, tmp_path, "n0") is None  # a held-out metric needs nothing more


def test_the_nightly_acts_on_gate_json_and_judges_a_first_model_from_its_summary(night):
    cfg = _cfg()
    write_json(night / "report" / "summary.json", {"run": "n2", "tuned": {"exact_match": 0.5}})
    first = night_verdict(cfg.nightly, night, None)
    assert first["status"] == "promoted" and first["reason"] == "first promoted model (exact_match 0.5000)"
    # a promoted model and no gate.json: refused, naming the file
    missing = night_verdict(cfg.nightly, night, {"run": "n1"})
    assert missing["status"] == "rejected" and missing["reason"].startswith("rejected: not compared: ")
    assert "nightly/gate.json" in missing["reason"]
    _eval(night, "promoted", exact_match=0.5)
    _eval(night, "gate", exact_match=0.5)
    verdict = _write(cfg, night)
    assert night_verdict(cfg.nightly, night, {"run": "n1"}) == verdict
    # judged against another run than the one promoted now: refused
    other = night_verdict(cfg.nightly, night, {"run": "n0"})
    assert (
        other["status"] == "rejected" and "compared with run n1, not the promoted run n0" in other["reason"]
    )
