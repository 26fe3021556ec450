"""Our batched tokenization is LLaMA-Factory's own, row for row: against its template, its SFT
processor, its whole preprocessing (load, align, tokenize), and its `tokenized_path` loader."""

from dataclasses import fields

import pytest
import yaml
from datasets import load_from_disk
from llmft.core.assets import build_tiny_model, synthetic_rows
from llmft.core.config import validate
from llmft.core.lf.pretokenize import PREPROCESSING_DEFAULTS, SFTEncoder, blockers, messages_of
from llmft.core.platform import Platform
from llmft.core.settings import Config
from llmft.data.prepare import prepare
from llmft.sft.render import render

from tests.conftest import REPO
from tests.lfref import aligned_from_canonical, lf_sft, llamafactory_preprocess, rows_of

ROWS = synthetic_rows(120, seed=4) + [
    {"instruction": "Say </s> and <s> literally", "input": "", "output": "ok </s>"},
    {"instruction": "Café naïve 日本", "input": "déjà vu", "output": "ünïcödé"},
    {"instruction": "Indent", "input": "", "output": "def f():\n    return 1"},
    {"instruction": "q2", "input": "", "output": "a2", "system": "Be brief.", "history": [["q1", "a1"]]},
    {"instruction": "q3", "input": "x", "output": "a3", "history": [["u1", "v1"], ["u2", "v2"]]},
    # Texts that the per-shape plan must not take (formatter placeholders, its marker character).
    {"instruction": "Write {{content}} and {{idx}} literally", "input": "", "output": "{{content}}"},
    {"instruction": "nul \x00 inside", "input": "", "output": "ok\x001\x00"},
]
# What the data stage accepts: the encoder above must not take a NUL for its marker character, but
# the stage refuses a NUL in a text (tests/unit/core/test_sources.py), so prepared data has none.
VALID_ROWS = [r for r in ROWS if "\x00" not in r["instruction"] + r["output"]]
# default/alpaca/chatml: plain; qwen: replaced EOS + default system; falcon: efficient EOS;
# qwen3: a reasoning template (adds empty thought tokens).
TEMPLATES = ["default", "alpaca", "chatml", "qwen", "falcon", "qwen3"]


@pytest.fixture(scope="module")
def metaspace_dir(tmp_path_factory):
    """A SentencePiece-style tokenizer: the ASCII shortcut declines it, the Rust tokenizer runs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator([f"{r['instruction']} {r['output']}" for r in ROWS] * 5, trainer=trainer)
    d = tmp_path_factory.mktemp("metaspace")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(d)
    return d


@pytest.mark.parametrize("template", TEMPLATES)
def test_equals_template_encode_oneturn(tokenizer_dir, template):
    enc = SFTEncoder(tokenizer_dir, template)
    single = [r for r in ROWS if not r.get("history")]
    first = enc.encode(single)  # a process's first chunk checks the ASCII shortcut first
    out = enc.encode(single)
    assert (first.ids == out.ids).all() and (first.labels == out.labels).all()
    for i, row in enumerate(single):
        prompt, answer = enc.template.encode_oneturn(enc.tokenizer, messages_of(row), row.get("system"))
        ids, labels = rows_of(out, i)
        eos = [enc.tokenizer.eos_token_id] if enc.template.efficient_eos else []
        assert ids == prompt + answer + eos, row
        assert labels == [-100] * len(prompt) + answer + eos


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_equals_llamafactory_sft_processor_multiturn(tokenizer_dir, metaspace_dir, template, kind):
    enc = SFTEncoder(tokenizer_dir if kind == "bytelevel" else metaspace_dir, template)
    assert (enc._fast is not None) == (kind == "bytelevel")  # both tokenizer paths are exercised
    assert enc._plain == (template != "qwen3")  # and both template paths
    theirs = lf_sft(enc.template, enc.tokenizer, aligned_from_canonical(ROWS), template)
    enc.encode(ROWS)
    ours = enc.encode(ROWS)  # the second chunk: the one-pass path where it applies
    one_pass = enc._plain and enc._fast is not None
    direct = [one_pass and enc._direct(row) is not None for row in ROWS]
    assert all(direct[:50]) == (kind == "bytelevel" and template != "qwen3") and not all(direct)
    for i in range(len(ROWS)):
        assert rows_of(ours, i) == (theirs["input_ids"][i], theirs["labels"][i]), ROWS[i]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer_dir):
    """Alpaca JSONL + sharegpt JSON with system prompts and multi-turn rows, prepared by us."""
    import json

    tmp = tmp_path_factory.mktemp("prep")
    (tmp / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in VALID_ROWS))
    conversations = [
        {
            "conversations": [
                {"from": "system", "value": f"System {i % 3}."},
                {"from": "human", "value": f"first question {i}"},
                {"from": "gpt", "value": f"first answer {i}"},
                {"from": "human", "value": f"second question {i} owl cat"},
                {"from": "gpt", "value": f"second answer {i}"},
            ]
        }
        for i in range(40)
    ]
    (tmp / "s.json").write_text(json.dumps(conversations))
    sources = [
        {"path": str(tmp / "a.jsonl"), "weight": 2.0},
        {"path": str(tmp / "s.json"), "format": "sharegpt"},
    ]
    stats = prepare(sources, tmp / "out", tokenizer_dir, "default", 96, 0.3, "s", "fail")
    return tmp, stats


def test_saved_dataset_equals_llamafactory_preprocessing(tmp_path, prepared, tokenizer_dir):
    tmp, stats = prepared
    # the 40 two-turn conversations are 98-112 tokens: dropped whole, not cut to 96
    sharegpt = stats["sources"][1]
    assert stats["too_long"] == sharegpt["too_long"] == 40 and sharegpt["kept"] == 0
    theirs = llamafactory_preprocess(tmp_path, tmp / "out", tokenizer_dir, 96)
    ours = load_from_disk(str(tmp / "out" / "tokenized"))
    for split, lf in (("train", theirs["train_dataset"]), ("validation", theirs["eval_dataset"])):
        assert ours[split].features == lf.features
        assert len(ours[split]) == len(lf) > 10
        assert ours[split][:] == lf[:]  # every column of every row
        assert max(len(ids) for ids in ours[split]["input_ids"]) <= 96
    assert len(ours["train"]) == stats["train_rows"]


def test_llamafactory_loads_it_through_tokenized_path(tmp_path, prepared, tokenizer_dir):
    tmp, stats = prepared
    path = tmp / "out" / "tokenized"
    module = llamafactory_preprocess(tmp_path, tmp / "nowhere", tokenizer_dir, 96, tokenized_path=str(path))
    assert len(module["train_dataset"]) == stats["train_rows"]
    assert len(module["eval_dataset"]) == stats["heldout_rows"]
    assert not (tmp / "nowhere").exists()  # it loaded ours, it did not look for raw data


def test_preprocessing_defaults_match_llamafactory():
    from llamafactory.hparams import DataArguments, ModelArguments
    from transformers import Seq2SeqTrainingArguments

    theirs = {f.name: f.default for cls in (DataArguments, ModelArguments) for f in fields(cls)}
    theirs["predict_with_generate"] = next(
        f.default for f in fields(Seq2SeqTrainingArguments) if f.name == "predict_with_generate"
    )
    assert {k: theirs[k] for k in PREPROCESSING_DEFAULTS} == PREPROCESSING_DEFAULTS


def test_blockers():
    assert blockers({"packing": False, "learning_rate": 1e-5, "train_on_prompt": False}) == []
    assert blockers({"packing": True, "neat_packing": False, "mask_history": True}) == [
        "mask_history",
        "packing",
    ]


DEMO = validate(yaml.safe_load((REPO / "config/config.yaml").read_text()), base_dir=REPO)


def test_rendered_yaml_points_sft_at_the_tokenized_data_unless_blocked(tmp_path):
    model = tmp_path / "model"
    build_tiny_model(model, 32, 1, 2, 512)
    args = render(
        Config.from_dict(DEMO),
        str(model),
        "d",
        str(tmp_path / "a.yaml"),
        str(tmp_path / "a.json"),
        "w",
        Platform.declared(Config.from_dict(DEMO)),
    )
    assert args["tokenized_path"] == "d/tokenized"
    cfg = validate({**DEMO, "sft": {**DEMO["sft"], "extra": {"train_on_prompt": True}}}, base_dir=REPO)
    args = render(
        Config.from_dict(cfg),
        str(model),
        "d",
        str(tmp_path / "b.yaml"),
        str(tmp_path / "b.json"),
        "w",
        Platform.declared(Config.from_dict(cfg)),
    )
    assert "tokenized_path" not in args


@pytest.fixture(scope="module")
def prepared_at_a_row_length(tmp_path_factory, tokenizer_dir):
    """Prepared with cutoff_len equal to the length of some rows: packing keeps one token spare, so
    LLaMA-Factory truncates exactly those rows when it packs."""
    import json

    words = " ".join(f"{w} {w}" for w in "cat dog owl fox cow pig hen ant bee elk".split())
    rows = (
        synthetic_rows(400, seed=9)
        + VALID_ROWS
        + [{"instruction": "Repeat the words.", "input": words, "output": words}]
    )
    lengths = SFTEncoder(tokenizer_dir, "default").encode(rows).lengths.tolist()
    cutoff = max(lengths)  # the longest rows sit exactly at the cutoff; most rows are much shorter
    assert sorted(lengths)[len(lengths) // 2] * 3 < cutoff
    tmp = tmp_path_factory.mktemp("packprep")
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare(
        [{"path": str(tmp / "rows.jsonl")}], tmp / "out", tokenizer_dir, "default", cutoff, 0.2, "s", "fail"
    )
    return tmp / "out", cutoff


@pytest.mark.parametrize("neat", [False, True])
@pytest.mark.parametrize("workers", [1, 3])
def test_packing_equals_llamafactory_packing(
    tmp_path, monkeypatch, prepared_at_a_row_length, tokenizer_dir, neat, workers
):
    from datasets.arrow_writer import OptimizedTypedSequence
    from llmft.sft.packing import pack

    # LLaMA-Factory's neat packing patches `datasets` for the whole process: undo it afterwards.
    monkeypatch.setattr(OptimizedTypedSequence, "__init__", OptimizedTypedSequence.__init__)
    out, cutoff = prepared_at_a_row_length
    args = {
        "template": "default",
        "cutoff_len": cutoff,
        "preprocessing_num_workers": workers,
        "preprocessing_batch_size": 37,  # several batches per shard
        ("neat_packing" if neat else "packing"): True,
    }
    counts = pack(out / "tokenized", out, tmp_path / "packed", tokenizer_dir, args)
    theirs = llamafactory_preprocess(
        tmp_path, out, tokenizer_dir, **{k: v for k, v in args.items() if k != "template"}
    )
    ours = load_from_disk(str(tmp_path / "packed"))
    for split, lf in (("train", theirs["train_dataset"]), ("validation", theirs["eval_dataset"])):
        assert ours[split].features == lf.features
        assert len(ours[split]) == len(lf) == counts[split]
        assert ours[split][:] == lf[:]
    assert len(ours["train"]) < len(load_from_disk(str(out / "tokenized"))["train"]) / 2  # really packed
