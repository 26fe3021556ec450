"""A LLaMA-Factory dataset_info.json entry as a data source: read as LLaMA-Factory reads it (its
columns, tags and defaults), compared with LLaMA-Factory's own loading of the same entry; what
cannot be read offline for SFT is refused naming the config key, the entry and its key."""

import json

import pytest
import yaml
from datasets import load_from_disk
from llmft.core.assets import build_tokenizer
from llmft.core.config import ConfigError
from llmft.core.config import validate as validate_config
from llmft.core.lf import lfdataset
from llmft.core.sources import DataError
from llmft.data.prepare import prepare

from tests.conftest import REPO
from tests.lfref import llamafactory_preprocess

ALPACA = [
    {"q": f"question {i}", "ctx": "some context" if i % 2 else "", "a": f"answer {i}", "sys": "Be brief.",
     "hist": [[f"earlier {i}", f"earlier answer {i}"]] if i % 3 == 0 else None, "instruction": "ignored"}
    for i in range(30)
]  # fmt: skip
SHAREGPT = [
    {
        "messages": (
            ([{"role": "system", "content": f"System {i % 2}."}] if i % 2 else [])
            + [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]
            + (
                [{"role": "user", "content": "more"}, {"role": "assistant", "content": f"sure {i}"}]
                if i % 3
                else []
            )
        ),
        "sys": "from the column",
    }
    for i in range(30)
]
ENTRIES = {
    "alpaca_cols": {
        "file_name": "data/alpaca.json",
        "columns": {"prompt": "q", "query": "ctx", "response": "a", "system": "sys", "history": "hist"},
    },
    # no columns: LLaMA-Factory's defaults, which read neither a system nor a history field
    "alpaca_plain": {"file_name": "data/plain.jsonl"},
    "sharegpt_tags": {
        "file_name": "data/chat.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "system": "sys"},
        "tags": {
            "role_tag": "role",
            "content_tag": "content",
            "user_tag": "user",
            "assistant_tag": "assistant",
            "system_tag": "system",
        },
    },
}


@pytest.fixture(scope="module")
def lf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lfdata")
    (d / "data").mkdir()
    (d / "data" / "alpaca.json").write_text(json.dumps(ALPACA))
    plain = [{"instruction": f"task {i}", "input": "", "output": f"done {i}", "system": "never read",
              "history": [["not", "read"]]} for i in range(30)]  # fmt: skip
    (d / "data" / "plain.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plain))
    (d / "data" / "chat.json").write_text(json.dumps(SHAREGPT))
    (d / "dataset_info.json").write_text(json.dumps(ENTRIES))
    build_tokenizer(d / "tok", 512)
    return d


def test_attributes_are_llamafactorys():
    from llamafactory.data.parser import DatasetAttr

    extra = [{"formatting": "sharegpt", "tags": {"role_tag": "r"}}, {"columns": {"prompt": "p"}}, {}]
    for entry in [*ENTRIES.values(), *extra]:
        theirs = DatasetAttr("file", dataset_name="x")
        theirs.join(entry)
        assert lfdataset.attributes(entry) == {k: getattr(theirs, k) for k in lfdataset.attributes(entry)}


def ours(out) -> list:
    tok = load_from_disk(str(out / "tokenized"))
    return [(tuple(r["input_ids"]), tuple(r["labels"])) for s in ("train", "validation") for r in tok[s]]


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_entry_reads_as_llamafactory_reads_it(tmp_path, lf_dir, name):
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["data"]["sources"] = [{"dataset_info": str(lf_dir / "dataset_info.json"), "name": name}]
    cfg = validate_config(cfg, base_dir=REPO)
    entry = lfdataset.resolve(cfg["data"]["sources"][0])
    assert entry["path"] == str(lf_dir / ENTRIES[name]["file_name"])  # relative to the file's folder
    src = {"path": entry["path"], "format": entry["format"], "attr": entry["attr"]}
    stats = prepare([src], tmp_path / "out", lf_dir / "tok", "default", 4096, 0.3, "s", "fail")
    assert stats["train_rows"] + stats["heldout_rows"] == 30
    # LLaMA-Factory loading the same entry itself
    lf = {"llmft_train": ENTRIES[name] | {"file_name": entry["path"]}}
    lf["llmft_heldout"] = lf["llmft_train"]
    (tmp_path / "lf").mkdir()
    (tmp_path / "lf" / "dataset_info.json").write_text(json.dumps(lf))
    theirs = llamafactory_preprocess(tmp_path, tmp_path / "lf", lf_dir / "tok", 4096)["train_dataset"]
    assert len(theirs) == 30
    assert sorted(ours(tmp_path / "out")) == sorted(
        (tuple(r["input_ids"]), tuple(r["labels"])) for r in theirs
    )
    written = [json.loads(x) for f in ("train.jsonl", "heldout.jsonl") for x in open(tmp_path / "out" / f)]
    if name == "alpaca_plain":
        assert not any("system" in r or "history" in r for r in written)  # not mapped, not read
    if name == "alpaca_cols":
        assert all(r["system"] == "Be brief." for r in written) and any("history" in r for r in written)
        assert all(r["instruction"].startswith("question") for r in written)
    if name == "sharegpt_tags":  # a first system turn wins over the system column, as in LLaMA-Factory
        assert {r.get("system") for r in written} == {"System 1.", "from the column"}


def test_bad_rows_are_named_as_the_file_names_them(tmp_path, lf_dir):
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "gpt", "content": "a"}]},
    ]
    (tmp_path / "bad.json").write_text(json.dumps(rows))
    entry = ENTRIES["sharegpt_tags"] | {"file_name": str(tmp_path / "bad.json")}
    src = {"path": str(tmp_path / "bad.json"), "format": "sharegpt", "attr": lfdataset.attributes(entry)}
    with pytest.raises(DataError) as err:
        prepare([src], tmp_path / "out", lf_dir / "tok", "default", 4096, 0.3, "s", "fail")
    msg = str(err.value)
    assert "field 'messages[2].role'" in msg and "'bot'" in msg
    assert "field 'messages[2].content'" in msg and "is empty" in msg
    # 'gpt' is llmft's own name, but not a tag of this entry: LLaMA-Factory would not read it either
    assert "'gpt (matches no tag of the entry)'" in msg
    assert "Traceback" not in msg


def test_columns_the_entry_does_not_map_but_other_stages_read_are_refused(tmp_path, lf_dir):
    """mllm_demo.json under an entry without columns.images: LLaMA-Factory's SFT would drop the
    images and train on "<image>" as text; llmft refuses the rows naming the column."""
    rows = [
        {"messages": [{"role": "user", "content": "<image>q"}, {"role": "assistant", "content": f"a{i}"}],
         "images": ["mllm_demo_data/1.jpg"]}
        for i in range(3)
    ]  # fmt: skip
    (tmp_path / "mllm.json").write_text(json.dumps(rows))
    entry = ENTRIES["sharegpt_tags"] | {"file_name": str(tmp_path / "mllm.json")}
    src = {"path": str(tmp_path / "mllm.json"), "format": "sharegpt", "attr": lfdataset.attributes(entry)}
    with pytest.raises(DataError) as err:
        prepare([src], tmp_path / "out", lf_dir / "tok", "default", 4096, 0.3, "s", "fail")
    assert "3 bad row(s) (unused_column 3)" in str(err.value)
    assert "mllm.json row 1: field 'images' holds images, for a multimodal model" in str(err.value)


def test_an_entry_naming_a_fifo_is_refused_without_opening_it(tmp_path):
    import os

    (tmp_path / "info").mkdir()
    os.mkfifo(tmp_path / "info" / "pipe.json")
    files = {"info/dataset_info.json": json.dumps({"mine": {"file_name": "pipe.json"}})}
    msg = refusal(tmp_path, {"dataset_info": "info/dataset_info.json", "name": "mine"}, files)
    assert "file_name 'pipe.json' is a FIFO (named pipe), not a regular file" in msg


def refusal(tmp_path, source: dict, files: dict | None = None) -> str:
    for name, text in (files or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["data"]["sources"] = [{"path": "builtin:synthetic"}, source]
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, base_dir=tmp_path)
    return str(err.value)


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        (
            {"hf_hub_url": "org/data"},
            "loads from hf_hub_url ('org/data'); this pipeline reads local files only",
        ),
        ({"ms_hub_url": "org/data"}, "loads from ms_hub_url"),
        ({"script_url": "my_script"}, "loads from script_url"),
        ({"file_name": "d.json", "ranking": True}, "sets ranking (preference data for DPO/RM)"),
        (
            {"file_name": "d.json", "columns": {"prompt": "p", "images": "img"}},
            "sets columns.images (image data)",
        ),
        ({"file_name": "d.json", "columns": {"kto_tag": "label"}}, "sets columns.kto_tag (KTO data)"),
        ({"file_name": "d.json", "formatting": "openai"}, "formatting 'openai'; only alpaca and sharegpt"),
        ({"file_name": "d.json", "num_samples": 10}, "sets num_samples"),
        ({"file_name": "missing.json"}, "file_name 'missing.json' not found"),
        ({"file_name": "sub"}, "names a folder"),
        ({"file_name": "d.csv"}, "is not .json, .jsonl or .parquet"),
        ({"formatting": "alpaca"}, "has no file_name"),
    ],
)
def test_unsupported_entries_are_refused_by_name(tmp_path, entry, expected):
    files = {
        "info/dataset_info.json": json.dumps({"mine": entry}),
        "info/d.json": "[]\n",
        "info/d.csv": "a\n",
    }
    (tmp_path / "info" / "sub").mkdir(parents=True)
    msg = refusal(tmp_path, {"dataset_info": "info/dataset_info.json", "name": "mine"}, files)
    assert msg.startswith("config key data.sources[1].dataset_info: entry 'mine' of "), msg
    assert expected in msg


def test_source_item_keys_are_checked(tmp_path):
    files = {"dataset_info.json": json.dumps({"a": {"file_name": "d.json"}, "b": {}}), "d.json": "[{}]"}
    assert refusal(tmp_path, {"dataset_info": "dataset_info.json", "name": "zz"}, files) == (
        f"config key data.sources[1].name: {tmp_path}/dataset_info.json has no entry 'zz' (entries: a, b)"
    )
    msg = refusal(tmp_path, {"dataset_info": "dataset_info.json"})
    assert msg.startswith("config key data.sources[1].name: missing")
    msg = refusal(tmp_path, {"dataset_info": "dataset_info.json", "name": "a", "format": "sharegpt"})
    assert msg.startswith("config key data.sources[1].format: not with dataset_info")
    msg = refusal(tmp_path, {"dataset_info": "dataset_info.json", "name": "a", "path": "d.json"})
    assert msg.startswith("config key data.sources[1].path: not with dataset_info")
    assert refusal(tmp_path, {"weight": 2.0}).startswith("config key data.sources[1]: needs path")
    msg = refusal(tmp_path, {"path": "d.json", "name": "a"})
    assert msg.startswith("config key data.sources[1].name: only with dataset_info")
    msg = refusal(tmp_path, {"dataset_info": "nope/dataset_info.json", "name": "a"})
    assert msg == f"config key data.sources[1].dataset_info: {tmp_path}/nope/dataset_info.json not found"
    (tmp_path / "broken.json").write_text("{")
    msg = refusal(tmp_path, {"dataset_info": "broken.json", "name": "a"})
    assert msg.startswith("config key data.sources[1].dataset_info:") and "is not valid JSON" in msg


def test_nightly_fingerprint_follows_the_entry_and_its_file(tmp_path):
    from llmft.core.settings import Data
    from llmft.nightly.run import data_fingerprint

    (tmp_path / "d.json").write_text(json.dumps([{"instruction": "q", "output": "a"}]))
    write = lambda entry: (tmp_path / "dataset_info.json").write_text(json.dumps({"e": entry}))  # noqa: E731
    cfg = Data(sources=[{"dataset_info": "dataset_info.json", "name": "e", "weight": 1.0}])
    write({"file_name": "d.json"})
    first = data_fingerprint(cfg, tmp_path)
    assert data_fingerprint(cfg, tmp_path) == first
    write({"file_name": "d.json", "columns": {"prompt": "instruction", "response": "output"}})
    assert data_fingerprint(cfg, tmp_path) != first  # same data file, another reading of it
    second = data_fingerprint(cfg, tmp_path)
    (tmp_path / "d.json").write_text(json.dumps([{"instruction": "q2", "output": "a"}]))
    assert data_fingerprint(cfg, tmp_path) != second
