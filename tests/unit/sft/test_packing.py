"""Wiring of pack_data: which runs load packed rows, the stamp that refuses stale ones, atomic output.
(That the packed rows equal LLaMA-Factory's own packing is tested in test_pretokenize.py.)"""

import json
from pathlib import Path

import pytest
import yaml
from datasets import load_from_disk
from llmft.__main__ import main
from llmft.core.assets import build_tiny_model, synthetic_rows
from llmft.core.config import ConfigError, validate
from llmft.core.platform import Platform
from llmft.core.settings import Config, TinyModel
from llmft.core.shape import model_shape
from llmft.data.prepare import prepare
from llmft.sft import packing
from llmft.sft.packing import STAMP_FILE, pack, packed_dir_name, packing_args
from llmft.sft.render import check_packed_yaml, packs_from_pack_data, render, tiny_shape

from tests.conftest import REPO

DEMO = yaml.safe_load((REPO / "config/config.yaml").read_text())


def cfg_with(**sft):
    return validate({**DEMO, "sft": {**DEMO["sft"], **sft}}, base_dir=REPO)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    build_tiny_model(d, 32, 1, 2, 512)
    return d


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("prep")
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows(300, seed=3)))
    prepare([{"path": str(tmp / "rows.jsonl")}], tmp / "data", model, "default", 64, 0.2, "s", "fail")
    return tmp / "data"


def test_packing_args_normalise_as_llamafactory_reads_them():
    assert packing_args({"template": "default", "packing": False}) is None
    assert packing_args({"neat_packing": True, "template": "t", "cutoff_len": 8}) == {
        "template": "t",
        "cutoff_len": 8,
        "packing": True,
        "neat_packing": True,
        "preprocessing_num_workers": None,
        "preprocessing_batch_size": 1000,
    }


@pytest.mark.parametrize(
    "sft,path,mode",
    [
        ({}, "d/tokenized", None),  # the CPU default: no packing
        ({"packing": "neat"}, "d/packed-", "neat"),
        ({"packing": "plain"}, "d/packed-", "plain"),
        ({"extra": {"packing": True}}, "d/packed-", "plain"),
        ({"extra": {"neat_packing": True}}, "d/packed-", "neat"),
        # the tokenized rows are not what LLaMA-Factory would pack: it tokenizes and packs itself
        ({"packing": "neat", "extra": {"train_on_prompt": True}}, None, None),
    ],
)
def test_a_run_that_packs_loads_the_packed_rows(tmp_path, model, sft, path, mode):
    cfg = cfg_with(**sft)
    here = Platform.declared(Config.from_dict(cfg))
    args = render(
        Config.from_dict(cfg), str(model), "d", str(tmp_path / "a.yaml"), str(tmp_path / "a.json"), "w", here
    )
    planned = packs_from_pack_data(args, "d")
    if mode:  # the folder is named by the packing arguments
        path += packed_dir_name(planned)[len("packed-") :]
    assert args.get("tokenized_path") == path
    assert planned == (packing_args(args) if mode else None)
    if mode:
        assert planned["neat_packing"] == (mode == "neat") and planned["cutoff_len"] == 64
    # builtin:tiny planned from model.tiny (before it is built) packs the same way
    tiny = render(
        Config.from_dict(cfg),
        "builtin:tiny",
        "d",
        str(tmp_path / "t.yaml"),
        str(tmp_path / "t.json"),
        "w",
        here,
        tiny_shape(Config.from_dict(cfg).model.tiny),
    )
    assert packs_from_pack_data(tiny, "d") == planned


def test_tiny_shape_is_the_built_models(tmp_path):
    tiny = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "vocab_size": 512}
    build_tiny_model(tmp_path / "m", **tiny)
    built, planned = model_shape(tmp_path / "m"), tiny_shape(TinyModel(**tiny))
    for field in ("model_type", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "tied"):
        assert getattr(built, field) == getattr(planned, field)
    assert abs(built.params - planned.params) / built.params < 0.1  # the tokenizer adds a few tokens


def test_pack_is_atomic_stamped_and_refuses_stale_rows(tmp_path, monkeypatch, model, prepared, caplog):
    from datasets.arrow_writer import OptimizedTypedSequence

    monkeypatch.setattr(OptimizedTypedSequence, "__init__", OptimizedTypedSequence.__init__)
    cfg = cfg_with(packing="neat")
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.jsonl", "heldout.jsonl", "tokenized"):
        (data / name).symlink_to(prepared / name)
    here = Platform.declared(Config.from_dict(cfg))
    yaml_a = str(tmp_path / "a.yaml")
    args = render(Config.from_dict(cfg), str(model), str(data), yaml_a, str(tmp_path / "a.json"), "w", here)
    check_packed_yaml(yaml_a)  # sft's check before training
    assert "is not packed yet" in caplog.text
    want, out = packing_args(args), Path(args["tokenized_path"])
    assert out.parent == data

    # killed half-way: neither the packed folder nor a temporary one is left to be trusted
    def dies(tokenized_dir, rows_dir, out_dir, tokenizer_dir, args):
        (out_dir / "train").mkdir()
        (out_dir / "train" / "half.arrow").write_text("half")
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(packing, "_pack", dies)
        with pytest.raises(KeyboardInterrupt):
            pack(data / "tokenized", data, out, model, want)
    assert sorted(p.name for p in data.iterdir()) == ["heldout.jsonl", "tokenized", "train.jsonl"]

    # the CLI, as the pack_data rule calls it; --prune removes what an earlier config packed
    stale = data / "packed-000000000000"
    stale.mkdir()
    (stale / STAMP_FILE).write_text("{}")
    rc = main(
        ["pack-data", "--args-json", json.dumps(want), "--tokenizer", str(model)]
        + ["--data-dir", str(data), "--out", str(out), "--prune"]
    )
    assert rc == 0 and not stale.exists()
    stamp = json.loads((out / STAMP_FILE).read_text())
    packed = load_from_disk(str(out))
    rows = {"train": len(packed["train"]), "validation": len(packed["validation"])}
    source = {s: json.loads((data / f"tokenized/{s}/state.json").read_text())["_fingerprint"] for s in rows}
    assert stamp == {"args": want, "rows": rows, "source": source}
    assert len(packed["train"]) < len(load_from_disk(str(data / "tokenized"))["train"])
    # the pack_data rule: from the rendered YAML, reusing rows packed for the same arguments
    pack_rule = ["pack-data", "--yaml", yaml_a, "--tokenizer", str(model), "--data-dir", str(data)]
    assert main([*pack_rule, "--stamp-out", str(tmp_path / "packed.json")]) == 0
    record = json.loads((tmp_path / "packed.json").read_text())
    assert record["packed"] and record["reused"] and record["path"] == str(out)
    # sft accepts rows packed for its arguments and its rows ...
    check_packed_yaml(yaml_a)
    # ... and refuses rows packed for other arguments or from other rows
    (out / STAMP_FILE).write_text(json.dumps({**stamp, "args": {**want, "cutoff_len": 32}}))
    with pytest.raises(ConfigError, match="was packed for"):
        check_packed_yaml(yaml_a)
    (out / STAMP_FILE).write_text(json.dumps({**stamp, "source": {**source, "train": "0" * 16}}))
    with pytest.raises(ConfigError, match="earlier prepare_data run"):
        check_packed_yaml(yaml_a)
    # pack_data repacks stale rows (here: packed from other rows) instead of reusing them
    assert main([*pack_rule, "--stamp-out", str(tmp_path / "packed2.json")]) == 0
    assert not json.loads((tmp_path / "packed2.json").read_text())["reused"]
    check_packed_yaml(yaml_a)
    assert main(["pack-data", "--tokenizer", "m", "--data-dir", "d", "--out", "o"]) == 2
    # a YAML that does not pack: pack_data packs nothing and says so
    unpacked = {**args, "neat_packing": False, "tokenized_path": str(data / "tokenized")}
    record = packing.ensure_packed(unpacked, data, model, tmp_path / "none.json")
    assert record == {"packed": False, "why": "the rendered YAML does not load packed rows"}
