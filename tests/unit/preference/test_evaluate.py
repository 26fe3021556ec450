"""Preference scores from log-probabilities (preference/evaluate.py), counted by hand."""

import pytest
from llmft.core.io import write_jsonl
from llmft.core.settings import Preference
from llmft.preference.evaluate import answer_rows, score, scores


def pair(chosen, rejected, ct=2, rt=2):
    return {"kind": "dpo", "chosen": chosen, "rejected": rejected, "chosen_tokens": ct, "rejected_tokens": rt}


def test_dpo_accuracy_and_margin_against_the_reference():
    policy = [pair(-1.0, -3.0), pair(-2.0, -1.0), pair(-4.0, -4.5)]
    ref = [pair(-2.0, -2.0), pair(-2.0, -2.0), pair(-4.0, -4.0)]
    s = score(policy, ref, beta=0.5)
    # rewards (c, r): (0.5, -0.5), (0, 0.5), (0, -0.25): the first and the third rank chosen higher
    assert s["preference_accuracy"] == pytest.approx(2 / 3, abs=1e-4)
    assert s["reward_margin"] == pytest.approx((1.0 - 0.5 + 0.25) / 3, abs=1e-4)
    assert s["likelihood_accuracy"] == pytest.approx(2 / 3, abs=1e-4)
    # chosen - rejected log-likelihoods 2, -1, 0.5; the reward margin is beta x (this - the reference's)
    assert s["likelihood_margin"] == pytest.approx(1.5 / 3, abs=1e-4)
    ref_margin = score(ref, None, beta=0.5)["likelihood_margin"]
    assert s["reward_margin"] == pytest.approx(0.5 * (s["likelihood_margin"] - ref_margin), abs=1e-4)
    # the reference against itself ranks nothing
    same = score(ref, ref, beta=0.5)
    assert (same["preference_accuracy"], same["reward_margin"]) == (0.0, 0.0)


def test_without_a_reference_the_reward_is_length_normalised():
    s = score([pair(-3.0, -4.0, ct=1, rt=4)], None, beta=2.0)
    # 2 x -3 / 1 = -6 against 2 x -4 / 4 = -2: the longer rejected answer wins per token
    assert s["preference_accuracy"] == 0.0 and s["reward_margin"] == pytest.approx(-4.0)
    assert s["likelihood_accuracy"] == 1.0


def test_kto_rewards_by_tag_and_pairs_by_prompt():
    def row(logp, tag, prompt):
        return {"kind": "kto", "logp": logp, "tokens": 1, "kto_tag": tag, "prompt": prompt}

    policy = [row(-1.0, True, "a"), row(-3.0, False, "a"), row(-2.0, True, "b"), row(-1.0, False, "b")]
    ref = [row(-2.0, True, "a"), row(-2.0, False, "a"), row(-2.0, True, "b"), row(-2.0, False, "b")]
    s = score(policy, ref, beta=1.0)
    # rewards: a+ 1, a- -1, b+ 0, b- 1: right signs for a+ and a-
    assert s["preference_accuracy"] == 0.5
    assert s["reward_margin"] == pytest.approx((1 + 0) / 2 - (-1 + 1) / 2)
    assert (s["likelihood_accuracy"], s["likelihood_pairs"]) == (0.5, 2)
    # same-prompt pairs (a+, a-) and (b+, b-): log-likelihood gaps 2 and -1
    assert s["likelihood_margin"] == pytest.approx(0.5)


def test_the_reference_model_gets_no_reward_scores_of_its_own(tmp_path):
    files = {
        "sft": [pair(-2.0, -2.5), pair(-3.0, -1.0)],
        "preference": [pair(-1.0, -3.0), pair(-3.0, -2.0)],
        "base": [pair(-4.0, -4.0), pair(-1.0, -3.0)],
    }
    for name, rows in files.items():
        write_jsonl(tmp_path / f"{name}.jsonl", rows)
    pref = Preference(method="dpo", loss="sigmoid", beta=1.0)
    block = scores(pref, "sft", {n: str(tmp_path / f"{n}.jsonl") for n in files})
    sft, tuned, base = (block["models"][n] for n in ("sft", "preference", "base"))
    # against itself its accuracy and margin would be 0 by construction: no measurement, no value
    assert (sft["preference_accuracy"], sft["reward_margin"]) == (None, None)
    # what needs no reference stays: sft prefers the chosen answer of the first pair only
    assert (sft["likelihood_accuracy"], sft["likelihood_margin"]) == (0.5, pytest.approx(-0.75))
    # the others against sft: rewards (1, -0.5) and (0, -1); base (-2, -1.5) and (2, -2)
    assert (tuned["preference_accuracy"], tuned["reward_margin"]) == (1.0, pytest.approx(1.25))
    assert (base["preference_accuracy"], base["reward_margin"]) == (0.5, pytest.approx(1.75))


def test_pairs_become_one_row_per_answer_in_evaluates_form():
    kind, rows = answer_rows(
        [{"messages": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "y"},
          "rejected": {"from": "gpt", "value": "n"}, "system": "s"}]
    )  # fmt: skip
    assert kind == "dpo"
    assert rows == [
        {
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "y"}],
            "system": "s",
        },
        {
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "n"}],
            "system": "s",
        },
    ]
