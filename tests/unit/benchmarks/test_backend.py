"""llmft's lm-eval backend against lm-eval's own `hf` backend: same requests, same numbers (fp32, CPU,
the demo's tiny model) on the project tasks of each of lm-eval's request types: multiple choice
(log-likelihood), generation, and perplexity (rolling log-likelihood)."""

import pytest
from llmft.core.assets import build_tiny_model
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from tests.conftest import REPO

TASKS = ["llmft_category", "llmft_first_word", "llmft_words_ppl"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both backends on a random-init tiny model (its greedy words are arbitrary, but decided)."""
    import llmft.benchmarks.backend  # noqa: F401 - registers `llmft` with lm-eval

    model = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny_model(model, seed=5)
    _stop_early(model)
    tm = TaskManager(include_path=str(REPO / "tests" / "bench_tasks"), include_defaults=False)
    out = {}
    for backend in ("hf", "llmft"):
        out[backend] = simple_evaluate(
            model=backend,
            model_args={"pretrained": str(model), "dtype": "float32", "device": "cpu"},
            tasks=TASKS,
            batch_size=8,
            task_manager=tm,
            log_samples=True,
        )
    return out


def _stop_early(model_dir):
    """A random-init tiny model repeats one token; with its weights scaled up it says varied things.
    The token it says most becomes an end-of-sequence id too, so rows end at different steps and
    what follows a row's end is exercised (such a model never says `</s>`)."""
    import collections
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(8.0)
    said = collections.Counter()
    for line in (REPO / "tests/bench_tasks/first_word.jsonl").read_text().splitlines()[:10]:
        prompt = f"Human: What is the first word?\n{json.loads(line)['words']}</s>\nAssistant:"
        ids = tok(prompt, return_tensors="pt").input_ids
        said.update(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist())
    model.generation_config.eos_token_id = [tok.eos_token_id, said.most_common(1)[0][0]]
    model.save_pretrained(model_dir)


def test_the_same_loglikelihoods_as_lm_evals_hf_backend(runs):
    hf, ours = runs["hf"]["samples"]["llmft_category"], runs["llmft"]["samples"]["llmft_category"]
    assert len(hf) == len(ours) == 40
    for a, b in zip(hf, ours, strict=True):
        assert a["arguments"] == b["arguments"]
        # one response per choice: [(sum of log-probabilities, greedy)]
        for [(lp_a, greedy_a)], [(lp_b, greedy_b)] in zip(a["resps"], b["resps"], strict=True):
            assert abs(lp_a - lp_b) < 1e-4 * max(1.0, abs(lp_a)) and greedy_a == greedy_b
    assert runs["hf"]["results"]["llmft_category"] == runs["llmft"]["results"]["llmft_category"]


def test_the_same_greedy_generations_as_lm_evals_hf_backend(runs):
    hf, ours = runs["hf"]["samples"]["llmft_first_word"], runs["llmft"]["samples"]["llmft_first_word"]
    assert [s["resps"] for s in hf] == [s["resps"] for s in ours]
    texts = [s["resps"][0][0] for s in hf]
    assert any(t.strip() for t in texts)  # it generated words, not only end-of-sequence
    assert len({len(t) for t in texts}) > 1  # rows ended at different steps
    assert runs["hf"]["results"]["llmft_first_word"] == runs["llmft"]["results"]["llmft_first_word"]


def test_the_same_rolling_loglikelihoods_as_lm_evals_hf_backend(runs):
    """A perplexity task: lm-eval cuts each document into windows and calls the backend's batched
    loss pass with its own batch size (override_bs)."""
    hf, ours = runs["hf"]["samples"]["llmft_words_ppl"], runs["llmft"]["samples"]["llmft_words_ppl"]
    assert len(hf) == len(ours) == 40
    for a, b in zip(hf, ours, strict=True):
        [[lp_a]], [[lp_b]] = a["resps"], b["resps"]
        assert lp_a < 0 and abs(lp_a - lp_b) < 1e-4 * abs(lp_a), (a["doc"], lp_a, lp_b)
    got, want = (
        {k: v for k, v in r["results"]["llmft_words_ppl"].items() if k.endswith("perplexity,none")}
        for r in (runs["llmft"], runs["hf"])
    )
    assert len(want) == 2 and got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) <= 1e-4 * abs(want[k]) for k in want), (got, want)
