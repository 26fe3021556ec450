"""The preference section's warning of a stage that hardly moved, at its thresholds (preference/page.py);
the pipeline's own pages are checked in tests/workflow/test_preference.py."""

import pytest
from llmft.preference.page import hardly_moved, section


def block(first, final, before, after, start="sft"):
    models = {"base": {"likelihood_accuracy": 0.5}, "sft": {"likelihood_accuracy": before}}
    models[start]["likelihood_accuracy"] = before
    models["preference"] = {"likelihood_accuracy": after, "preference_accuracy": 0.84}
    train = {"steps": 11, "first_loss": first, "final_loss": final, "learning_rate": 5e-7}
    return {"method": "dpo", "loss": "sigmoid", "beta": 0.1, "reference": start, "start": start,
            "models": models, "train": train}  # fmt: skip


@pytest.mark.parametrize(
    "first,final,before,after,warned",
    [
        (0.6921473503112793, 0.6915, 0.24, 0.24, True),  # the demo at 5e-7: -0.09 %, +0 points
        (0.7, 0.6931, 0.24, 0.25, True),  # -0.99 %, +1 point: both under
        (0.7, 0.693, 0.24, 0.24, False),  # the loss moved 1 %
        (0.6921, 0.6915, 0.24, 0.26, False),  # the likelihood accuracy moved 2 points
        (0.6921, 0.6915, 0.26, 0.24, False),  # ... either way
    ],
)
def test_a_run_is_named_hardly_moved_only_under_both_thresholds(first, final, before, after, warned):
    warning = hardly_moved(block(first, final, before, after))
    assert (warning is not None) == warned
    if warned:
        assert warning["name"] == "preference_hardly_moved"
        assert warning["loss_change_percent"] == pytest.approx(100 * (final - first) / first, abs=1e-3)
        assert warning["likelihood_accuracy_change_points"] == pytest.approx(100 * (after - before))


def test_the_warning_compares_with_the_model_the_stage_started_from():
    # from base: base's likelihood accuracy is the one before, sft's does not count
    b = block(0.5, 0.4999, 0.30, 0.31, start="base")
    b["models"]["sft"]["likelihood_accuracy"] = 0.9
    assert hardly_moved(b)["likelihood_accuracy_change_points"] == pytest.approx(1.0)


def test_the_warning_leads_the_section_with_rounded_numbers():
    b = block(0.6921473503112793, 0.6915409803390503, 0.24, 0.24)
    b["warnings"] = [hardly_moved(b)]
    html = section(b)
    head = html.split("<table", 1)[0]
    assert "preference_hardly_moved" in head
    assert (
        "0.6921 -&gt; 0.6915 (-0.088 %, under 1 %)" in head
        and "0.24 (sft) -&gt; 0.24 (+0 points, under 2)" in head
    )
    assert "0.6921473503112793" not in html and "0.6915409803390503" not in html
