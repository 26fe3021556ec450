"""Reading every container and row format, and every validation rule naming row, field and reason."""

import json
import os
import re
import threading
import tracemalloc
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict
from llmft.core import sources as ds
from llmft.core.sources import FileError, RowError, iter_raw, validate
from llmft.core.text import clean_text, normalise

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
        (
            {"instruction": "a\x00b", "output": "x"},
            ds.NUL_CHARACTER,
            "instruction",
            "NUL character (at character 2)",
        ),
    ],
)
@pytest.mark.reliability(
    fault=("dataset rows with invalid UTF-8, NUL characters, wrong types, missing fields"),
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


@pytest.mark.reliability(
    fault="a JSON Lines row holding a raw NUL byte, or trailing garbage after a row (in .jsonl and .json)",
    seen=(
        'the row is named with where it breaks ("row 1: not valid JSON (a NUL byte at character 19 of '
        'the row"); in a .json array the file stops there'
    ),
    steps_lost="none",
    data_lost="none",
)
def test_nul_bytes_and_trailing_garbage_are_named(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"instruction": "a\x00", "output": "b"}\n{"instruction": "a", "output": "b"} xyz\n')
    got = canonical(path, "alpaca")
    assert [(g.row, g.reason) for g in got] == [(1, ds.BAD_JSON), (2, ds.BAD_JSON)]
    assert (
        got[0].message()
        == f"{path} row 1: not valid JSON (a NUL byte at character 19 of the row: binary or corrupt data)"
    )
    path.write_bytes(b'{"instruction": "a\tb", "output": "c"}\n')  # a raw tab: reason and place, whole
    got = canonical(path, "alpaca")[0].detail
    assert got == "not valid JSON (Invalid control character at character 19 of the row)"
    raw = {"instruction": "a", "output": "b", "tools": '[{"name": "f\x01"}]'}
    got = validate("f.jsonl", 1, raw, "alpaca").detail
    assert got == "is not valid JSON (Invalid control character at character 13)"
    array = tmp_path / "rows.json"
    array.write_bytes(b'[{"instruction": "a", "output": "b"} xyz]')
    with pytest.raises(FileError, match=r"row 1: expected ',' or '\]' after the row"):
        list(iter_raw(array))
    array.write_bytes(b'[{"instruction": "a", "output": "b\x00"}]')
    with pytest.raises(FileError, match=r"row 1: not valid JSON \(a NUL byte at character 34 of the row"):
        list(iter_raw(array))


@pytest.mark.parametrize(
    "raw,field,needle",
    [
        (  # LLaMA-Factory's kto_en_demo.json
            {
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "label": False,
            },
            "label",
            "KTO label (desirable or not), for LLaMA-Factory's kto stage",
        ),
        (  # mllm_demo.json
            {
                "messages": [{"role": "user", "content": "<image>q"}, {"role": "assistant", "content": "a"}],
                "images": ["mllm_demo_data/1.jpg"],
            },
            "images",
            "leaving any <image> placeholder as text",
        ),
        (
            {
                "conversations": [{"from": "human", "value": "<video>q"}, {"from": "gpt", "value": "a"}],
                "videos": ["v.mp4"],
            },
            "videos",
            "columns.videos",
        ),
        ({"instruction": "<audio>q", "output": "a", "audios": ["a.wav"]}, "audios", "columns.audios"),
        (  # dpo_en_demo.json (alpaca)
            {"instruction": "q", "chosen": "good", "rejected": "bad"},
            "chosen",
            "preference pair, for LLaMA-Factory's dpo/rm stage",
        ),
        ({"text": "Lorem ipsum"}, "text", "is pretraining text (LLaMA-Factory's pt stage"),  # c4_demo
    ],
)
@pytest.mark.reliability(
    fault=(
        "rows whose columns the SFT stage would drop: a KTO `label`, `images`/`videos`/`audios`, "
        "preference `chosen`/`rejected`; pretraining `text` rows"
    ),
    seen=(
        "each row refused naming the column and the LLaMA-Factory stage or column that uses it "
        "(kto, dpo/rm, pt, columns.images/videos/audios)"
    ),
    steps_lost="none",
    data_lost="none: nothing is trained with the column silently dropped",
)
def test_columns_of_other_stages_are_refused_by_name(raw, field, needle):
    for fmt in ("alpaca", "sharegpt"):
        err = bad(fmt, raw)
        assert (err.reason, err.field) == (ds.UNUSED_COLUMN, field)
        assert needle in err.message()


def test_empty_media_columns_and_a_text_label_are_kept():
    row = {"instruction": "q", "output": "a", "images": [], "label": "math", "text": "note"}
    assert validate("f.jsonl", 1, row, "alpaca") == {"instruction": "q", "input": "", "output": "a"}


@contextmanager
def deadline(seconds: int, fifo=None):
    """Fail a test that hangs. A FIFO opened for reading blocks in C code, which no signal ends,
    until a writer comes: after `seconds` a writer comes (and goes), and the test fails."""
    hung = []

    def release():
        hung.append(True)
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except (OSError, TypeError):
            pass  # no reader waiting, or no FIFO

    timer = threading.Timer(seconds, release)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
    assert not hung, f"still running after {seconds} s: it opened the FIFO"


def special_path(tmp_path, kind):
    path = tmp_path / f"{kind}.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        os.symlink(path.name, path)
    else:  # /dev/null, not /dev/zero: a regression here must not read an endless line into memory
        path.symlink_to("/dev/null")
    return path


@pytest.mark.parametrize(
    "kind,needle",
    [("fifo", "is a FIFO (named pipe)"), ("loop", "is a symlink loop"), ("null", "is a device")],
)
def test_fifo_symlink_loop_and_device_are_refused_without_reading(tmp_path, kind, needle):
    path = special_path(tmp_path, kind)
    with deadline(20, fifo=path), pytest.raises(FileError, match=re.escape(needle)):
        list(iter_raw(path))


def saved(tmp_path):
    Dataset.from_list(ALPACA[:1] * 3).save_to_disk(tmp_path / "ds")
    return tmp_path / "ds"


def edit_state(folder, **changes):
    state = json.loads((folder / "state.json").read_text())
    state.update(changes)
    (folder / "state.json").write_text(json.dumps(state))


def bad_state_json(folder):
    (folder / "state.json").write_text("{not json")
    return "state.json: not valid JSON metadata"


def no_data_files(folder):
    edit_state(folder, _data_files="data.arrow")
    return "'_data_files' must be a list"


def outside_file(folder):
    # a FIFO: a reader that opened it would block until the test's deadline
    os.mkfifo(folder.parent / "outside.arrow")
    edit_state(folder, _data_files=[{"filename": "../outside.arrow"}])
    return "_data_files filename '../outside.arrow' is not a plain name inside"


def symlink_outside(folder):
    (folder / "evil.arrow").symlink_to("/etc/passwd")
    edit_state(folder, _data_files=[{"filename": "evil.arrow"}])
    return "evil.arrow leads outside"


def fifo_file(folder):
    os.mkfifo(folder / "pipe.arrow")
    edit_state(folder, _data_files=[{"filename": "pipe.arrow"}])
    return "pipe.arrow is a FIFO"


def not_arrow(folder):
    (folder / "data-00000-of-00001.arrow").write_text("not arrow at all")
    return "not a readable Arrow stream after row 0"


@pytest.mark.parametrize(
    "spoil", [bad_state_json, no_data_files, outside_file, symlink_outside, fifo_file, not_arrow]
)
@pytest.mark.reliability(
    fault=(
        "a `save_to_disk` folder with bad metadata: state.json not JSON or without a `_data_files` list, "
        "a data file named outside the folder (`../outside.arrow`, a symlink out), a FIFO, a non-Arrow file"
    ),
    seen="the file and the metadata key are named; neither the FIFO nor the file named outside (a FIFO "
    "there too: opening it would block past the test's 20 s deadline) is opened",
    steps_lost="none",
    data_lost="none",
)
def test_save_to_disk_folder_with_bad_metadata_is_named(tmp_path, spoil):
    folder = saved(tmp_path)
    needle = spoil(folder)
    fifo = next((p for p in (folder / "pipe.arrow", tmp_path / "outside.arrow") if p.exists()), None)
    with deadline(20, fifo=fifo), pytest.raises(FileError) as err:
        list(iter_raw(folder))
    assert needle in str(err.value)


def test_dataset_dict_split_outside_the_folder_is_refused(tmp_path):
    folder = tmp_path / "dict"
    DatasetDict({"train": Dataset.from_list(ALPACA[:1])}).save_to_disk(folder)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "../.."]}))
    with pytest.raises(FileError, match=r"split '\.\./\.\.' is not a plain name"):
        list(iter_raw(folder, split="../.."))
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": "train"}))
    with pytest.raises(FileError, match="'splits' must be a list of split names"):
        list(iter_raw(folder))


@pytest.mark.parametrize("cut", ["head", "middle"])
@pytest.mark.reliability(
    fault="a corrupt Parquet file (truncated, or bytes overwritten inside a column chunk)",
    seen='the file is named ("not a readable Parquet file after row N") instead of a pyarrow traceback',
    steps_lost="none",
    data_lost="none",
)
def test_corrupt_parquet_is_named(tmp_path, cut):
    path = write(tmp_path, "rows.parquet", ALPACA * 400)
    data = bytearray(path.read_bytes())
    if cut == "head":
        path.write_bytes(bytes(data[: len(data) // 2]))  # the footer is gone
    else:
        data[len(data) // 2 : len(data) // 2 + 64] = b"\xff" * 64
        path.write_bytes(bytes(data))
    with pytest.raises(FileError, match=r"rows.parquet: not a readable Parquet file after row \d+"):
        list(iter_raw(path))


def test_over_long_jsonl_row_is_skipped_in_bounded_memory(tmp_path):
    path = tmp_path / "long.jsonl"
    with open(path, "wb") as fh:
        fh.write(b'{"instruction": "' + b"x" * 20_000_000 + b'", "output": "y"}\n')
        fh.write(b'{"instruction": "a", "output": "b"}\n')
    tracemalloc.start()
    got = canonical(path, "alpaca", max_row_bytes=1 << 20)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert got[0].reason == ds.ROW_TOO_LARGE
    assert f"{path} row 1: is 20000034 bytes, over data.max_row_bytes (1048576)" in got[0].message()
    assert got[1] == {"instruction": "a", "input": "", "output": "b"}
    assert peak < 6_000_000  # a couple of 1 MiB pieces, not the 20 MB row
    array = tmp_path / "long.json"
    array.write_bytes(b'[{"instruction": "' + b"x" * 5_000_000 + b'", "output": "y"}]')
    with pytest.raises(FileError, match=r"row 1: longer than data.max_row_bytes \(1048576\)"):
        list(iter_raw(array, max_row_bytes=1 << 20))


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.reliability(
    fault=(
        "a row of 200 000 nested `[` (400 KB, under `data.max_row_bytes`) in a `.jsonl` or `.json` "
        "dataset; a row, `tools` or call text nested past 100 levels"
    ),
    seen=(
        "the row named with file, row number and the nesting limit (too_deep), not a RecursionError "
        "traceback; in a .json array a row past the reader's recursion stops the file there"
    ),
    steps_lost="none",
    data_lost="the bad rows only, each named",
)
def test_json_nested_past_the_limit_is_a_named_row_not_a_recursion_error(tmp_path):
    """200 000 nested lists (400 KB, under data.max_row_bytes) overflow Python's JSON reader; a row
    nested one level past ds.MAX_DEPTH is refused the same way, one at the limit is read."""
    at_limit = '{"instruction": "a", "output": "b", "meta": ' + nested(ds.MAX_DEPTH - 1) + "}"
    past = '{"instruction": "c", "output": "d", "meta": ' + nested(ds.MAX_DEPTH) + "}"
    plain = '{"instruction": "e", "output": "f"}'
    needle = "nests lists and objects ([ and {) more than 100 levels deep"
    path = tmp_path / "deep.jsonl"
    path.write_text("\n".join([at_limit, nested(200_000), past, plain]) + "\n")
    got = canonical(path, "alpaca")
    assert got[0]["output"] == "b" and got[3]["output"] == "f"
    assert [(g.row, g.reason) for g in got[1:3]] == [(2, ds.TOO_DEEP), (3, ds.TOO_DEEP)]
    assert got[1].message() == f"{path} row 2: {ds.DEEP}" and needle in ds.DEEP
    array = tmp_path / "deep.json"
    array.write_text(f"[{at_limit}, {past}, {plain}]")  # a row that ends where it should: the file goes on
    got = canonical(array, "alpaca")
    assert (got[0]["output"], got[1].row, got[1].reason, got[2]["output"]) == ("b", 2, ds.TOO_DEEP, "f")
    array.write_text(f"[{plain}, {nested(200_000)}, {plain}]")
    with pytest.raises(FileError) as err:
        list(iter_raw(array))
    assert str(err.value) == f"{array} row 2: {ds.DEEP}; the rest of the file is unreadable"
    # the JSON texts inside a row: tools, and a call (sharegpt)
    err = validate("f.jsonl", 1, {"instruction": "a", "output": "b", "tools": nested(200_000)}, "alpaca")
    assert (err.reason, err.field) == (ds.TOO_DEEP, "tools")
    call = {
        "conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": nested(5000)}]
    }
    err = validate("f.jsonl", 1, call, "sharegpt")
    assert (err.reason, err.field) == (ds.TOO_DEEP, "conversations[2].value")
