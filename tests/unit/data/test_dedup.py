"""Exact-key set, MinHash estimates, LSH banding, near-dedup and decontamination end to end."""

import random
import re

import numpy as np
import pytest
from llmft.core.assets import WORDS
from llmft.core.dedup import MinHasher, SeenKeys, lsh_shape, payload
from llmft.core.io import read_jsonl
from llmft.data.prepare import content_key, is_heldout, prepare


def jaccard(a: set, b: set) -> float:
    """The exact Jaccard similarity MinHash estimates."""
    return len(a & b) / len(a | b) if a or b else 1.0


def shingles(row: dict) -> set:
    """Word 3-grams of a row, computed the plain way (the definition the numpy code implements)."""
    words = re.findall(r"[0-9a-z]+", payload(row))
    return {tuple(words[i : i + 3]) for i in range(len(words) - 2)} if len(words) > 2 else {tuple(words)}


def test_seen_keys_matches_a_python_set():
    rng = np.random.default_rng(0)
    seen, reference = SeenKeys(), set()
    for _ in range(60):
        batch = rng.integers(0, 5000, rng.integers(1, 300)).astype(np.uint64)
        new = seen.add(batch)
        expected = []
        for k in batch.tolist():
            expected.append(k not in reference)
            reference.add(k)
        assert new.tolist() == expected
    assert len(seen) == len(reference)


def test_minhash_estimates_jaccard():
    rng = random.Random(0)
    hasher = MinHasher(128)
    rows, pairs = [], []
    for _ in range(150):
        words = rng.choices(WORDS, k=rng.randint(20, 60))
        other = list(words)
        for _ in range(rng.randint(0, 15)):
            other[rng.randrange(len(other))] = rng.choice(WORDS)
        a = {"instruction": " ".join(words), "input": "", "output": "x"}
        b = {"instruction": " ".join(other), "input": "", "output": "x"}
        rows += [a, b]
        pairs.append(jaccard(shingles(a), shingles(b)))
    sig = hasher.signatures([payload(r) for r in rows], np.arange(len(rows), dtype=np.uint64))
    est = [(sig[2 * i] == sig[2 * i + 1]).mean() for i in range(len(pairs))]
    errors = np.abs(np.array(est) - np.array(pairs))
    assert errors.mean() < 0.04 and errors.max() < 0.2
    assert min(pairs) < 0.5 < 0.9 < max(pairs)  # the sample spans the range that matters


def test_short_and_empty_rows_get_their_own_shingle():
    sig = MinHasher(32).signatures(["", "one", "one", "two words", "? !"], np.arange(5, dtype=np.uint64) + 7)
    assert (sig[1] == sig[2]).all()  # same single word
    assert not (sig[0] == sig[4]).any()  # no words: each its own fallback key, never similar


@pytest.mark.parametrize("threshold", [0.5, 0.7, 0.8, 0.9])
def test_lsh_bands_catch_pairs_at_the_threshold(threshold):
    bands, rows = lsh_shape(threshold, 64)
    assert bands * rows <= 64
    assert 1 - (1 - threshold**rows) ** bands >= 0.99
    # Unrelated rows (similarity 0.1) rarely become candidates to verify.
    assert 1 - (1 - 0.1**rows) ** bands < (0.03 if threshold >= 0.7 else 0.5)


def planted(n_base=160, n_variants=70, seed=0):
    """Long rows of known words, then near-duplicates of some (one word changed, Jaccard ~0.93)."""
    rng = random.Random(seed)
    base = []
    for i in range(n_base):
        words = rng.choices(WORDS, k=80)
        base.append({"instruction": f"Story number {i}.", "input": "", "output": " ".join(words)})
    variants = []
    for row in rng.sample(base, n_variants):
        words = row["output"].split()
        j = rng.randrange(len(words))
        words[j] = next(w for w in WORDS if w != words[j])
        variants.append({**row, "output": " ".join(words)})
    return base, variants


def run(tmp_path, tokenizer_dir, rows, **dedup):
    import json

    tmp_path.mkdir(parents=True, exist_ok=True)
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    stats = prepare([{"path": str(src)}], out, tokenizer_dir, "default", 1024, 0.3, "s", "fail", dedup=dedup)
    return stats, read_jsonl(out / "train.jsonl"), read_jsonl(out / "heldout.jsonl")


def cross_pairs(train, heldout, at_least):
    return [(t, h) for t in train for h in heldout if jaccard(shingles(t), shingles(h)) >= at_least]


def test_decontamination_leaves_no_heldout_row_near_a_train_row(tmp_path, tokenizer_dir):
    base, variants = planted()
    rows = base + variants
    sides = [is_heldout(content_key(r), 0.3, "s") for r in rows]
    # Without it, planted pairs straddle the split: the test below is not vacuous.
    off, train_off, held_off = run(tmp_path / "off", tokenizer_dir, rows, decontaminate=False)
    straddling = cross_pairs(train_off, held_off, 0.9)
    assert len(straddling) >= 10 and off["decontaminated"] == 0
    stats, train, heldout = run(tmp_path / "on", tokenizer_dir, rows)
    assert cross_pairs(train, heldout, 0.9) == []
    # Only train rows leave, exactly the ones near a held-out row; held-out is untouched.
    assert stats["decontaminated"] == len({content_key(t) for t, _ in straddling})
    assert len(heldout) == sum(sides) == stats["heldout_rows"]
    assert len(train) + stats["decontaminated"] == len(rows) - sum(sides)
    rejected = read_jsonl(tmp_path / "on/out/rejected.jsonl")
    assert sum(r["reason"] == "contaminates_heldout" for r in rejected) == stats["decontaminated"]


def test_near_dedup_drops_the_later_copy_only(tmp_path, tokenizer_dir):
    base, variants = planted(seed=1)
    stats, train, heldout = run(tmp_path, tokenizer_dir, base + variants, near=True)
    kept = {content_key(r) for r in train + heldout}
    assert stats["near_duplicates"] == len(variants)
    assert kept == {content_key(r) for r in base}  # every original kept, every variant gone
    assert stats["decontaminated"] == 0  # nothing left to decontaminate
    assert cross_pairs(train, heldout, 0.9) == []


def test_unrelated_rows_are_never_flagged(tmp_path, tokenizer_dir):
    base, _ = planted(n_base=300, seed=2)
    stats, train, heldout = run(tmp_path, tokenizer_dir, base, near=True, threshold=0.5)
    assert stats["near_duplicates"] == stats["decontaminated"] == 0
    assert len(train) + len(heldout) == 300


def test_seen_keys_after_a_batch_of_only_known_keys():
    seen = SeenKeys()
    seen.add(np.array([1, 2], dtype=np.uint64))
    assert not seen.add(np.array([2, 1], dtype=np.uint64)).any()  # nothing new: no empty run kept
    assert seen.add(np.array([3, 1], dtype=np.uint64)).tolist() == [True, False]
