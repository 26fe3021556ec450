"""Preference data (preference/data.py): LLaMA-Factory's pair and KTO formats read as its converters
read them, bad rows named with file, row and field, dedup, the stable split, atomic outputs, and the
tokenized data equal to LLaMA-Factory's own pairwise / KTO preprocessing row by row."""

import json

import pytest
from datasets import load_from_disk
from llmft.core.sources import DataError, RowError, validate
from llmft.preference import data as pref

from tests.conftest import real_tokenizer
from tests.lfref import dataset_attr, lf_convert, llamafactory_preprocess

OPTS = {
    "cutoff_len": 96,
    "heldout_fraction": 0.25,
    "split_salt": "s",
    "invalid_rows": "fail",
    "max_dropped_fraction": 0.5,
    "clean_text": False,
    "max_row_bytes": None,
    "synthetic_rows": 60,
}

TOOLS = [
    {"name": "lookup", "description": "Look a word up", "parameters": {"type": "object", "properties": {}}}
]
# Pairs in both of LLaMA-Factory's forms, with system prompts, history and non-ASCII text.
ALPACA_PAIRS = [
    {
        "instruction": f"Question {i}: name a colour",
        "input": "" if i % 3 else "context ü",
        "chosen": f"red {i}",
        "rejected": f"a car {i}",
        **({"system": "Be brief."} if i % 4 == 0 else {}),
        **({"history": [["hi", "hello"]]} if i % 5 == 0 else {}),
    }
    for i in range(24)
]
SHAREGPT_PAIRS = [
    {
        "conversations": [
            *([{"from": "system", "value": "Answer in one word."}] if i % 2 else []),
            {"from": "human", "value": f"first {i}"},
            {"from": "gpt", "value": f"answer {i}"},
            {"from": "human", "value": f"second 問題 {i}"},
        ],
        "chosen": {"from": "gpt", "value": f"good {i}"},
        "rejected": {"from": "gpt", "value": f"bad bad {i}"},
        **({"tools": json.dumps(TOOLS)} if i % 4 == 3 else {}),  # the template writes them
    }
    for i in range(16)
]
# KTO rows as LLaMA-Factory's kto_en_demo.json has them: messages of role/content and a `label`.
KTO_ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Is {i} even?"},
            {"role": "assistant", "content": ("yes" if i % 2 == 0 else "no") if i % 3 else "maybe"},
        ],
        "label": i % 3 != 0,
    }
    for i in range(30)
]
KTO_ENTRY = {
    "file_name": "kto.json",
    "formatting": "sharegpt",
    "columns": {"messages": "messages", "kto_tag": "label"},
    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
}
# An alpaca pair entry with its own column names, as a user's dataset_info.json would map them.
PAIR_ENTRY = {
    "file_name": "pairs.json",
    "ranking": True,
    "columns": {"prompt": "question", "chosen": "good", "rejected": "bad", "system": "sys"},
}


def write(tmp, name, rows):
    path = tmp / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows, ensure_ascii=False))
    return str(path)


def entry_source(tmp, name, entry):
    from llmft.core.lf.lfdataset import resolve

    (tmp / "dataset_info.json").write_text(json.dumps({name: entry}))
    return resolve({"dataset_info": str(tmp / "dataset_info.json"), "name": name}, preference=True)


def prepare(tmp, sources, tok, template="default", **opts):
    return pref.prepare_preference(sources, tmp / "out", tok, template, {**OPTS, **opts})


def errors(tmp, rows, tok, fmt="alpaca", name="bad.jsonl"):
    """The rejected.jsonl records of a run that drops bad rows."""
    path = write(tmp, name, rows)
    stats = prepare(tmp, [{"path": path, "format": fmt}], tok, invalid_rows="drop", max_dropped_fraction=1.0)
    recs = [json.loads(x) for x in (tmp / "out" / "rejected.jsonl").read_text().splitlines()]
    return stats, recs


# -- reading: what LLaMA-Factory's converters make of the same rows


@pytest.mark.parametrize(
    ("rows", "fmt", "entry"),
    [
        (
            ALPACA_PAIRS,
            "alpaca",
            {
                "ranking": True,
                "columns": {
                    "prompt": "instruction",
                    "query": "input",
                    "chosen": "chosen",
                    "rejected": "rejected",
                    "system": "system",
                    "history": "history",
                },
            },
        ),  # fmt: skip
        (
            SHAREGPT_PAIRS,
            "sharegpt",
            {
                "ranking": True,
                "columns": {
                    "messages": "conversations",
                    "chosen": "chosen",
                    "rejected": "rejected",
                    "tools": "tools",
                },
            },
        ),  # fmt: skip
        (KTO_ROWS, "sharegpt", {k: v for k, v in KTO_ENTRY.items() if k != "file_name"}),
    ],
    ids=["alpaca-pairs", "sharegpt-pairs", "kto"],
)
def test_canonical_rows_read_as_llamafactory_reads_the_file(rows, fmt, entry):
    attr = dataset_attr(fmt, entry.get("columns"), entry.get("tags"))
    attr.ranking = bool(entry.get("ranking"))
    theirs = lf_convert(rows, attr)
    ours = [pref.check_row("f", i, r, fmt, None, clean=False) for i, r in enumerate(rows, 1)]
    assert all(not isinstance(o, RowError) for o in ours), ours
    for (_, row), lf in zip(ours, theirs, strict=True):
        mine = pref.aligned(row)
        assert mine["_prompt"] == lf["_prompt"] and mine["_response"] == lf["_response"]
        assert mine["_system"] == (lf["_system"] or "") and mine["_tools"] == (lf["_tools"] or "")


def test_a_dataset_info_entry_is_read_through_its_columns(tmp_path):
    rows = [
        {"question": f"q{i}", "good": f"g{i}", "bad": f"b{i}", "sys": "S" if i else None} for i in range(3)
    ]
    write(tmp_path, "pairs.json", rows)
    src = entry_source(tmp_path, "mine", PAIR_ENTRY)
    kind, row = pref.check_row(src["path"], 1, rows[0], src["format"], src["attr"])
    assert kind == pref.PAIRS
    assert row == {"messages": [{"from": "human", "value": "q0"}], "chosen": {"from": "gpt", "value": "g0"},
                   "rejected": {"from": "gpt", "value": "b0"}}  # fmt: skip
    err = pref.check_row(
        src["path"], 2, {"question": "q", "good": "same", "bad": "same"}, "alpaca", src["attr"]
    )
    assert (err.reason, err.field) == (pref.SAME_ANSWER, "bad")  # the file's own column name


def test_preference_entries_are_checked_and_sft_entries_point_to_preference_data(tmp_path):
    from llmft.core.lf.lfdataset import LFDatasetError, resolve

    write(tmp_path, "pairs.json", [{"question": "q", "good": "g", "bad": "b"}])
    info = tmp_path / "dataset_info.json"
    for entry, needle in (
        ({"file_name": "pairs.json", "ranking": True, "columns": {"chosen": "good"}}, "not columns.rejected"),
        ({"file_name": "pairs.json"}, "is no preference data: set ranking: true"),
    ):
        info.write_text(json.dumps({"e": entry}))
        with pytest.raises(LFDatasetError, match=needle):
            resolve({"dataset_info": str(info), "name": "e"}, preference=True)
    info.write_text(json.dumps({"e": PAIR_ENTRY}))
    with pytest.raises(LFDatasetError, match="give it under preference.data.sources"):
        resolve({"dataset_info": str(info), "name": "e"})


def test_sft_data_refuses_preference_and_kto_rows_naming_preference_data():
    for raw in (ALPACA_PAIRS[1], SHAREGPT_PAIRS[0], KTO_ROWS[1]):
        fmt = "alpaca" if "instruction" in raw else "sharegpt"
        err = validate("f.jsonl", 1, raw, fmt)
        assert err.reason == "unused_column" and "give the file under preference.data.sources" in err.detail


# -- bad rows


@pytest.mark.reliability(
    fault=(
        "preference rows whose chosen equals rejected, with an empty side, a NUL character, a KTO tag "
        "that is not a boolean, a KTO row among pairs, a sharegpt row in an alpaca source, tools the "
        "template's formatters refuse, a chosen call they cannot format"
    ),
    seen=(
        "each row named with file, row number, field and reason in rejected.jsonl under "
        "preference.data.invalid_rows: drop; under fail the stage stops listing every one, writing nothing"
    ),
    steps_lost="none",
    data_lost="the bad rows only, each named",
)
def test_bad_rows_are_named_with_file_row_and_field(tmp_path, tokenizer_dir):
    good = [{"instruction": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(8)]
    bad = [
        {"instruction": "q", "chosen": "same", "rejected": " same  "},  # equal after normalising
        {"instruction": "q", "chosen": "", "rejected": "b"},
        {
            "conversations": [{"from": "human", "value": "q"}],
            "chosen": {"from": "gpt", "value": "  "},
            "rejected": {"from": "gpt", "value": "b"},
        },  # fmt: skip
        {"instruction": "q", "chosen": "a\x00", "rejected": "b"},
        {"instruction": "q", "output": "a", "kto_tag": True},  # a KTO row among pairs
        {"instruction": "q", "output": "a", "label": "yes"},
    ]
    stats, recs = errors(tmp_path, good + bad, tokenizer_dir)
    got = {(r["row"], r["field"], r["reason"]) for r in recs}
    assert got == {
        (9, "rejected", pref.SAME_ANSWER),
        (10, "chosen", "empty_field"),
        (11, "conversations", pref.MIXED_FORMAT),
        (12, "chosen", "nul_character"),
        (13, None, pref.MIXED_FORMAT),
        (14, "label", pref.BAD_TAG),
    }
    assert all(r["source"].endswith("bad.jsonl") and f"row {r['row']}:" in r["message"] for r in recs)
    assert stats["invalid"] == 6 and stats["train_rows"] + stats["heldout_rows"] == 8
    # sharegpt rows in their own source: an empty chosen message is named by its field
    answered = {**SHAREGPT_PAIRS[0], "conversations": SHAREGPT_PAIRS[0]["conversations"][:-1]}
    asked = {**SHAREGPT_PAIRS[1], "chosen": {"from": "human", "value": "a question, not an answer"}}
    unformattable = {**SHAREGPT_PAIRS[2], "tools": '[{"name": "f"}]'}  # the default template needs parameters
    plain = [r for r in SHAREGPT_PAIRS[:7] if "tools" not in r]  # six rows that fit cutoff_len 96
    words = {**SHAREGPT_PAIRS[4], "chosen": {"from": "function_call", "value": "just words"}}  # not a call
    rows = [bad[2], *plain, answered, asked, unformattable, words]
    _, recs = errors(tmp_path, rows, tokenizer_dir, "sharegpt", "s.jsonl")
    assert [(r["row"], r["field"], r["reason"]) for r in recs] == [
        (1, "chosen.value", "empty_field"),
        (8, "conversations", "role_order"),  # the prompt ends with an answer, not the user turn
        (9, "chosen.from", "unknown_role"),  # LLaMA-Factory takes answer roles only there
        (10, "tools", "bad_tools"),  # named, not a traceback in LLaMA-Factory's processor
        (11, "chosen.value", "bad_function_call"),
    ]
    # under fail: every bad row listed, nothing written
    path = write(tmp_path, "bad.jsonl", good + bad)
    with pytest.raises(DataError) as err:
        pref.prepare_preference([{"path": path}], tmp_path / "failed", tokenizer_dir, "default", OPTS)
    assert "6 bad preference row(s)" in str(err.value) and "bad.jsonl row 14: field 'label'" in str(err.value)
    assert not (tmp_path / "failed").exists()


@pytest.mark.reliability(
    fault="a preference pair over the length limit after tokenization (either side)",
    seen=(
        "the row in rejected.jsonl naming the side and its tokens (prompt + answer) against "
        "preference.data.cutoff_len; over preference.data.max_dropped_fraction the stage stops"
    ),
    steps_lost="none",
    data_lost="the over-long rows only, named (never truncated)",
)
def test_over_long_pairs_name_the_side_and_its_tokens(tmp_path, tokenizer_dir):
    rows = [{"instruction": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(8)]
    rows.append({"instruction": "q", "chosen": "short", "rejected": "cat " * 150})
    rows.append({"instruction": "q2", "chosen": "dog " * 150, "rejected": "short"})
    stats, recs = errors(tmp_path, rows, tokenizer_dir)
    assert [(r["row"], r["field"], r["reason"]) for r in recs] == [
        (9, "rejected", pref.TOO_LONG),
        (10, "chosen", pref.TOO_LONG),
    ]
    for rec in recs:
        assert f"field '{rec['field']}' makes the row too long: prompt " in rec["message"]
        assert "tokens with the template, over preference.data.cutoff_len 96" in rec["message"]
    assert stats["too_long"] == 2
    with pytest.raises(DataError, match="2 of 10 preference rows exceed preference.data.cutoff_len"):
        prepare(
            tmp_path, [{"path": write(tmp_path, "a.jsonl", rows)}], tokenizer_dir, max_dropped_fraction=0.0
        )


@pytest.mark.parametrize("name", ["deep.jsonl", "deep.json"])
def test_a_row_nested_200_000_deep_is_named_not_a_recursion_error(tmp_path, tokenizer_dir, name):
    """One row of 200 000 nested lists (400 KB, under preference.data.max_row_bytes) among pairs: the
    stage stops naming the file, the row and the nesting limit, and writes nothing."""
    rows = [json.dumps(r) for r in ALPACA_PAIRS]
    rows.insert(2, "[" * 200_000 + "]" * 200_000)
    path = tmp_path / name
    path.write_text("\n".join(rows) + "\n" if name.endswith(".jsonl") else "[" + ",\n".join(rows) + "]")
    with pytest.raises(DataError) as err:
        prepare(tmp_path, [{"path": str(path)}], tokenizer_dir)
    assert f"{path} row 3: nests lists and objects ([ and {{) more than 100 levels deep" in str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.reliability(
    fault="a KTO row with both `kto_tag` and a boolean `label`, disagreeing",
    seen="the row named with file, row number and field `label` (bad_tag), not `label` silently ignored",
    steps_lost="none",
    data_lost="the bad rows only, each named",
)
def test_a_kto_row_whose_label_contradicts_its_kto_tag_is_refused(tmp_path, tokenizer_dir):
    rows = [{"instruction": f"q{i}", "output": f"a{i}", "kto_tag": i % 2 == 0} for i in range(10)]
    rows.append({"instruction": "q", "output": "yes", "kto_tag": True, "label": False})
    rows.append({"instruction": "q2", "output": "no", "kto_tag": False, "label": False})  # agreeing: kept
    stats, recs = errors(tmp_path, rows, tokenizer_dir)
    assert [(r["row"], r["field"], r["reason"]) for r in recs] == [(11, "label", pref.BAD_TAG)]
    assert recs[0]["message"].endswith(
        "bad.jsonl row 11: field 'label' is false but kto_tag is true: one row, one tag"
    )
    assert stats["invalid"] == 1 and stats["train_rows"] + stats["heldout_rows"] == 11


def test_a_text_label_is_no_kto_tag_in_a_pair_row():
    kind, row = pref.check_row("f", 1, {**ALPACA_PAIRS[1], "label": "colours"}, "alpaca", None)
    assert kind == pref.PAIRS and "label" not in row
    err = pref.check_row("f", 2, {**ALPACA_PAIRS[1], "label": True}, "alpaca", None)
    assert (err.reason, err.field) == (pref.MIXED_FORMAT, "label")


def test_pairs_and_kto_rows_in_one_run_are_refused(tmp_path, tokenizer_dir):
    a = write(tmp_path, "a.jsonl", ALPACA_PAIRS)
    k = write(tmp_path, "k.jsonl", [{"instruction": "q", "output": "a", "kto_tag": True}])
    with pytest.raises(DataError, match=r"preference.data.sources\[1\]: .*k.jsonl row 1 is a KTO row"):
        prepare(tmp_path, [{"path": a}, {"path": k}], tokenizer_dir)
    assert not (tmp_path / "out").exists()


# -- dedup and the split


def test_duplicates_are_dropped_and_the_split_is_stable_by_prompt(tmp_path, tokenizer_dir):
    rows = ALPACA_PAIRS[:16]
    dup = {**rows[3], "chosen": rows[3]["chosen"].upper() + "  "}  # same content after normalising
    other = {**rows[5], "rejected": "another wrong answer"}  # same prompt, another pair
    stats, recs = errors(tmp_path, [*rows, dup, other], tokenizer_dir)
    assert [(r["row"], r["reason"]) for r in recs] == [(17, pref.DUPLICATE)]
    assert stats["duplicates"] == 1 and stats["train_rows"] + stats["heldout_rows"] == 17

    def sides(out):
        return {
            json.dumps(r, sort_keys=True): name
            for name in ("train", "heldout")
            for r in map(json.loads, (out / f"{name}.jsonl").read_text().splitlines())
        }

    before = sides(tmp_path / "out")
    both = [s for s, name in before.items() if rows[5]["instruction"] in s]
    assert len(both) == 2 and len({before[s] for s in both}) == 1  # one prompt, one side
    more = [{"instruction": f"new {i}", "chosen": "a", "rejected": "b"} for i in range(40)]
    errors(tmp_path, [*rows, dup, other, *more], tokenizer_dir)
    after = sides(tmp_path / "out")
    assert {s: after[s] for s in before} == before  # added rows move no row across the split
    assert set(before.values()) == {"train", "heldout"}


# -- the builtin task and the evaluate side's loader


def test_synthetic_task_prefers_the_right_answer():
    from llmft.core.assets import CATEGORIES, NUMBER_WORDS, synthetic_rows

    def right(row):  # the answer worked out from the question, independently of the generator
        if row["task"] == "category":
            word = row["instruction"].removeprefix("Name the category of ").removesuffix(".")
            return next(c for c, ws in CATEGORIES.items() if word in ws)
        return NUMBER_WORDS[len(row["input"].split())]

    pairs, kto = pref.synthetic_rows(50), pref.synthetic_rows(50, pref.KTO)
    assert len(pairs) == len(kto) == 50 and {p["task"] for p in pairs} == {"category", "count"}
    for p in pairs:
        assert p["chosen"] == right(p) != p["rejected"]
    for k in kto:
        assert (k["output"] == right(k)) == k["kto_tag"]
    assert {k["kto_tag"] for k in kto} == {True, False}
    # questions sft's demo data never asks: the preference stage teaches something sft did not
    sft_prompts = {(r["instruction"], r["input"]) for r in synthetic_rows(2000)}
    assert not {(p["instruction"], p["input"]) for p in pairs} & sft_prompts


def test_heldout_pairs_gives_prompt_and_answers(tmp_path, tokenizer_dir):
    for kind in ("pairs", "kto"):
        stats = pref.prepare_preference(
            [{"path": f"builtin:synthetic_{kind}"}], tmp_path / kind, tokenizer_dir, "default", OPTS
        )
        rows = pref.heldout_pairs(tmp_path / kind)
        assert len(rows) == stats["heldout_rows"] > 0
        lines = [json.loads(x) for x in (tmp_path / kind / "heldout.jsonl").read_text().splitlines()]
        for row, line in zip(rows, lines, strict=True):
            assert row.prompt[-1] == {
                "role": "user",
                "content": line["messages"][-1 - (kind == "kto")]["value"],
            }
            if kind == "pairs":
                assert (row.chosen, row.rejected) == (line["chosen"]["value"], line["rejected"]["value"])
            else:
                assert (row.completion, row.tag) == (line["messages"][-1]["value"], line["kto_tag"])


# -- tokenized once, exactly as LLaMA-Factory's pairwise and KTO preprocessing


def _tokenizer(request, family):
    return request.getfixturevalue("tokenizer_dir") if family == "demo" else real_tokenizer(family)


PARITY = [("demo", "default"), ("llama3", "llama3"), ("qwen2_5", "qwen")]


@pytest.mark.parametrize(("family", "template"), PARITY)
@pytest.mark.parametrize("kind", ["pairs", "kto"])
def test_tokenized_equals_llamafactory_preprocessing(tmp_path, request, family, template, kind):
    tok = _tokenizer(request, family)
    if kind == "pairs":
        sources = [{"path": write(tmp_path, "a.jsonl", ALPACA_PAIRS)},
                   {"path": write(tmp_path, "s.json", SHAREGPT_PAIRS), "format": "sharegpt"}]  # fmt: skip
    else:
        # With the demo tokenizer 1500 distinct rows: the train split spans two of LLaMA-Factory's
        # 1000-row batches, within which its KTO processor pairs each prompt with the previous row's
        # answer (the KL pairs); every answer differs, so a KL pair made across other batches would
        # show. Real tokenizers (slower) get 150 rows: one batch.
        copies = 50 if family == "demo" else 5
        rows = [
            {**r, "messages": [{**m, "content": f"{m['content']} ({n})"} for m in r["messages"]]}
            for n in range(copies)
            for r in KTO_ROWS
        ]
        write(tmp_path, "kto.json", rows)
        sources = [entry_source(tmp_path, "kto", KTO_ENTRY)]
    stats = prepare(tmp_path, sources, tok, template, cutoff_len=1024 if kind == "pairs" else 48)
    out = tmp_path / "out"
    stage = "rm" if kind == "pairs" else "kto"
    names = (pref.TRAIN_NAME, pref.HELDOUT_NAME)
    theirs = llamafactory_preprocess(tmp_path, out, tok, stats["cutoff_len"], stage, names, template=template)
    ours = load_from_disk(str(out / "tokenized"))
    if kind == "pairs":  # rows with tools are among those compared
        assert any(json.loads(line).get("tools") for line in (out / "train.jsonl").read_text().splitlines())
    for split, lf in (("train", theirs["train_dataset"]), ("validation", theirs["eval_dataset"])):
        mine = ours[split]
        if kind == "pairs":  # one column more: each pair's longer side, the length sampler's key
            both = zip(lf["chosen_input_ids"], lf["rejected_input_ids"], strict=True)
            assert mine[pref.LENGTH_COLUMN] == [max(len(c), len(r)) for c, r in both]
            mine = mine.remove_columns(pref.LENGTH_COLUMN)
        assert mine.features == lf.features
        assert len(mine) == len(lf) > 5
        assert mine[:] == lf[:]  # every column of every row, KTO's mismatched KL pairs too
    if kind == "kto" and family == "demo":
        assert stats["train_rows"] > 1000  # more than one of LLaMA-Factory's 1000-row batches
    if family != "demo":
        return  # loading the saved folder does not depend on the tokenizer: once is enough
    # LLaMA-Factory's tokenized_path loads it as it is, without looking for the raw data
    module = llamafactory_preprocess(
        tmp_path, tmp_path / "nowhere", tok, stats["cutoff_len"], stage, names,
        template=template, tokenized_path=str(out / "tokenized"),
    )  # fmt: skip
    assert len(module["train_dataset"]) == stats["train_rows"]


# -- the stage's CLI


def test_the_cli_names_bad_rows_without_a_traceback_and_leaves_no_outputs(tmp_path, tokenizer_dir, capsys):
    from llmft.__main__ import main

    def run(cfg, out):
        argv = ["prepare-preference", "--config-json", json.dumps({"model": {"template": "default"}, **cfg})]
        return main([*argv, "--tokenizer", str(tokenizer_dir), "--out-dir", str(out)])

    bad = write(
        tmp_path, "bad.jsonl", [*ALPACA_PAIRS[:4], {"instruction": "q", "chosen": "a", "rejected": "a"}]
    )
    assert run({"preference": {"data": {"sources": [{"path": bad}]}}}, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "llmft: data error: 1 bad preference row(s) (chosen_equals_rejected 1)" in err
    assert "bad.jsonl row 5: field 'rejected' equals the chosen answer" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert run({}, tmp_path / "out") == 2  # no preference section: nothing to prepare
    assert "config key preference: not set" in capsys.readouterr().err
    data = {"sources": [{"path": "builtin:synthetic_kto"}], "synthetic_rows": 40}
    assert run({"preference": {"data": data}}, tmp_path / "out") == 2  # KTO rows under dpo (the default)
    assert "config key preference.method is dpo, which trains on pairs" in capsys.readouterr().err
    assert run({"preference": {"method": "kto", "data": data}}, tmp_path / "out") == 0
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["kind"] == "kto" and stats["train_rows"] + stats["heldout_rows"] + stats["duplicates"] == 40


@pytest.mark.reliability(
    fault="pair data under preference.method: kto, or KTO rows under dpo",
    seen="prepare_preference stops naming preference.method, the kind of rows given and the fix",
    steps_lost="none (before training)",
    data_lost="none (nothing written)",
)
def test_rows_of_the_other_method_are_refused_by_name(tmp_path, tokenizer_dir):
    src = [{"path": "builtin:synthetic_pairs"}]
    with pytest.raises(DataError) as err:
        pref.prepare_preference(src, tmp_path / "kto", tokenizer_dir, "default", {**OPTS, "method": "kto"})
    assert "preference.method is kto, which trains on kto, but preference.data.sources hold pairs" in str(
        err.value
    )
    assert "builtin:synthetic_kto" in str(err.value) and not (tmp_path / "kto").exists()
    src = [{"path": "builtin:synthetic_kto"}]
    with pytest.raises(DataError, match=r"preference.method is dpo, which trains on pairs, but .* hold kto"):
        pref.prepare_preference(src, tmp_path / "dpo", tokenizer_dir, "default", {**OPTS, "method": "dpo"})
    assert not (tmp_path / "dpo").exists()
    stats = pref.prepare_preference(src, tmp_path / "ok", tokenizer_dir, "default", {**OPTS, "method": "kto"})
    assert stats["kind"] == "kto"
