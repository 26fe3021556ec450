"""The nightly gate's forgetting budget (nightly.max_benchmark_drop) against the promoted model."""

import json

from llmft.core.config import validate
from llmft.core.io import write_json
from llmft.core.settings import Config
from llmft.nightly.gate import benchmark_gate, decide
from llmft.nightly.run import _judge


def night(run, em, **acc):
    tasks = {t: {"metric": "acc", "higher_is_better": True, "tuned": v} for t, v in acc.items()}
    return {
        "run": run,
        "tuned": {"exact_match": em},
        "benchmarks": {"tasks": tasks},
        "heldout_fingerprint": "f",
    }


def current(summary):
    return {"run": summary["run"], "tuned": summary["tuned"], "benchmarks": summary["benchmarks"]["tasks"]}


def test_a_drop_over_the_budget_is_refused_naming_task_drop_and_budget():
    ok, why = benchmark_gate(night("b", 0.6, arc=0.40), current(night("a", 0.5, arc=0.55)), {"arc": 0.05})
    assert not ok
    assert "arc acc 0.4000 vs current 0.5500: dropped 0.1500, budget 0.05" in why and "run a" in why


def test_within_budget_unbudgeted_tasks_and_no_budget_pass():
    cur = current(night("a", 0.5, arc=0.55, mmlu=0.6))
    assert benchmark_gate(night("b", 0.6, arc=0.52, mmlu=0.1), cur, {"arc": 0.05})[0]
    assert not benchmark_gate(night("b", 0.6, arc=0.52, mmlu=0.1), cur, {"arc": 0.05, "*": 0.1})[0]
    assert benchmark_gate(night("b", 0.6, arc=0.0), cur, {})[0]
    assert benchmark_gate(night("b", 0.6, arc=0.0), None, {"*": 0.0})[0]  # the first night


def test_judge_keeps_current_where_it_was_when_a_benchmark_dropped(tmp_path):
    """Two nights through the real gate code and files: the second wins on held-out exact match but
    lost a task past its budget; results/current still points at the first."""
    cfg = Config.from_dict(validate({"nightly": {"max_benchmark_drop": {"llmft_category": 0.1}}})).nightly
    for run, summary in (
        ("n1", night("n1", 0.5, llmft_category=0.8)),
        ("n2", night("n2", 0.7, llmft_category=0.2)),
    ):
        (tmp_path / run / "report").mkdir(parents=True)
        (tmp_path / run / "report" / "summary.json").write_text(json.dumps(summary))
    state = {}
    _judge(cfg, tmp_path, "n1", {}, state)
    assert state["promoted"] == "n1" and (tmp_path / "current").resolve().name == "n1"
    night2 = {}
    # the night's gate rule (llmft gate) wrote its verdict against the promoted n1: nightly/gate.json
    current = json.loads((tmp_path / "current.json").read_text())
    write_json(
        tmp_path / "n2" / "nightly" / "gate.json", decide(cfg, night("n2", 0.7, llmft_category=0.2), current)
    )
    _judge(cfg, tmp_path, "n2", night2, state)
    assert (
        night2["status"] == "rejected" and "llmft_category acc 0.2000 vs current 0.8000" in night2["reason"]
    )
    assert "budget 0.1" in night2["reason"]
    assert (tmp_path / "current").resolve().name == "n1" and state["promoted"] == "n1"
    assert json.loads((tmp_path / "n2" / "promotion.json").read_text())["status"] == "rejected"
