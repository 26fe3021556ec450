"""Dataset preparation: validation names row and field, dedup, length filter, stable split."""

import json

import pytest
from llmft.assets import build_tokenizer, synthetic_rows
from llmft.data import DataError, content_key, is_heldout, prepare
from llmft.io import read_jsonl


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d, 512)
    return d


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(tmp_path, tokenizer_dir, rows, **kw):
    src = write_rows(tmp_path / "in.jsonl", rows)
    args = dict(cutoff_len=64, heldout_fraction=0.2, split_salt="s", invalid_rows="fail")
    args.update(kw)
    return prepare([{"path": str(src), "weight": 1.0}], tmp_path / "out", tokenizer_dir, "default", **args)


@pytest.mark.parametrize(
    "row,needle",
    [
        ({"instruction": "hi"}, "row 3: field 'output' is missing"),
        ({"instruction": "hi", "output": ""}, "row 3: field 'output' is empty"),
        ({"instruction": "hi", "output": 5}, "row 3: field 'output' must be a string, got int"),
        ({"instruction": ["a"], "output": "x"}, "row 3: field 'instruction' must be a string"),
        ("just text", "row 3: expected an object, got str"),
    ],
)
def test_bad_row_is_named(tmp_path, tokenizer_dir, row, needle):
    good = synthetic_rows(2)
    with pytest.raises(DataError) as err:
        run(tmp_path, tokenizer_dir, good + [row] + synthetic_rows(40, seed=3))
    assert needle in str(err.value)


def test_bad_json_line_and_encoding_are_named(tmp_path, tokenizer_dir):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"instruction": "a", "output": "b"}\n{not json}\n')
    with pytest.raises(DataError, match="row 2: not valid JSON"):
        prepare([{"path": str(src)}], tmp_path / "o", tokenizer_dir, "default", 64, 0.5, "s")
    src.write_bytes(b'{"instruction": "a", "output": "\xff"}\n')
    with pytest.raises(DataError, match="row 1: not valid UTF-8"):
        prepare([{"path": str(src)}], tmp_path / "o", tokenizer_dir, "default", 64, 0.5, "s")


def test_drop_policy_counts_bad_rows(tmp_path, tokenizer_dir):
    rows = synthetic_rows(200) + [{"instruction": "x"}, {"output": "y"}]
    stats = run(tmp_path, tokenizer_dir, rows, invalid_rows="drop")
    assert stats["invalid"] == 2
    assert "field 'output' is missing" in stats["invalid_examples"][0]


def test_dedup_after_normalisation_and_length_filter(tmp_path, tokenizer_dir):
    a = {"instruction": "Repeat the words.", "input": "cat dog", "output": "cat dog"}
    a_spaced = {"instruction": "  Repeat   the words. ", "input": "cat  dog", "output": "cat dog "}
    long = {"instruction": "Repeat the words.", "input": "cat " * 80, "output": "cat " * 80}
    stats = run(tmp_path, tokenizer_dir, [a, a_spaced, long] + synthetic_rows(300, seed=5))
    assert stats["duplicates"] >= 1
    assert stats["too_long"] == 1
    kept = read_jsonl(tmp_path / "out/train.jsonl") + read_jsonl(tmp_path / "out/heldout.jsonl")
    assert all(len(r["input"].split()) < 80 for r in kept)
    assert sum(stats["length_histogram"]["counts"]) == stats["rows_read"] - stats["duplicates"]


def test_split_is_stable_when_rows_are_appended(tmp_path, tokenizer_dir):
    first = synthetic_rows(400, seed=1)
    run(tmp_path, tokenizer_dir, first)
    held_before = {content_key(r) for r in read_jsonl(tmp_path / "out/heldout.jsonl")}
    train_before = {content_key(r) for r in read_jsonl(tmp_path / "out/train.jsonl")}
    run(tmp_path, tokenizer_dir, first + synthetic_rows(400, seed=2))
    held_after = {content_key(r) for r in read_jsonl(tmp_path / "out/heldout.jsonl")}
    train_after = {content_key(r) for r in read_jsonl(tmp_path / "out/train.jsonl")}
    assert held_before <= held_after and train_before <= train_after
    assert not held_after & train_after
    assert len(held_after) > len(held_before)


def test_split_fraction_is_close_to_asked():
    keys = [content_key({"instruction": str(i), "output": "x"}) for i in range(5000)]
    share = sum(is_heldout(k, 0.1, "salt") for k in keys) / len(keys)
    assert 0.08 < share < 0.12


def test_outputs_are_written_for_llamafactory(tmp_path, tokenizer_dir):
    stats = run(tmp_path, tokenizer_dir, synthetic_rows(300))
    info = json.loads((tmp_path / "out/dataset_info.json").read_text())
    assert info["llmft_train"]["file_name"] == "train.jsonl"
    assert stats["train_rows"] == len(read_jsonl(tmp_path / "out/train.jsonl"))
    assert not list((tmp_path / "out").glob(".*"))  # no temporary files left behind
