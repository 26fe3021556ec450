"""The ASCII shortcut gives exactly the Rust tokenizer's ids, for each supported tokenizer shape,
and declines texts and tokenizers it cannot reproduce."""

import json
import random

import pytest
from llmft.core.lf.fasttok import PROBES, FastPath, SpanTable, _spec, ascii_pattern, gather
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ALPHABET = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    + "     \t\n\r'.,;:!?-_()[]{}<>\"/\\@#$%^&*+=~`|"
)


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "cat", "it's", "we'll", "DON'T", "12345", "3.14", "x", "  ", "\n\n", "\t", "'s", "'S"]
    out = []
    for _ in range(n):
        parts = [
            rng.choice(words) if rng.random() < 0.5 else "".join(rng.choices(ALPHABET, k=rng.randint(1, 8)))
            for _ in range(rng.randint(1, 30))
        ]
        out.append("".join(p + rng.choice(["", " ", "  ", "\n", " \n "]) for p in parts))
    return out


def train(
    pre, normalizer=None, ignore_merges=False, special=("<s>", "</s>", "<|im_start|>", "<|im_end|>")
) -> Tokenizer:
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(random_texts(3000, seed=1) + PROBES * 20, trainer=trainer)
    return tok


def split_then_bytes(pattern: str):
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


SHAPES = {
    "gpt2": lambda: train(pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "llama3": lambda: train(split_then_bytes(LLAMA3), ignore_merges=True),
    "qwen2": lambda: train(split_then_bytes(QWEN2), normalizers.NFC()),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shortcut_equals_the_tokenizer(shape):
    tok = SHAPES[shape]()
    fast, why = FastPath.for_tokenizer(tok)
    assert fast is not None, why
    texts = PROBES + random_texts(2000, seed=2)
    assert all(fast.takes(t) for t in texts)
    reference = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    assert [fast.encode(t) for t in texts] == reference
    assert [fast.encode(t) for t in texts] == reference  # again, now from the piece cache
    assert fast.check(tok, texts[:100]) == []


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_added_tokens_inside_texts(shape):
    tok = SHAPES[shape]()
    fast, _ = FastPath.for_tokenizer(tok)
    rng = random.Random(3)
    texts = ["<|im_start|>user\nhi<|im_end|>", "</s>", "a</s></s>b", " <s> x", "<s<s>>", "x<|im_start|>"]
    for text in random_texts(500, seed=4):
        cut = rng.randrange(len(text) + 1)
        texts.append(text[:cut] + rng.choice(["<s>", "</s>", "<|im_start|>", "<|im_end|>"]) + text[cut:])
    assert all(fast.takes(t) for t in texts)
    reference = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    assert [fast.encode(t) for t in texts] == reference


def test_added_tokens_that_strip_spaces_are_left_to_the_tokenizer():
    from tokenizers import AddedToken

    tok = SHAPES["gpt2"]()
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    fast, _ = FastPath.for_tokenizer(tok)
    assert not fast.takes("a <mask> b") and fast.takes("a b")


@pytest.mark.parametrize("text", ["café", "tab\x0bvertical", "bell\x07", "nul\x00", "emoji 🙂"])
def test_texts_it_cannot_reproduce_go_to_the_tokenizer(text):
    fast, _ = FastPath.for_tokenizer(SHAPES["gpt2"]())
    assert not fast.takes(text)


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace()), "not byte-level"),
        (
            lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=True)),
            "not byte-level",
        ),
        (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Whitespace()), "not byte-level"),
        (lambda t: setattr(t, "normalizer", normalizers.Lowercase()), "normalizer"),
        (lambda t: setattr(t, "encode_special_tokens", True), "split_special_tokens"),
        (lambda t: setattr(t, "pre_tokenizer", split_then_bytes(r"\p{Lu}+|\s+")), "other than L and N"),
    ],
)
def test_shapes_it_cannot_reproduce_are_declined(change, needle):
    tok = SHAPES["gpt2"]()
    change(tok)
    fast, why = FastPath.for_tokenizer(tok)
    assert fast is None and needle in why


def test_ascii_pattern():
    assert ascii_pattern(r" ?\p{L}+| ?[^\s\p{L}\p{N}]+") == r" ?[A-Za-z]+| ?[^\sA-Za-z0-9]+"
    assert ascii_pattern(r"\p{N}{1,3}|[\p{L}]") == r"[0-9]{1,3}|[A-Za-z]"
    assert ascii_pattern(r"\P{L}") is None and ascii_pattern(r"\p{Lu}") is None


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_spec_without_the_vocabulary_is_the_tokenizers_own(shape):
    tok = SHAPES[shape]()
    tok.add_special_tokens(["<|im_start|>", "</s>"])
    full = json.loads(tok.to_str())
    spec = _spec(tok)
    assert spec["model"] == {"type": full["model"]["type"], "dropout": full["model"].get("dropout")}
    assert spec["normalizer"] == full.get("normalizer")
    assert spec["pre_tokenizer"] == full.get("pre_tokenizer")
    keys = ("id", "content", "lstrip", "rstrip", "single_word")
    assert spec["added_tokens"] == [{k: t[k] for k in keys} for t in full["added_tokens"]]


@pytest.mark.parametrize("cap", [0, 50, 10**6])
def test_span_table_gathers_what_encode_makes(cap):
    """Chunk-at-once encoding: keys of many texts, one lookup, one gather; also past the key cap."""
    tok = SHAPES["llama3"]()
    fast, _ = FastPath.for_tokenizer(tok)
    texts = ["<|im_start|>user\nhi<|im_end|>", "a</s></s>b"] + random_texts(300, seed=5)
    reference = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    table = SpanTable(fast.key_ids, cap)
    for _ in range(2):  # the second time from the table (where the cap let it keep them)
        keys = [k for text in texts for k in fast.keys(text)]
        idx = table.lookup(keys)
        ids = gather(table.tokens, table.start[idx], table.length[idx])
        assert ids.tolist() == [i for ref in reference for i in ref]
    assert len(table.index) <= cap
