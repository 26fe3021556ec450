"""prepare(): validation reports every bad row, policies, dedup, length filter, weights, mixed formats,
stable split under growth, and the outputs LLaMA-Factory reads."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, load_from_disk
from llmft.core.assets import synthetic_rows
from llmft.core.io import read_jsonl
from llmft.core.sources import DataError
from llmft.data.prepare import content_key, is_heldout, prepare


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
    assert not (tmp_path / "out").exists()  # nothing half-made is left to trust, not even the folder


def test_fail_policy_reports_every_bad_row_not_just_the_first(tmp_path, tokenizer_dir, caplog):
    src = tmp_path / "in.jsonl"
    lines = [json.dumps(r) for r in synthetic_rows(300)]
    lines[9] = '{"instruction": "x"}'
    lines[99] = "{not json"
    lines[249] = '{"instruction": "x", "output": 3}'
    src.write_bytes(("\n".join(lines) + "\n").encode() + b'{"instruction": "a", "output": "\xff"}\n')
    with pytest.raises(DataError) as err:
        prepare([{"path": str(src)}], tmp_path / "out", tokenizer_dir, "default", 64, 0.2, "s", "fail")
    message = str(err.value)
    assert message.startswith("4 bad row(s) (bad_encoding 1, bad_json 1, missing_field 1, wrong_type 1)")
    for needle in (
        "row 10: field 'output' is missing",
        "row 100: not valid JSON",
        "row 250: field 'output'",
        "row 301: field 'output' is not valid UTF-8",
    ):
        assert needle in message and needle in caplog.text


def test_drop_policy_counts_bad_rows_and_lists_every_one(tmp_path, tokenizer_dir):
    rows = synthetic_rows(200) + [{"instruction": "x"}, {"output": "y"}, {"instruction": 1, "output": "z"}]
    stats = run(tmp_path, tokenizer_dir, rows, invalid_rows="drop")
    assert stats["invalid"] == 3
    assert stats["invalid_by_reason"] == {"missing_field": 2, "wrong_type": 1}
    first = stats["invalid_examples"][0]
    assert (first["row"], first["field"], first["reason"]) == (201, "output", "missing_field")
    assert "row 201: field 'output' is missing" in first["message"]
    rejected = read_jsonl(tmp_path / "out/rejected.jsonl")
    assert [r["row"] for r in rejected if r["reason"] != "duplicate"] == [201, 202, 203]
    kept = read_jsonl(tmp_path / "out/train.jsonl") + read_jsonl(tmp_path / "out/heldout.jsonl")
    assert len(kept) == 200 - stats["duplicates"] - stats["decontaminated"]
    assert stats["sources"][0]["invalid"] == 3


def test_dedup_after_normalisation_and_length_filter(tmp_path, tokenizer_dir):
    a = {"instruction": "Repeat the words.", "input": "cat dog", "output": "cat dog"}
    a_spaced = {"instruction": "  Repeat   the words. ", "input": "cat  dog", "output": "CAT dog "}
    long = {"instruction": "Repeat the words.", "input": "cat " * 80, "output": "cat " * 80}
    stats = run(tmp_path, tokenizer_dir, [a, a_spaced, long] + synthetic_rows(300, seed=5))
    assert stats["duplicates"] >= 1
    assert stats["too_long"] == 1
    kept = read_jsonl(tmp_path / "out/train.jsonl") + read_jsonl(tmp_path / "out/heldout.jsonl")
    assert all(len(r["input"].split()) < 80 for r in kept)
    assert sum(stats["length_histogram"]["counts"]) == stats["rows_read"] - stats["duplicates"]
    assert (
        stats["max_tokens"]
        > 64
        >= max(len(x) for x in load_from_disk(str(tmp_path / "out/tokenized"))["train"]["input_ids"])
    )
    reasons = {r["reason"] for r in read_jsonl(tmp_path / "out/rejected.jsonl")}
    assert {"duplicate", "too_long"} <= reasons


def test_split_is_stable_when_rows_are_appended(tmp_path, tokenizer_dir):
    first = synthetic_rows(400, seed=1)
    run(tmp_path, tokenizer_dir, first)
    held_before = {content_key(r) for r in read_jsonl(tmp_path / "out/heldout.jsonl")}
    train_before = {content_key(r) for r in read_jsonl(tmp_path / "out/train.jsonl")}
    run(tmp_path, tokenizer_dir, first + synthetic_rows(400, seed=2))
    held_after = {content_key(r) for r in read_jsonl(tmp_path / "out/heldout.jsonl")}
    train_after = {content_key(r) for r in read_jsonl(tmp_path / "out/train.jsonl")}
    assert held_before <= held_after  # no held-out row left or moved
    assert not held_after & train_after and not held_before & train_after  # nothing crossed over
    assert len(held_after) > len(held_before)
    # A train row may only leave train when a new held-out row is its near-duplicate.
    assert len(train_before - train_after) <= len(held_after - held_before)


def test_split_fraction_is_close_to_asked():
    keys = [content_key({"instruction": str(i), "output": "x"}) for i in range(5000)]
    share = sum(is_heldout(k, 0.1, "salt") for k in keys) / len(keys)
    assert 0.08 < share < 0.12


def test_outputs_are_written_for_llamafactory(tmp_path, tokenizer_dir):
    stats = run(tmp_path, tokenizer_dir, synthetic_rows(300))
    info = json.loads((tmp_path / "out/dataset_info.json").read_text())
    assert info["llmft_train"]["file_name"] == "train.jsonl"
    assert "history" not in info["llmft_train"]["columns"]  # no row has one: not declared
    assert stats["train_rows"] == len(read_jsonl(tmp_path / "out/train.jsonl"))
    tokenized = load_from_disk(str(tmp_path / "out/tokenized"))
    assert (len(tokenized["train"]), len(tokenized["validation"])) == (
        stats["train_rows"],
        stats["heldout_rows"],
    )
    assert not list((tmp_path / "out").glob(".*"))  # no temporary files left behind


def test_weights_repeat_train_rows_never_heldout(tmp_path, tokenizer_dir):
    rows = synthetic_rows(400, seed=7)
    a, b = write_rows(tmp_path / "a.jsonl", rows[:200]), write_rows(tmp_path / "b.jsonl", rows[200:])
    base = prepare(
        [{"path": str(a)}, {"path": str(b)}], tmp_path / "one", tokenizer_dir, "default", 64, 0.2, "s"
    )
    mixed = prepare(
        [{"path": str(a), "weight": 2.0}, {"path": str(b), "weight": 0.5}],
        tmp_path / "mix",
        tokenizer_dir,
        "default",
        64,
        0.2,
        "s",
    )
    one, mix = base["sources"], mixed["sources"]
    assert mix[0]["train_rows"] == 2 * one[0]["train_rows"]
    assert 0.3 * one[1]["train_rows"] < mix[1]["train_rows"] < 0.7 * one[1]["train_rows"]
    assert mixed["heldout_rows"] == base["heldout_rows"]
    again = prepare(
        [{"path": str(a), "weight": 2.0}, {"path": str(b), "weight": 0.5}],
        tmp_path / "again",
        tokenizer_dir,
        "default",
        64,
        0.2,
        "s",
    )
    assert again["fingerprint"] == mixed["fingerprint"]  # the half is the same half every run
    train = read_jsonl(tmp_path / "mix/train.jsonl")
    assert len(load_from_disk(str(tmp_path / "mix/tokenized"))["train"]) == len(train) == mixed["train_rows"]


def test_formats_mix_in_one_run(tmp_path, tokenizer_dir):
    alpaca = synthetic_rows(150, seed=11)
    write_rows(tmp_path / "a.jsonl", alpaca)
    convs = [
        {
            "conversations": [
                {"from": "human", "value": f"question {i} cat"},
                {"from": "gpt", "value": f"answer {i}"},
                {"from": "human", "value": "and again?"},
                {"from": "gpt", "value": f"again {i}"},
            ],
            "system": "Be brief.",
        }
        for i in range(80)
    ]
    table = pa.Table.from_pylist(convs)
    pq.write_table(table, tmp_path / "s.parquet", row_group_size=16)
    Dataset.from_list(alpaca[:50] + synthetic_rows(60, seed=12)).save_to_disk(tmp_path / "disk")
    (tmp_path / "j.json").write_text(json.dumps(convs[:10]))  # exact duplicates of parquet rows
    stats = prepare(
        [
            {"path": str(tmp_path / "a.jsonl")},
            {"path": str(tmp_path / "s.parquet"), "format": "sharegpt"},
            {"path": str(tmp_path / "disk")},
            {"path": str(tmp_path / "j.json"), "format": "sharegpt"},
        ],
        tmp_path / "out",
        tokenizer_dir,
        "default",
        128,
        0.2,
        "s",
    )
    by_path = {s["path"].rsplit("/", 1)[-1]: s for s in stats["sources"]}
    assert by_path["s.parquet"]["rows"] == 80 and by_path["j.json"]["duplicates"] == 10
    assert by_path["disk"]["duplicates"] >= 50  # the first 50 repeat a.jsonl
    train = read_jsonl(tmp_path / "out/train.jsonl")
    multi = [r for r in train if r.get("history")]
    assert multi and multi[0]["system"] == "Be brief." and multi[0]["history"][0][0].startswith("question")
    info = json.loads((tmp_path / "out/dataset_info.json").read_text())
    assert info["llmft_train"]["columns"]["history"] == "history"


@pytest.mark.reliability(
    fault=(
        "the length filter or validation dropping more than `data.max_dropped_fraction` (10 %) of "
        "rows; an empty source"
    ),
    seen=(
        'the stage fails naming the cause and the fix ("20 of 100 rows exceed data.cutoff_len 64 '
        '... raise data.cutoff_len")'
    ),
    steps_lost="none",
    data_lost="none: no half-written split is left",
)
def test_data_loss_is_loud_and_names_the_cause_and_the_fix(tmp_path, tokenizer_dir):
    rows = synthetic_rows(100)
    long = {"instruction": "w " * 400, "output": "x"}
    too_long = rows[:80] + [dict(long, output=f"x{i}") for i in range(20)]
    with pytest.raises(
        DataError, match=r"20 of 100 rows exceed data.cutoff_len 64 .*raise data.cutoff_len"
    ) as err:
        run(tmp_path, tokenizer_dir, too_long, max_dropped=0.1)
    assert not (tmp_path / "out").exists()  # nothing half-written to trust
    stats = run(tmp_path, tokenizer_dir, too_long, max_dropped=0.25)  # allowed
    assert stats["too_long"] == 20
    # the longest row named is the longest row read (a dropped one), and called just that
    assert f"(tokens with the template; the longest row has {stats['max_tokens']})" in str(err.value)
    assert stats["max_tokens"] > 64
    bad = rows[:80] + [{"instruction": "x"}] * 20
    with pytest.raises(DataError, match=r"20 of 100 rows are invalid \(missing_field 20"):
        run(tmp_path, tokenizer_dir, bad, invalid_rows="drop", max_dropped=0.1)
    write_rows(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match=r"data.sources\[0\].path: .*empty.jsonl holds no rows"):
        prepare(
            [{"path": str(tmp_path / "empty.jsonl")}], tmp_path / "o2", tokenizer_dir, "default", 64, 0.2, "s"
        )


def stage(tmp_path, tokenizer_dir, source: dict):
    """`llmft prepare-data`, the stage's own command, on one source; never more than two minutes."""
    import subprocess
    import sys

    cfg = {"data": {"sources": [source]}, "model": {"template": "default"}}
    return subprocess.run(
        [sys.executable, "-m", "llmft", "prepare-data", "--config-json", json.dumps(cfg),
         "--tokenizer", str(tokenizer_dir), "--out-dir", str(tmp_path / "out"), "--workers", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_stage_prints_a_data_error_without_a_traceback(tmp_path, tokenizer_dir):
    (tmp_path / "empty.json").write_text("[]")  # not zero bytes: config validation refuses those
    proc = stage(tmp_path, tokenizer_dir, {"path": str(tmp_path / "empty.json")})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "\nllmft: data error: config key data.sources[0].path" in proc.stderr


def passwd_folder(tmp_path):
    Dataset.from_list(synthetic_rows(3)).save_to_disk(tmp_path / "ds")
    state = json.loads((tmp_path / "ds/state.json").read_text())
    state["_data_files"] = [{"filename": "../../../../../../../../etc/passwd"}]
    (tmp_path / "ds/state.json").write_text(json.dumps(state))
    return {"path": str(tmp_path / "ds")}, "is not a plain name inside"


def truncated_parquet(tmp_path):
    pq.write_table(pa.Table.from_pylist(synthetic_rows(500)), tmp_path / "rows.parquet")
    data = (tmp_path / "rows.parquet").read_bytes()
    (tmp_path / "rows.parquet").write_bytes(data[: len(data) // 2])
    return {"path": str(tmp_path / "rows.parquet")}, "rows.parquet: not a readable Parquet file after row 0"


@pytest.mark.parametrize("make", [passwd_folder, truncated_parquet])
def test_the_stage_fails_on_a_bad_folder_or_parquet_naming_it(tmp_path, tokenizer_dir, make):
    source, needle = make(tmp_path)
    proc = stage(tmp_path, tokenizer_dir, source)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "llmft: data error: " in proc.stderr and needle in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.reliability(
    fault="prepare_data failing (a bad row) when its data folder is empty or new (Snakemake makes it first)",
    seen="the stage fails and removes the empty folder; a folder holding other files is left as it was",
    steps_lost="none",
    data_lost="none: no empty or half-written data folder is left for a later run to trust",
)
def test_a_failed_stage_leaves_no_data_folder(tmp_path, tokenizer_dir):
    rows = synthetic_rows(40) + [{"instruction": "x"}]
    (tmp_path / "out").mkdir()  # as Snakemake makes an output's folder before the job
    with pytest.raises(DataError, match="field 'output' is missing"):
        run(tmp_path, tokenizer_dir, rows)
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "synthetic.jsonl").write_text("{}\n")
    with pytest.raises(DataError):
        run(tmp_path, tokenizer_dir, rows)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["synthetic.jsonl"]


@pytest.mark.reliability(
    fault="a 40 MB JSON Lines file without a newline (one huge row) as a data source",
    seen=(
        'the stage fails naming the row and the cap ("row 1: is 40000034 bytes, over '
        'data.max_row_bytes (4194304)"); its peak memory stays under 1 GiB'
    ),
    steps_lost="none",
    data_lost="none",
)
def test_a_huge_row_is_refused_in_bounded_time_and_memory(tmp_path, tokenizer_dir):
    import subprocess
    import sys

    src = tmp_path / "one_line.jsonl"
    with open(src, "wb") as fh:
        fh.write(b'{"instruction": "' + b"w " * 20_000_000 + b'", "output": "y"}')
    cfg = {"data": {"sources": [{"path": str(src)}]}, "model": {"template": "default"}}
    code = (
        "import resource, subprocess, sys\n"
        "cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
        "proc = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=120, preexec_fn=cap)\n"
        "sys.stderr.write(proc.stderr)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.exit(proc.returncode)\n"
    )  # the stage's peak memory, measured apart from this test; its address space capped so that a
    # regression fails here instead of filling the machine
    proc = subprocess.run(
        [sys.executable, "-c", code, sys.executable, "-m", "llmft", "prepare-data", "--config-json",
         json.dumps(cfg), "--tokenizer", str(tokenizer_dir), "--out-dir", str(tmp_path / "out"),
         "--workers", "1"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{src} row 1: is 40000034 bytes, over data.max_row_bytes (4194304)" in proc.stderr
    assert int(proc.stdout.strip()) < 1 << 20, proc.stdout  # KiB: under 1 GiB
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_row_nested_200_000_deep_is_named_not_a_recursion_error(tmp_path, tokenizer_dir, suffix):
    """One row of 200 000 nested lists (400 KB, under data.max_row_bytes) among good rows: the stage
    stops naming the file, the row and the nesting limit, and writes nothing."""
    src = tmp_path / f"in{suffix}"
    rows = [json.dumps(r) for r in synthetic_rows(40, seed=3)]
    rows.insert(2, "[" * 200_000 + "]" * 200_000)
    src.write_text("\n".join(rows) + "\n" if suffix == ".jsonl" else "[" + ",\n".join(rows) + "]")
    with pytest.raises(DataError) as err:
        prepare([{"path": str(src)}], tmp_path / "out", tokenizer_dir, "default", 64, 0.2, "s", "fail")
    assert f"{src} row 3: nests lists and objects ([ and {{) more than 100 levels deep" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_tasks_heldout_counts_only_rows_that_name_a_task(tmp_path, tokenizer_dir):
    named = synthetic_rows(300)  # the demo's rows carry a `task`
    bare = [{"instruction": f"say {i} twice", "output": f"{i} {i}"} for i in range(300)]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    stats = run(tmp_path / "a", tokenizer_dir, bare)
    assert stats["heldout_rows"] > 0 and stats["tasks_heldout"] == {}
    stats = run(tmp_path / "b", tokenizer_dir, named + bare)
    assert "" not in stats["tasks_heldout"]
    heldout = read_jsonl(tmp_path / "b/out/heldout.jsonl")
    assert sum(stats["tasks_heldout"].values()) == sum(1 for r in heldout if r.get("task"))
