"""The preference data stage in the DAG (snakemake -n): only with a preference section; the nightly
gate's preference evaluations (dry run, and one real pass on the builtin tiny model)."""

import json
import subprocess
import sys

from llmft.core.settings import Preference
from llmft.preference.evaluate import gate_block

from tests.conftest import REPO, make_workdir, snakemake


def _jobs(out: str) -> dict:
    """Job stats of a dry run: {rule: count}."""
    lines = out.split("Job stats:", 1)[1].splitlines()
    jobs = {}
    for line in lines[3:]:
        parts = line.split()
        if len(parts) != 2 or parts[0] == "total":
            break
        jobs[parts[0]] = int(parts[1])
    return jobs


def test_prepare_preference_is_in_the_dag_only_with_a_preference_section(tmp_path):
    plain = snakemake(make_workdir(tmp_path / "plain"), "-n")
    assert plain.returncode == 0, plain.stderr
    today = _jobs(plain.stdout + plain.stderr)
    assert "prepare_preference" not in today and "prepare_data" in today
    pref = snakemake(make_workdir(tmp_path / "pref", preference={}), "-n", "-p")
    assert pref.returncode == 0, pref.stderr
    out = pref.stdout + pref.stderr
    # the data stage, then the stage's render, training and its evaluation (base, sft, preference model)
    stage = {"prepare_preference": 1, "render_preference_config": 1, "preference": 1}
    stage["evaluate_preference"] = 3
    assert _jobs(out) == {**today, **stage, "all": 1}
    assert "python -m llmft prepare-preference --config-json" in out
    assert "--out-dir results/demo/preference/data" in out


def test_cached_reference_logps_put_the_reference_step_before_training(tmp_path):
    """preference.reference_logps: cached adds one preference_reference job (the reference model over
    the tokenized pairs into the shared store) before the stage's render and training; orpo, which has
    no reference, ignores the key; the demo's default (auto, CPU) has no such job (test above)."""
    res = snakemake(make_workdir(tmp_path / "w", preference={"reference_logps": "cached"}), "-n", "-p")
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    assert _jobs(out)["preference_reference"] == 1
    assert "python -m llmft reference-logps --config-json" in out
    assert "--model results/demo/sft/model --data-dir results/demo/preference/data" in out
    assert "--out results/demo/preference/reference/reference.json" in out
    orpo = snakemake(
        make_workdir(tmp_path / "o", preference={"loss": "orpo", "reference_logps": "cached"}), "-n"
    )
    assert orpo.returncode == 0, orpo.stderr
    assert "preference_reference" not in _jobs(orpo.stdout + orpo.stderr)
    # the nightly gate on a preference metric: the reference models' scores come from the store
    gate = {"nightly__metric": "preference_accuracy", "nightly__compare_with": "results/n1"}
    work = make_workdir(tmp_path / "g", preference={"reference_logps": "cached"}, **gate)
    for folder in ("sft/model", "preference/model"):
        (work / "results" / "n1" / folder).mkdir(parents=True)
    res = snakemake(work, "-n", "-p")
    assert res.returncode == 0, res.stderr
    lines = [line for line in (res.stdout + res.stderr).splitlines() if "evaluate-preference" in line]
    for side in ("gate_reference", "promoted_reference", "gate", "promoted"):
        (line,) = [x for x in lines if f"--label {side} " in x]
        cached = "--max-rows all --reference-cache results/cache/reference --threads" in line
        assert cached == side.endswith("_reference"), line


def test_a_preference_gate_scores_both_preference_models_on_every_heldout_pair(tmp_path):
    """nightly.metric preference_accuracy with a promoted run (nightly.compare_with, as the nightly
    sets it): its preference model, this run's, and each one's reference (their sft models) are
    scored on every held-out pair, log-probabilities only; the SFT gate's evaluations are not run.
    A promoted run without a preference model is refused by name before any job."""
    gate = {"nightly__metric": "preference_accuracy", "nightly__compare_with": "results/n1"}
    work = make_workdir(tmp_path / "w", preference={}, **gate)
    refused = snakemake(work, "-n")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "llmft config error: config key nightly.metric: preference_accuracy compares the preference" in (
        refused.stderr
    )
    assert (
        "the promoted run n1 (nightly.compare_with) has none (results/n1/preference/model" in refused.stderr
    )
    for folder in ("sft/model", "preference/model"):
        (work / "results" / "n1" / folder).mkdir(parents=True)
    res = snakemake(work, "-n", "-p")
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    jobs = _jobs(out)
    assert jobs["evaluate_preference_gate"] == 4 and jobs["evaluate"] == 2  # base and tuned only
    for side, model in (
        ("promoted", "results/n1/preference/model"),
        ("promoted_reference", "results/n1/sft/model"),
    ):
        assert f"--model {model} --heldout results/demo/preference/data/heldout.jsonl" in out
        assert (
            f"--out-dir results/demo/preference/gate/{side} --label {side} --logps-only --max-rows all" in out
        )


def test_the_preference_gate_scores_both_models_on_the_same_pairs_for_real(tmp_path):
    """Real jobs on the builtin tiny model (reference base): the promoted run's preference model, here
    the same seeded tiny model built apart, and the base model (this run's reference) on the gate's
    held-out pairs: nightly.gate_max_rows 6 of them, not the page's eval.max_rows 2, with one
    fingerprint and the same log-probabilities, so the promoted model against the reference ranks
    no pair. A promoted run without a preference model is refused before any job."""
    gate = {"nightly__metric": "reward_margin", "nightly__compare_with": "results/n1"}
    work = make_workdir(
        tmp_path / "w",
        preference={"start_from": "base", "data": {"synthetic_rows": 300}},
        nightly__gate_max_rows=6,
        eval__max_rows=2,
        **gate,
    )
    refused = snakemake(work, "-n")
    assert "config key nightly.metric: reward_margin compares the preference models" in refused.stderr
    assert refused.returncode != 0 and not (work / "results" / "demo").exists()
    promoted = work / "results" / "n1" / "preference" / "model"
    build = [sys.executable, "-m", "llmft", "base-model", "--config-json", '{"run": "n1"}']
    built = subprocess.run(
        [*build, "--out", str(promoted)], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert built.returncode == 0, built.stderr
    folder = work / "results" / "demo" / "preference" / "gate"
    targets = [f"results/demo/preference/gate/{side}/logps.jsonl" for side in ("gate_reference", "promoted")]
    res = snakemake(work, *targets)
    assert res.returncode == 0, res.stderr
    ours = json.loads((folder / "gate_reference" / "rows.json").read_text())
    theirs = json.loads((folder / "promoted" / "rows.json").read_text())
    assert ours["rows"] == theirs["rows"] == 6 and ours["kind"] == "dpo"
    assert ours["heldout_fingerprint"] == theirs["heldout_fingerprint"]
    assert (ours["model"], theirs["model"]) == ("results/demo/base_model", "results/n1/preference/model")
    block = gate_block(Preference(beta=0.1), folder / "promoted", folder / "gate_reference")
    assert block["tuned"]["preference_accuracy"] == 0.0 and block["tuned"]["reward_margin"] == 0.0
    assert (block["heldout_rows"], block["rows_unit"]) == (6, "pairs")
