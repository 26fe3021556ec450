"""data.clean_text: cleaned texts (the default) or the texts exactly as LLaMA-Factory reads the raw
file, in which case the prepared tokens are LLaMA-Factory's own on that file."""

import json
import unicodedata

import pytest
from datasets import load_from_disk
from llmft.core import sources as ds
from llmft.core.assets import build_tokenizer
from llmft.core.config import validate as validate_config
from llmft.data.prepare import content_key, prepare

from tests.conftest import REPO
from tests.lfref import llamafactory_preprocess

NFD = unicodedata.normalize("NFD", "Café naïve, 한국어, déjà vu")
ROWS = [
    {"instruction": NFD, "input": "", "output": "Un café, s'il vous plaît."},
    {"instruction": "Two lines\r\nwith CRLF", "input": "and\ra lone CR", "output": "ok\r\ndone"},
    {"instruction": "  leading spaces", "input": "", "output": "  indented answer"},
    {"instruction": "trailing space ", "input": " ", "output": "answer \n"},
    {"instruction": "系统 prompt", "input": "", "output": "好的", "system": "  Be brief.  "},
    {"instruction": "q2", "input": "", "output": " a2", "history": [[" q1\r\n", "a1 "]]},
] + [{"instruction": f"plain question {i}", "input": "", "output": f"plain answer {i}"} for i in range(40)]


def test_raw_mode_keeps_texts_as_they_are_and_still_refuses_empty_fields():
    raw = {"instruction": "  x\r\n", "input": " ", "output": NFD}
    assert ds.validate("f", 1, raw, "alpaca", clean=False) == {
        "instruction": "  x\r\n",
        "input": " ",
        "output": NFD,
    }
    assert ds.validate("f", 1, raw, "alpaca") == {
        "instruction": "x",
        "input": "",
        "output": unicodedata.normalize("NFC", NFD),
    }
    err = ds.validate("f", 3, {"instruction": "q", "output": " \n "}, "alpaca", clean=False)
    assert isinstance(err, ds.RowError) and err.reason == ds.EMPTY and err.field == "output"
    assert "holds only whitespace" in err.message()
    conv = {"conversations": [{"from": "human", "value": " q "}, {"from": "gpt", "value": "\t"}]}
    err = ds.validate("f", 4, conv, "sharegpt", clean=False)
    assert isinstance(err, ds.RowError) and err.reason == ds.EMPTY and err.field == "conversations[2].value"
    conv["conversations"][1]["value"] = " a\r\n"
    row = ds.validate("f", 4, conv, "sharegpt", clean=False)
    assert row["instruction"] == " q " and row["output"] == " a\r\n"
    # identity (dedup, split) is the normalised text either way: switching moves no row
    assert content_key(ds.validate("f", 1, raw, "alpaca", clean=False)) == content_key(
        ds.validate("f", 1, raw, "alpaca")
    )


def test_config_key_defaults_to_cleaning():
    import yaml

    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert validate_config(cfg, base_dir=REPO)["data"]["clean_text"] is True
    cfg["data"]["clean_text"] = False
    assert validate_config(cfg, base_dir=REPO)["data"]["clean_text"] is False
    cfg["data"]["clean_text"] = "no"
    with pytest.raises(ValueError, match="config key data.clean_text"):
        validate_config(cfg, base_dir=REPO)


@pytest.fixture(scope="module")
def raw_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("raw")
    build_tokenizer(tmp / "tok", 512)
    (tmp / "raw.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS))
    # LLaMA-Factory reading the raw file itself, every row as train (and as held-out)
    entry = {
        "file_name": str(tmp / "raw.jsonl"),
        "columns": {"prompt": "instruction", "query": "input", "response": "output"}
        | {"system": "system", "history": "history"},
    }
    (tmp / "lf").mkdir()
    (tmp / "lf" / "dataset_info.json").write_text(json.dumps({"llmft_train": entry, "llmft_heldout": entry}))
    return tmp


def lf_rows(tmp_path, raw_file) -> set:
    theirs = llamafactory_preprocess(tmp_path, raw_file / "lf", raw_file / "tok", 4096)["train_dataset"]
    assert len(theirs) == len(ROWS)
    return {(tuple(r["input_ids"]), tuple(r["labels"])) for r in theirs}


def ours(out) -> list:
    tok = load_from_disk(str(out / "tokenized"))
    return [
        (tuple(r["input_ids"]), tuple(r["labels"])) for split in ("train", "validation") for r in tok[split]
    ]


@pytest.mark.parametrize("clean", [False, True])
def test_prepared_tokens_against_llamafactory_on_the_raw_file(tmp_path, raw_file, clean):
    out = tmp_path / "out"
    stats = prepare(
        [{"path": str(raw_file / "raw.jsonl")}],
        out,
        raw_file / "tok",
        "default",
        4096,
        0.3,
        "s",
        "fail",
        clean_text=clean,
    )
    assert stats["clean_text"] is clean
    assert json.loads((out / "stats.json").read_text())["clean_text"] is clean
    assert stats["train_rows"] + stats["heldout_rows"] == len(ROWS)  # nothing deduped or dropped
    theirs = lf_rows(tmp_path, raw_file)
    mine = ours(out)
    differ = [r for r in mine if r not in theirs]
    written = [json.loads(line) for name in ("train.jsonl", "heldout.jsonl") for line in open(out / name)]
    if not clean:
        assert differ == []  # every row, NFD, CRLF and spaces included, is LLaMA-Factory's
        assert {r["instruction"] for r in written} >= {NFD, "Two lines\r\nwith CRLF", "  leading spaces"}
    else:
        assert len(differ) == 6  # exactly the six rows with text that cleaning changes
        texts = [t for r in written for t in (r["instruction"], r["input"], r["output"])]
        assert all(t == ds.clean_text(t) for t in texts)
        assert unicodedata.normalize("NFC", NFD) in texts
