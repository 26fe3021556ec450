"""Evaluation's prompt encoding without LLaMA-Factory (llmft/prompts.py) equals LLaMA-Factory's
template: the table is what the installed LLaMA-Factory produces, and for every template in it the
prompt and answer ids, EOS, pad and stop ids equal `get_template_and_fix_tokenizer` +
`encode_oneturn`. Where it cannot be exact it declines, and evaluation uses LLaMA-Factory itself."""

import json

import pytest
from llmft.core.assets import build_tokenizer, synthetic_rows
from llmft.core.lf import prompts
from llmft.evaluate import run as ev

from tests import published_formats as published
from tests.lfref import aligned_from_canonical, lf_sft

TABLE = json.loads(prompts.TABLE.read_text(encoding="utf-8"))
NAMES = sorted(TABLE["templates"])

ROWS = [
    *synthetic_rows(6, seed=11),
    {"instruction": "Say hi", "input": "", "output": "hi"},
    {"instruction": "Übersetze: Straße", "input": "naïve café — ok", "output": "street 🚗"},
    {"instruction": "two\nlines", "input": "  spaced  ", "output": " lead", "system": "Be brief."},
    {"instruction": "again", "input": "x", "output": "y", "history": [["first q", "first a"]]},
    {"instruction": "q", "output": "a", "history": [["h1", "a1"]], "system": "sys"},
]


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path, vocab_size=600)
    return path


def tokenizer_for(path, name: str):
    """A tokenizer that has what the template names (its special tokens and stop words, EOS already
    replaced where the template replaces it), as a model made for that template has."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    spec = TABLE["templates"][name]
    parts = [e for plan in spec["plans"].values() for part in plan for e in part]
    named = sorted({e[1] for e in parts if isinstance(e, list) and e[0] == "token"})
    stops = spec["stop_words"][1:] if spec["replace_eos"] else spec["stop_words"]
    # Tokens the template names exist (as added tokens); stop words LLaMA-Factory would set as the
    # extra special tokens already are exactly those.
    tok.add_tokens([n for n in named if n not in stops], special_tokens=True)
    if stops:
        tok.add_special_tokens({"additional_special_tokens": stops})
    if spec["replace_eos"]:
        tok.add_special_tokens({"eos_token": spec["stop_words"][0]})
    return tok


def test_table_is_what_the_installed_llamafactory_produces():
    assert prompts.build_table() == TABLE


@pytest.mark.parametrize("name", NAMES)
def test_prompt_ids_equal_llamafactory_template(base_tokenizer, name):
    tok = tokenizer_for(base_tokenizer, name)
    enc, why = prompts.PromptEncoder.load(tok, name)
    assert enc is not None, why
    ours = enc.encode(ROWS)
    assert ours is not None
    theirs_tok, theirs = ev.encode_with_llamafactory(ROWS, tokenizer_for(base_tokenizer, name), name)
    assert ours == theirs
    # LLaMA-Factory's fix left nothing different: same EOS, pad and stop ids.
    assert ev.eos_ids(tok) == ev.eos_ids(theirs_tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id  # as evaluate()
    assert pad == theirs_tok.pad_token_id


def test_declines_where_it_could_differ(base_tokenizer, monkeypatch):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(base_tokenizer))
    assert prompts.PromptEncoder.load(plain, "llama2")[0] is None  # not a plain template
    # llama3 replaces EOS with <|eot_id|> and adds <|eom_id|>: this tokenizer would change.
    assert "replace EOS" in prompts.PromptEncoder.load(plain, "llama3")[1]
    # glm4's stop words would replace this tokenizer's extra special tokens (and its stop ids).
    plain.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|observation|>", "<|system|>"]})
    assert "stop words" in prompts.PromptEncoder.load(plain, "glm4")[1]
    enc, _ = prompts.PromptEncoder.load(plain, "default")
    assert enc.encode(ROWS[:3]) is not None
    # Two earlier turns: a shape the table does not hold; a text with a placeholder.
    deep = {"instruction": "q", "output": "a", "history": [["a", "b"], ["c", "d"]]}
    assert enc.encode(ROWS[:3] + [deep]) is None
    assert enc.encode([{"instruction": "{{content}}", "output": "a"}]) is None
    monkeypatch.setattr(prompts.metadata, "version", lambda _: "0.0.1")
    assert "0.0.1 is installed" in prompts.PromptEncoder.load(plain, "default")[1]


def test_evaluate_encode_falls_back_to_llamafactory(tmp_path, base_tokenizer):
    """A row the table cannot encode (two earlier turns) sends the whole set through LLaMA-Factory's
    template; checked against LLaMA-Factory's SFT processor, not against that same fallback: the
    prompt and answer together are its row, and the answer is what its labels train on last."""
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments

    rows = ROWS + [{"instruction": "q", "output": "a", "history": [["a", "b"], ["c", "d"]]}]
    assert (
        prompts.PromptEncoder.load(tokenizer_for(base_tokenizer, "default"), "default")[0].encode(rows)
        is None
    )
    tok, encoded = ev.encode(rows, str(base_tokenizer), "default")
    lf_tok = tokenizer_for(base_tokenizer, "default")
    template = get_template_and_fix_tokenizer(lf_tok, DataArguments(template="default"))
    theirs = lf_sft(template, lf_tok, aligned_from_canonical(rows), "default")
    for i, (prompt, answer) in enumerate(encoded):
        ids, labels = theirs["input_ids"][i], theirs["labels"][i]
        assert prompt + answer == ids and labels[len(prompt) :] == answer, rows[i]


@pytest.mark.parametrize("name,reference", [("qwen", published.chatml), ("llama3", published.llama3)])
@pytest.mark.parametrize("shape", ["2", "2s", "4", "4s"])
def test_table_plans_render_the_format_the_model_authors_publish(name, reference, shape):
    """The table against formats written out by hand (tests/published_formats.py), not against a
    fresh build of itself: prompt + answer of each shape, as the model's authors document it."""
    spec = TABLE["templates"][name]
    n, has_system = int(shape[0]), shape.endswith("s")
    texts = [f"text {i}" for i in range(n + 1)]  # turn i, then the system message

    def fill(elements):
        text = published.flatten(elements, bos="<|begin_of_text|>", eos=spec["stop_words"][0])
        for i, t in enumerate(texts):
            text = text.replace(f"\x00{i}\x00", t)  # the table's placeholder for text i
        return text

    prompt, answer = spec["plans"][shape]
    turns = [("user" if i % 2 == 0 else "assistant", texts[i]) for i in range(n)]
    assert fill(prompt) + fill(answer) == reference(turns, texts[n] if has_system else None)


def test_alpaca_plan_is_stanford_alpacas_prompt():
    prompt, _ = TABLE["templates"]["alpaca"]["plans"]["2"]
    assert published.flatten(prompt).replace("\x000\x00", "Name a bird.") == published.alpaca(
        "Name a bird.", ""
    )
