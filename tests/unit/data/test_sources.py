"""Reading every container and row format, and every validation rule naming row, field and reason."""

import json
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict
from llmft.core.text import clean_text, normalise
from llmft.data import sources as ds
from llmft.data.sources import FileError, RowError, iter_raw, validate

from tests.reliability import reliability

ALPACA = [
    {"instruction": "Name a fruit.", "input": "", "output": "apple"},
    {"instruction": "Add.", "input": "2 3", "output": "5", "system": "Be brief."},
    {"instruction": "Go on.", "output": "c", "history": [["a", "b"]]},
]
SHAREGPT = [
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    {
        "conversations": [
            {"from": "system", "value": "Be kind."},
            {"from": "human", "value": "q1"},
            {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "q2"},
            {"from": "gpt", "value": "a2"},
        ]
    },
    {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}], "system": "S"},
]
SHAREGPT_CANONICAL = [
    {"instruction": "hi", "input": "", "output": "hello"},
    {"instruction": "q2", "input": "", "output": "a2", "system": "Be kind.", "history": [["q1", "a1"]]},
    {"instruction": "u", "input": "", "output": "v", "system": "S"},
]


def canonical(path, fmt, **kw):
    return [validate(str(path), n, raw, fmt) for n, raw in iter_raw(path, **kw)]


def write(tmp_path, name, rows):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif name.endswith(".json"):
        path.write_text(json.dumps(rows, indent=1))
    elif name.endswith(".parquet"):  # one schema for all rows: absent keys are nulls, as in real files
        keys = sorted({k for r in rows for k in r})
        pq.write_table(
            pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), path, row_group_size=2
        )
    return path


@pytest.mark.parametrize("name", ["rows.json", "rows.jsonl", "rows.parquet"])
def test_alpaca_and_sharegpt_files_read_to_the_same_canonical_rows(tmp_path, name):
    got = canonical(write(tmp_path, "a" + name, ALPACA), "alpaca")
    assert got[0] == ALPACA[0]
    assert got[1]["system"] == "Be brief." and got[2]["history"] == [["a", "b"]]
    assert got[2]["input"] == ""  # a missing (or null, in Parquet) input is an empty input
    if not name.endswith(".parquet"):  # Parquet needs one schema: conversations vs messages differ
        assert canonical(write(tmp_path, "s" + name, SHAREGPT), "sharegpt") == SHAREGPT_CANONICAL
    else:
        assert canonical(write(tmp_path, "s" + name, SHAREGPT[:2]), "sharegpt") == SHAREGPT_CANONICAL[:2]


def test_save_to_disk_folders_dataset_and_dataset_dict(tmp_path):
    Dataset.from_list(ALPACA[:1] * 3).save_to_disk(tmp_path / "plain")
    assert canonical(tmp_path / "plain", "alpaca") == [ALPACA[0]] * 3
    DatasetDict(
        {"train": Dataset.from_list(SHAREGPT[:1]), "test": Dataset.from_list(SHAREGPT[:1] * 2)}
    ).save_to_disk(tmp_path / "dict")
    assert canonical(tmp_path / "dict", "sharegpt", split="test") == SHAREGPT_CANONICAL[:1] * 2
    with pytest.raises(FileError, match="no split 'dev'"):
        list(iter_raw(tmp_path / "dict", split="dev"))


def test_json_that_is_not_an_array_is_read_as_json_lines(tmp_path):
    path = tmp_path / "lines.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in ALPACA))
    assert [r["output"] for r in canonical(path, "alpaca")] == ["apple", "5", "c"]


@pytest.mark.parametrize("block", [1, 2, 3, 7, 64])
def test_streamed_json_array_equals_json_load_at_any_block_edge(tmp_path, monkeypatch, block):
    monkeypatch.setattr(ds, "_BLOCK", block)
    rows = [{"a": 1, "b": "x y"}, 12345, -1.5e10, "text", [1, [2]], None, True, {"é": '\\"]'}]
    path = tmp_path / "rows.json"
    path.write_text(" [ " + " ,\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + " ]\n")
    assert [v for _, v in iter_raw(path)] == json.loads(path.read_text())
    assert [n for n, _ in iter_raw(path)] == list(range(1, len(rows) + 1))


def test_broken_json_array_stops_with_the_row_number(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"instruction": "a", "output": "b"}, {oops}]')
    with pytest.raises(FileError, match="row 2: not valid JSON"):
        list(iter_raw(path))
    path.write_text('{"not": "closed"')  # not an array: read as JSON Lines, one bad row
    assert [(n, r.reason) for n, r in iter_raw(path)] == [(1, ds.BAD_JSON)]


def test_json_array_is_streamed_not_loaded_whole(tmp_path):
    path = tmp_path / "big.json"
    row = {"instruction": "word " * 40, "input": "", "output": "answer " * 60}
    with open(path, "w") as fh:
        fh.write("[" + ",\n".join(json.dumps(row) for _ in range(20000)) + "]")
    assert path.stat().st_size > 10_000_000
    tracemalloc.start()
    count = sum(1 for _ in iter_raw(path))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert count == 20000
    assert peak < 8_000_000  # a few 1 MiB blocks, not the 10+ MB file


def bad(fmt, raw):
    got = validate("f.jsonl", 7, raw, fmt)
    assert isinstance(got, RowError), got
    assert got.row == 7 and got.message().startswith("f.jsonl row 7: ")
    return got


@pytest.mark.parametrize(
    "raw,reason,field,needle",
    [
        ("just text", ds.NOT_AN_OBJECT, None, "expected an object, got str"),
        ({"instruction": "hi"}, ds.MISSING, "output", "field 'output' is missing"),
        ({"instruction": "hi", "output": None}, ds.MISSING, "output", "is missing"),
        ({"output": "x"}, ds.MISSING, "instruction", "field 'instruction' is missing"),
        ({"instruction": "hi", "output": "  \n "}, ds.EMPTY, "output", "field 'output' is empty"),
        ({"instruction": "hi", "output": 5}, ds.WRONG_TYPE, "output", "must be a string, got int"),
        ({"instruction": ["a"], "output": "x"}, ds.WRONG_TYPE, "instruction", "got list"),
        ({"instruction": "a", "input": 3, "output": "x"}, ds.WRONG_TYPE, "input", "got int"),
        ({"instruction": "a", "output": "x", "system": 1}, ds.WRONG_TYPE, "system", "got int"),
        ({"instruction": "a", "output": "x", "history": "no"}, ds.WRONG_TYPE, "history", "pairs"),
        ({"instruction": "a", "output": "x", "history": [["u"]]}, ds.WRONG_TYPE, "history", "pair"),
        ({"instruction": "a", "output": "x", "history": [["u", ""]]}, ds.EMPTY, "history[1][1]", "empty"),
        ({"instruction": "a", "output": "bad \udcff byte"}, ds.BAD_ENCODING, "output", "not valid UTF-8"),
        ({"instruction": "lone \ud800", "output": "x"}, ds.BAD_ENCODING, "instruction", "UTF-8"),
    ],
)
@reliability(
    fault=(
        "dataset rows with invalid UTF-8, NUL bytes, wrong types, missing fields, trailing garbage, bad roles"
    ),
    seen=(
        "every bad row named with its row number and field; `data.invalid_rows: drop` counts and "
        "lists them all"
    ),
    steps_lost="none",
    data_lost="none: nothing is written until the whole file is read",
)
def test_alpaca_rules(raw, reason, field, needle):
    err = bad("alpaca", raw)
    assert (err.reason, err.field) == (reason, field)
    assert needle in err.message()


def conv(*turns, key="conversations"):
    if key == "conversations":
        return {key: [{"from": r, "value": v} for r, v in turns]}
    return {key: [{"role": r, "content": v} for r, v in turns]}


@pytest.mark.parametrize(
    "raw,reason,field,needle",
    [
        ({"id": 1}, ds.MISSING, "conversations", "is missing"),
        ({"conversations": "hi"}, ds.WRONG_TYPE, "conversations", "must be a list"),
        ({"conversations": []}, ds.EMPTY, "conversations", "is empty"),
        ({"conversations": ["hi"]}, ds.WRONG_TYPE, "conversations[1]", "must be an object"),
        ({"conversations": [{"value": "hi"}]}, ds.MISSING, "conversations[1].from", "is missing"),
        (conv(("human", "q"), ("bot", "a")), ds.UNKNOWN_ROLE, "conversations[2].from", "unknown role 'bot'"),
        (
            conv(("human", "q"), ("function_call", "{}")),
            ds.BAD_FUNCTION_CALL,
            "conversations[2].value",
            "call",
        ),
        (
            conv(("user", "q"), ("tool", "x"), key="messages"),
            ds.UNKNOWN_ROLE,
            "messages[2].role",
            "function_call",
        ),
        (conv(("gpt", "a"), ("human", "q")), ds.ROLE_ORDER, "conversations[1]", "expected a user turn"),
        (conv(("human", "q"), ("human", "q2")), ds.ROLE_ORDER, "conversations[2]", "expected a assistant"),
        (
            conv(("human", "q"), ("gpt", "a"), ("human", "q2")),
            ds.ROLE_ORDER,
            "conversations",
            "ends with a user",
        ),
        (
            conv(("human", "q"), ("system", "s"), ("gpt", "a")),
            ds.ROLE_ORDER,
            "conversations[2]",
            "only come first",
        ),
        (conv(("system", "s")), ds.EMPTY, "conversations", "no user/assistant turns"),
        (conv(("human", ""), ("gpt", "a")), ds.EMPTY, "conversations[1].value", "is empty"),
        (conv(("human", "q"), ("gpt", 3)), ds.WRONG_TYPE, "conversations[2].value", "got int"),
        (
            conv(("user", "q"), ("assistant", "\udcff"), key="messages"),
            ds.BAD_ENCODING,
            "messages[2].content",
            "UTF-8",
        ),
        (conv(("user", "q"), ("model", "a"), key="messages"), ds.UNKNOWN_ROLE, "messages[2].role", "'model'"),
        ("text", ds.NOT_AN_OBJECT, None, "expected an object"),
    ],
)
def test_sharegpt_rules(raw, reason, field, needle):
    err = bad("sharegpt", raw)
    assert (err.reason, err.field) == (reason, field)
    assert needle in err.message()


def test_bad_bytes_and_bad_json_lines_are_rows_not_the_end(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(
        b'{"instruction": "a", "output": "\xff\xfe"}\n{not json}\n\n{"instruction": "b", "output": "ok"}\n'
    )
    got = canonical(path, "alpaca")
    assert [(g.row, g.reason, g.field) for g in got[:2]] == [
        (1, ds.BAD_ENCODING, "output"),
        (2, ds.BAD_JSON, None),
    ]
    assert got[2] == {"instruction": "b", "input": "", "output": "ok"}  # row 4: the blank line is skipped


def test_json_array_with_bad_bytes_names_the_row_and_goes_on(tmp_path):
    path = tmp_path / "rows.json"
    path.write_bytes(b'[{"instruction": "a", "output": "x\xc3"}, {"instruction": "b", "output": "y"}]')
    got = canonical(path, "alpaca")
    assert got[0].reason == ds.BAD_ENCODING and got[0].row == 1
    assert got[1]["output"] == "y"


def test_clean_text_keeps_indentation_normalise_does_not():
    code = "def f():\r\n    return  1\n"
    assert clean_text(code) == "def f():\n    return  1"
    assert normalise(code) == "def f():\nreturn 1"
    assert clean_text("e\u0301") == "\u00e9"  # NFC
