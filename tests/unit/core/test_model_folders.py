"""A bring-your-own model folder is checked when the config is: corrupt or pickled weights, no
tokenizer, a config.json that is not a decoder's settings are refused by name before any job, and
other families' config names (GPT-2, GPT-J, Falcon) plan. Real files, real Snakemake, no mocks."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
from llmft.core.assets import build_tokenizer
from llmft.core.config import ConfigError, validate
from llmft.core.shape import model_shape
from safetensors.numpy import save_file

from tests.conftest import make_workdir, snakemake

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A whole folder: a tokenizer, a Llama config.json and one real safetensors shard."""
    d = tmp_path_factory.mktemp("good") / "model"
    build_tokenizer(d, 512)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, **SHAPE}
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({"model.embed_tokens.weight": np.zeros((512, 64), np.float32)}, str(d / "model.safetensors"))
    return d


def variant(good, tmp_path, change):
    d = tmp_path / "model"
    shutil.copytree(good, d)
    change(d)
    return d


def rewrite_header(path, fn):
    """The shard with fn applied to its header bytes (length kept as given)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(fn(raw[:8], raw[8 : 8 + n], raw[8 + n :]))


def shift_offsets(d):
    def fn(length, header, data):
        h = json.loads(header)
        h["model.embed_tokens.weight"]["data_offsets"][1] -= 4
        text = json.dumps(h, separators=(",", ":")).encode().ljust(len(header))
        return length + text + data

    rewrite_header(d / "model.safetensors", fn)


def sharded_pickle(d):
    (d / "model.safetensors").unlink()
    for i in (1, 2):
        (d / f"pytorch_model-0000{i}-of-00002.bin").write_bytes(b"\x80\x04K\x01.")
    weight_map = {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


def tokenizer_gone(d):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink(missing_ok=True)


CASES = [
    ("empty shard", lambda d: (d / "model.safetensors").write_bytes(b""), "shorter than the 8-byte"),
    (
        "header length past the file",
        lambda d: rewrite_header(d / "model.safetensors", lambda n, h, x: struct.pack("<Q", 10**7) + h + x),
        "header length 10000000 runs past",
    ),
    (
        "header not JSON",
        lambda d: rewrite_header(d / "model.safetensors", lambda n, h, x: n + b"{" * len(h) + x),
        "its header is not JSON",
    ),
    (
        "truncated data",
        lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-100]),
        "(truncated)",
    ),
    ("offsets against the shape", shift_offsets, "not the 131072 its dtype and shape need"),
    (
        "index names a missing shard",
        lambda d: (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors"}})
        ),
        "names shards that are not in the folder: model-00002-of-00002.safetensors",
    ),
    (
        "pickle weights",
        lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
        "holds its weights as pickle (pytorch_model.bin)",
    ),
    ("sharded pickle weights", sharded_pickle, "as pickle (pytorch_model-00001-of-00002.bin"),
    ("no tokenizer", tokenizer_gone, "has no tokenizer (none of tokenizer.json"),
    ("config.json a list", lambda d: (d / "config.json").write_text("[1, 2]"), "holds a JSON list"),
]


def config_for(d):
    return {"model": {"name_or_path": str(d), "template": "default"}}


def test_the_whole_folder_passes(good):
    validate(config_for(good))


@pytest.mark.parametrize("name,change,needle", CASES, ids=[c[0] for c in CASES])
@pytest.mark.reliability(
    fault=(
        "a model folder with a corrupt safetensors shard (empty, header length past the file, header not "
        "JSON, truncated, offsets against the shape), an index naming a missing shard, pickle weights "
        "(single or sharded), no tokenizer, a config.json that is a list"
    ),
    seen="refused when the config is checked, naming the file and what is wrong with it",
    steps_lost="none",
    data_lost="none",
)
def test_a_broken_model_folder_is_refused_by_name(good, tmp_path, name, change, needle):
    d = variant(good, tmp_path, change)
    with pytest.raises(ConfigError) as err:
        validate(config_for(d))
    msg = str(err.value)
    assert msg.startswith("config key model.name_or_path: ") and str(d) in msg and needle in msg, msg


@pytest.mark.parametrize(
    "name,change,needle",
    [
        CASES[3],
        CASES[-1],
        (
            "a string dimension",
            lambda d: (d / "config.json").write_text(
                json.dumps({"vocab_size": 512, **SHAPE, "hidden_size": "64k"})
            ),
            "has hidden_size: '64k'; it must be a positive integer",
        ),
    ],
    ids=["truncated shard", "config.json a list", "string field"],
)
@pytest.mark.reliability(
    fault="a truncated safetensors shard, a `config.json` that is a list or has a string dimension",
    seen=(
        "`snakemake -n` exits non-zero before any job with `llmft config error:` naming the file, "
        "no traceback"
    ),
    steps_lost="none",
    data_lost="none",
)
def test_snakemake_refuses_a_broken_model_folder_at_dag_time(good, tmp_path, name, change, needle):
    d = variant(good, tmp_path, change)
    work = make_workdir(tmp_path / "work", model__name_or_path=str(d), model__template="default")
    res = snakemake(work, "-n", timeout=240)
    log = res.stdout + res.stderr
    assert res.returncode != 0 and "llmft config error: config key model.name_or_path:" in log, log[-2000:]
    assert str(d / "config.json") in log or str(d) in log
    assert needle in log and "Traceback" not in log, log[-2000:]
    assert not (work / "results").exists()


# Real config.json files of other families (their decoder dimensions, as the hub ships them).
GPTJ = {"model_type": "gptj", "n_embd": 4096, "n_layer": 28, "n_head": 16, "n_inner": None, "rotary_dim": 64,
        "vocab_size": 50400, "tie_word_embeddings": False, "architectures": ["GPTJForCausalLM"]}  # fmt: skip
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
        "vocab_size": 50257, "architectures": ["GPT2LMHeadModel"]}  # fmt: skip
FALCON = {"model_type": "falcon", "hidden_size": 4544, "n_head": 71, "n_layer": 32, "multi_query": True,
          "vocab_size": 65024, "architectures": ["FalconForCausalLM"]}  # fmt: skip


@pytest.mark.parametrize(
    "cfg,want",
    [
        (GPTJ, (4096, 28, 16, 16, 256, 16384, False)),
        (GPT2, (768, 12, 12, 12, 64, 3072, True)),  # GPT-2 ties its head by its class's default
        (FALCON, (4544, 32, 71, 1, 64, 18176, True)),  # multi-query: one K/V head
    ],
    ids=["gptj", "gpt2", "falcon"],
)
def test_other_families_config_names_give_the_decoder_shape(tmp_path, cfg, want):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = model_shape(tmp_path)
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.tied) == want


def test_a_config_without_a_decoder_shape_is_still_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nonesuch", "vocab_size": 9}))
    with pytest.raises(ConfigError, match="lacks 'hidden_size', 'num_hidden_layers', 'num_attention_heads'"):
        model_shape(tmp_path)


def test_snakemake_plans_a_gptj_config(good, tmp_path):
    """GPT-J's own key names, at the tiny folder's size: the planner reads them and the DAG builds."""
    small = {**GPTJ, "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512}
    d = variant(good, tmp_path, lambda d: (d / "config.json").write_text(json.dumps(small)))
    work = make_workdir(tmp_path / "work", model__name_or_path=str(d), model__template="default")
    res = snakemake(work, "-n", timeout=240)
    assert res.returncode == 0, (res.stdout + res.stderr)[-2000:]


def test_snakemake_gives_a_base_model_the_default_template_and_says_why(good, tmp_path):
    """A Llama-type folder without a chat template (SmolLM-135M's case) is a base model."""
    work = make_workdir(tmp_path / "work", model__name_or_path=str(good), model__template="auto")
    res = snakemake(work, "-n", timeout=240)
    assert res.returncode == 0, (res.stdout + res.stderr)[-2000:]
    assert "model.template auto -> default (no chat template (a base model)" in res.stderr
