"""`model.template: auto` picks LLaMA-Factory's template from the model folder, a template that does
not fit the tokenizer stops the run, multimodal templates tokenize text rows with the model's
processor exactly as LLaMA-Factory does, and a tokenizer that transformers loads differently from
its tokenizer.json is refused. Real LLaMA-Factory, real tokenizer files, no mocks."""

from __future__ import annotations

import json
import shutil

import pytest
from llmft.core.assets import build_tokenizer, synthetic_rows
from llmft.core.config import ConfigError
from llmft.core.lf import chat_templates as ct
from llmft.core.lf.pretokenize import SFTEncoder, messages_of
from llmft.core.sources import DataError
from llmft.data import tokcheck

from tests import published_formats as published
from tests.conftest import REPO, make_workdir, snakemake
from tests.lfref import aligned_from_canonical, lf_sft

REAL = REPO / ".cache" / "tokenizers"  # tests/setup-tokenizers.sh fetches them
CHATML = (  # the chat template Qwen2.5 ships (tool branch left out)
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
ROWS = synthetic_rows(40, seed=3) + [
    {"instruction": "q2", "input": "", "output": "a2", "system": "Be brief.", "history": [["q1", "a1"]]},
    {"instruction": "Café 日本", "input": "déjà", "output": "ünï"},
]


def model_folder(path, extra_tokens=(), vocab_size=None, model_type="llama", chat_template=None, **config):
    """The repo's tiny byte-level tokenizer plus special tokens and a config.json."""
    from transformers import AutoTokenizer

    build_tokenizer(path, 512)
    tok = AutoTokenizer.from_pretrained(path)
    if extra_tokens:
        tok.add_special_tokens({"additional_special_tokens": list(extra_tokens)})
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(path)
    cfg = {
        "model_type": model_type,
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab_size or len(tok),
    }
    (path / "config.json").write_text(json.dumps({**cfg, **config}))
    return path


def test_table_equals_what_the_installed_llamafactory_produces():
    assert ct.build_table() == json.loads(ct.TABLE.read_text(encoding="utf-8")), (
        "lf_templates.json is stale: python -m llmft.core.lf.chat_templates --write (from workflow/)"
    )


def test_builtin_model_gets_default():
    assert ct.resolved("auto", None)[0] == "default"
    assert ct.resolved("llama3", None) == ("llama3", "model.template")


def test_auto_picks_by_the_chat_template(tmp_path):
    d = model_folder(tmp_path / "m", ["<|im_start|>", "<|im_end|>"], chat_template=CHATML, model_type="qwen2")
    name, why = ct.resolve(d)
    assert (name, why.split(";")[0]) == ("qwen", "chat template matches qwen exactly")
    # The same format without a default system prompt is chatml (and its kin), not qwen.
    plain = CHATML.replace("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", "")
    plain = plain.replace("{%- else %}{{- '<|im_start|>system\\n<|im_end|>\\n' }}", "")
    d2 = model_folder(tmp_path / "m2", ["<|im_start|>", "<|im_end|>"], chat_template=plain, model_type="x")
    name2, why2 = ct.resolve(d2)
    assert (
        name2 != "qwen"
        and "exactly" in why2
        and ct.table()["templates"][name2]["stop_words"][0] == "<|im_end|>"
    )


# A chat template that renders like no LLaMA-Factory template.
ODD = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}"


def test_auto_falls_back_on_model_type_and_the_tokenizer_decides_between_candidates(tmp_path):
    llama2 = model_folder(tmp_path / "l2", chat_template=ODD)  # no <|eot_id|>: llama3 would add it
    lead = "chat template matches no LLaMA-Factory template; "
    assert ct.resolve(llama2) == ("llama2", lead + "model_type llama → llama2")
    llama3 = model_folder(
        tmp_path / "l3",
        ["<|eot_id|>", "<|eom_id|>", "<|start_header_id|>", "<|end_header_id|>"],
        chat_template=ODD,
    )
    assert ct.resolve(llama3) == ("llama3", lead + "model_type llama → llama3")
    unknown = model_folder(tmp_path / "u", model_type="nonesuch", chat_template=ODD)
    name, why = ct.resolve(unknown)
    assert name == "default" and "model_type nonesuch" in why


def test_auto_gives_a_base_model_without_a_chat_template_default(tmp_path):
    """SmolLM-135M: a Llama without a chat template is a base model, not a Llama-2 chat model."""
    base = model_folder(tmp_path / "base")
    assert ct.resolve(base) == (
        "default",
        "no chat template (a base model): default, LLaMA-Factory's template for base models "
        "(set model.template to choose)",
    )


def test_a_template_whose_tokens_are_not_in_the_vocabulary_is_refused(tmp_path):
    """Mistral-like: no <|im_start|>/<|im_end|>; qwen would make <|im_end|> id len(vocab)."""
    d = model_folder(tmp_path / "mistralish")
    with pytest.raises(ConfigError) as err:
        ct.check("qwen", d)
    msg = str(err.value)
    assert "template 'qwen'" in msg and str(d) in msg and "'<|im_end|>'" in msg
    assert "new id 512" in msg and "past the model's 512 embeddings" in msg
    assert "set model.template: default" in msg  # what auto picks there, and fits
    ct.check("default", d)  # fits


def test_an_id_past_the_embedding_table_is_refused(tmp_path):
    d = model_folder(tmp_path / "small", ["<|im_start|>", "<|im_end|>"], vocab_size=512)  # ids 512, 513
    with pytest.raises(
        ConfigError, match=r"'<\|im_end\|>' \(the EOS token it sets\) has id 513, past the model's 512"
    ):
        ct.check("qwen", d)


def test_a_multimodal_template_on_a_text_only_folder_is_refused_naming_the_text_template(tmp_path):
    d = model_folder(tmp_path / "text", ["<start_of_turn>", "<end_of_turn>"], model_type="gemma3_text")
    with pytest.raises(ConfigError) as err:
        ct.check("gemma3", d)
    msg = str(err.value)
    assert "'gemma3' is multimodal" in msg and str(d) in msg and "preprocessor_config.json" in msg
    assert "model.template: gemma2" in msg
    # auto never picks a multimodal template there
    assert not ct.is_multimodal(ct.resolve(d)[0])
    # and prepare_data's encoder stops before tokenizing, with the same message (not LF's
    # "Processor was not found")
    with pytest.raises(ConfigError, match="needs the model's processor"):
        SFTEncoder(d, "gemma3")


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory):
    """A multimodal folder built offline: Gemma-3's special tokens on the tiny tokenizer, and a
    Gemma3Processor (default image processor) saved beside it."""
    from transformers import AutoTokenizer, Gemma3ImageProcessor, Gemma3Processor

    d = tmp_path_factory.mktemp("gemma3mm")
    build_tokenizer(d, 512)
    tok = AutoTokenizer.from_pretrained(d)
    extra = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    tok.add_special_tokens({"additional_special_tokens": extra})
    tok.save_pretrained(d)
    tok = AutoTokenizer.from_pretrained(
        d,
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    Gemma3Processor(image_processor=Gemma3ImageProcessor(), tokenizer=tok).save_pretrained(d)
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"model_type": "gemma3_text", "vocab_size": len(tok)},
    }
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_multimodal_template_with_a_processor_tokenizes_text_rows_as_llamafactory(gemma3_folder):
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments, ModelArguments
    from llamafactory.model import load_tokenizer

    ct.check("gemma3", gemma3_folder)  # fits: processor present
    assert ct.resolve(gemma3_folder)[0] == "gemma3"  # model_type gemma3 with a processor
    enc = SFTEncoder(gemma3_folder, "gemma3")
    assert type(enc.processor).__name__ == "Gemma3Processor"
    module = load_tokenizer(ModelArguments(model_name_or_path=str(gemma3_folder)))
    assert module["processor"] is not None
    template = get_template_and_fix_tokenizer(module["tokenizer"], DataArguments(template="gemma3"))
    theirs = lf_sft(
        template, module["tokenizer"], aligned_from_canonical(ROWS), "gemma3", module["processor"]
    )
    ours = enc.encode(ROWS)
    for i in range(len(ROWS)):
        a, b = ours.offsets[i], ours.offsets[i + 1]
        assert (ours.ids[a:b].tolist(), ours.labels[a:b].tolist()) == (
            theirs["input_ids"][i],
            theirs["labels"][i],
        ), ROWS[i]


def test_evaluate_encodes_multimodal_templates_with_the_processor(gemma3_folder):
    """The (prompt, answer) ids evaluate generates and scores from equal LLaMA-Factory's own SFT
    processor's rows for the same conversations (its labels mark where the answer starts), not a
    second call of our encoder."""
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.extras.constants import IGNORE_INDEX
    from llamafactory.hparams import DataArguments, ModelArguments
    from llamafactory.model import load_tokenizer
    from llmft.evaluate import run as ev

    rows = [r for r in ROWS if not r.get("history")][:5]
    tokenizer, encoded = ev.encode(rows, str(gemma3_folder), "auto")  # resolves to gemma3 there
    module = load_tokenizer(ModelArguments(model_name_or_path=str(gemma3_folder)))
    template = get_template_and_fix_tokenizer(module["tokenizer"], DataArguments(template="gemma3"))
    theirs = lf_sft(
        template, module["tokenizer"], aligned_from_canonical(rows), "gemma3", module["processor"]
    )
    for i, (prompt, answer) in enumerate(encoded):
        ids, labels = theirs["input_ids"][i], theirs["labels"][i]
        start = next(k for k, label in enumerate(labels) if label != IGNORE_INDEX)
        assert (prompt, answer) == (ids[:start], ids[start:]) and answer, rows[i]


def test_tokenizer_loaded_differently_from_its_tokenizer_json_is_refused(tmp_path):
    """A byte-level BPE tokenizer.json whose tokenizer_config.json names LlamaTokenizerFast (as
    DeepSeek-V3's does): transformers 5 rebuilds it SentencePiece-style."""
    from transformers import AutoTokenizer

    good = tmp_path / "good"
    build_tokenizer(good, 512)
    assert tokcheck.check(AutoTokenizer.from_pretrained(good), good)["matches"]
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    cfg = json.loads((bad / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "LlamaTokenizerFast"
    (bad / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(DataError) as err:
        tokcheck.check(AutoTokenizer.from_pretrained(bad), bad)
    msg = str(err.value)
    assert str(bad) in msg and "English probe" in msg and "transformers 5." in msg and "tokenizers 0." in msg
    # data.tokenizer_check: warn records the difference and goes on.
    warned = tokcheck.check(AutoTokenizer.from_pretrained(bad), bad, fail=False)
    assert warned["matches"] is False and warned["probe"] == "English" and str(bad) in warned["message"]


FIXED_PADDING = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                 "pad_type_id": 0, "pad_token": "<pad>"}  # fmt: skip


def smollm_like(path):
    """SmolLM-135M's tokenizer layout: byte-level BPE behind a digit split (Digits, then ByteLevel),
    trained where numbered lists follow blank lines, fixed padding in tokenizer.json, and
    tokenizer_config.json naming GPT2Tokenizer, which transformers 5 rebuilds without the split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = ["Steps.\n\n1. Mix the flour.\n\n2. Bake it.\n\nThe end 1 2 3 4 5 6 7 8 9 0"] * 50
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<|endoftext|>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>"
    ).save_pretrained(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    data = json.loads((path / "tokenizer.json").read_text())
    (path / "tokenizer.json").write_text(json.dumps({**data, "padding": FIXED_PADDING}))
    return path


def test_fixed_padding_in_tokenizer_json_is_not_a_difference(tmp_path):
    """tokenizer.json's padding/truncation settings are not the tokenizer: compared without them."""
    from transformers import AutoTokenizer

    d = tmp_path / "padded"
    build_tokenizer(d, 512)
    data = json.loads((d / "tokenizer.json").read_text())
    (d / "tokenizer.json").write_text(json.dumps({**data, "padding": FIXED_PADDING}))
    result = tokcheck.check(AutoTokenizer.from_pretrained(d), d)
    assert result["matches"] and result["probes"] == len(tokcheck.PROBES)


@pytest.mark.reliability(
    fault=(
        "a tokenizer that transformers rebuilds without its tokenizer.json's digit split (SmolLM-135M's "
        "layout: `'\\n\\n1'` becomes `Ċ Ċ 1`, not `ĊĊ 1`), with fixed padding in its tokenizer.json"
    ),
    seen=(
        "prepare_data stops before tokenizing, naming the folder, the digits after newlines probe and "
        "the first differing tokens; the padding is not reported as a difference"
    ),
    steps_lost="none",
    data_lost="none",
)
def test_prepare_data_refuses_a_tokenizer_rebuilt_without_its_digit_split(tmp_path, capsys):
    from llmft.__main__ import main

    d = smollm_like(tmp_path / "smol")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = {"run": "t", "data": {"sources": [{"path": str(data)}], "cutoff_len": 512, "heldout_fraction": 0.2},
           "model": {"template": "default"}}  # fmt: skip
    out = tmp_path / "out"
    argv = ["prepare-data", "--config-json", json.dumps(cfg), "--tokenizer", str(d), "--out-dir", str(out)]
    rc = main([*argv, "--workers", "1"])
    err = capsys.readouterr().err
    assert rc != 0 and f"the tokenizer in {d} as transformers loads it (GPT2Tokenizer)" in err, err[-2000:]
    assert "digits after newlines probe" in err and "['Ċ', 'Ċ', '1', '.'] instead of ['ĊĊ', '1'" in err
    assert "Traceback" not in err and not (out / "stats.json").exists()


def test_prepare_data_stops_before_tokenizing(tmp_path, capsys):
    """The stage (`python -m llmft prepare-data`, as the rule runs it) checks the fit first: the
    builtin model's folder does not exist when the DAG is built."""
    from llmft.__main__ import main

    d = model_folder(tmp_path / "mistralish")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = {"run": "t", "data": {"sources": [{"path": str(data)}], "cutoff_len": 512, "heldout_fraction": 0.2}}

    def stage(**model):
        out = tmp_path / "out"
        argv = ["prepare-data", "--config-json", json.dumps({**cfg, "model": model}), "--tokenizer", str(d)]
        return main([*argv, "--out-dir", str(out), "--workers", "1"]), out

    rc, out = stage(template="qwen")  # the builtin model's name: the folder is checked here
    err = capsys.readouterr().err
    assert rc == 2 and "llmft: config error: template 'qwen' does not fit the tokenizer in" in err, err
    assert "Traceback" not in err and not (out / "stats.json").exists()
    rc, out = stage(name_or_path=str(d), template="auto")
    assert rc == 0, capsys.readouterr().err
    stats = json.loads((out / "stats.json").read_text())
    assert stats["template"] == "default" and stats["tokenizer_check"]["checked"]


@pytest.mark.reliability(
    fault=(
        "a `model.template` that does not fit the model's tokenizer (`qwen` on a tokenizer without its "
        "chat tokens: LLaMA-Factory would add them past the embedding table)"
    ),
    seen=(
        "refused before any job (`snakemake -n` too), naming the template, the tokenizer folder, the "
        "missing token and a template that fits"
    ),
    steps_lost="none",
    data_lost="none",
)
def test_snakemake_refuses_a_misfit_template_at_dag_time(tmp_path):
    from transformers import LlamaConfig

    d = model_folder(tmp_path / "model")
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    LlamaConfig(vocab_size=512, **shape).to_json_file(d / "config.json")  # what the planner reads
    work = make_workdir(tmp_path / "work", model__name_or_path=str(d), model__template="qwen")
    res = snakemake(work, "-n", timeout=240)
    log = res.stdout + res.stderr
    assert res.returncode != 0
    assert "llmft config error: config key model.template: template 'qwen' does not fit" in log, log[-2000:]
    assert str(d) in log and "set model.template: default" in log
    assert "Traceback" not in log


# -- real tokenizers (tests/setup-tokenizers.sh) ---------------------------------------------

# family -> (config.json model_type, architectures, vocab_size, the template auto must pick)
REAL_CASES = {
    "qwen3": ("qwen3", ["Qwen3ForCausalLM"], 151936, "qwen3"),
    "qwen2_5": ("qwen2", ["Qwen2ForCausalLM"], 152064, "qwen"),
    "llama3": ("llama", ["LlamaForCausalLM"], 128256, "llama3"),
    "llama2": ("llama", ["LlamaForCausalLM"], 32000, "default"),  # no chat template: a base model
    "gemma3": ("gemma3_text", ["Gemma3ForCausalLM"], 262144, "gemma2"),
    "deepseek_v3": ("deepseek_v3", ["DeepseekV3ForCausalLM"], 129280, "deepseek3"),
}


def real_folder(tmp_path, family):
    src = REAL / family
    if not (src / "tokenizer.json").is_file():
        pytest.skip(f"real tokenizer {family} not fetched (run tests/setup-tokenizers.sh)")
    model_type, arch, vocab, _ = REAL_CASES[family]
    d = tmp_path / family
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).symlink_to(src / name)
    (d / "config.json").write_text(
        json.dumps({"model_type": model_type, "architectures": arch, "vocab_size": vocab})
    )
    return d


@pytest.mark.parametrize("family", sorted(REAL_CASES))
def test_auto_on_real_tokenizers(tmp_path, family):
    d = real_folder(tmp_path, family)
    name, why = ct.resolve(d)
    assert name == REAL_CASES[family][3], why
    ct.check(name, d)


def test_qwen_on_a_real_32k_tokenizer_is_refused(tmp_path):
    d = real_folder(tmp_path, "llama2")
    with pytest.raises(
        ConfigError, match=r"'<\|im_end\|>' .* new id 32000, past the model's 32000 embeddings"
    ):
        ct.check("qwen", d)


def test_real_deepseek_v3_tokenizer_loses_spaces_and_is_refused(tmp_path):
    from transformers import AutoTokenizer

    d = real_folder(tmp_path, "deepseek_v3")
    assert tokcheck.check(AutoTokenizer.from_pretrained(d), d)["checked"]  # as the set-up fixes it
    # As DeepSeek ships it: tokenizer_config.json names LlamaTokenizerFast.
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "LlamaTokenizerFast"}))
    with pytest.raises(DataError, match="deepseek_v3.*English probe"):
        tokcheck.check(AutoTokenizer.from_pretrained(d), d)


def test_real_llama2_tokenizer_drops_a_leading_space_and_is_refused(tmp_path):
    from transformers import AutoTokenizer

    d = real_folder(tmp_path, "llama2")
    with pytest.raises(DataError, match="llama2.*spaces and newlines probe"):
        tokcheck.check(AutoTokenizer.from_pretrained(d), d)


def test_auto_is_the_default_and_unknown_names_still_fail():
    from llmft.core.config import validate

    assert validate({})["model"]["template"] == "auto"
    assert validate({"model": {"template": "qwen3"}})["model"]["template"] == "qwen3"
    with pytest.raises(ConfigError, match="no template 'qwen33'"):
        validate({"model": {"template": "qwen33"}})


def test_real_gemma3_with_its_processor_gets_gemma3_and_tokenizes_as_llamafactory(tmp_path):
    """Gemma3ForConditionalGeneration: the real tokenizer with a processor built offline from it
    (default image processor); auto picks the multimodal template, rows equal LLaMA-Factory's."""
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments, ModelArguments
    from llamafactory.model import load_tokenizer
    from transformers import AutoTokenizer, Gemma3ImageProcessor, Gemma3Processor

    text = real_folder(tmp_path, "gemma3")
    d = tmp_path / "gemma3mm"
    d.mkdir()
    tok = AutoTokenizer.from_pretrained(text)
    Gemma3Processor(image_processor=Gemma3ImageProcessor(), tokenizer=tok).save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the files as shipped
        shutil.copy(text / name, d / name)
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"model_type": "gemma3_text", "vocab_size": 262208},
    }
    (d / "config.json").write_text(json.dumps(config))
    name, why = ct.resolve(d)
    assert name == "gemma3" and "exactly" in why, why
    enc = SFTEncoder(d, name)
    module = load_tokenizer(ModelArguments(model_name_or_path=str(d)))
    template = get_template_and_fix_tokenizer(module["tokenizer"], DataArguments(template=name))
    ours = enc.encode(ROWS)
    for i, row in enumerate(ROWS):
        msgs = template.mm_plugin.process_messages(messages_of(row), [], [], [], module["processor"])
        pairs = template.encode_multiturn(module["tokenizer"], msgs, row.get("system") or "")
        ids = [t for src, tgt in pairs for t in src + tgt]
        assert ours.ids[ours.offsets[i] : ours.offsets[i + 1]].tolist() == ids, row


# -- a slow tokenizer's files (vocab.json + merges.txt, no tokenizer.json) ----------------------


@pytest.fixture(scope="module")
def slow_qwen2(tmp_path_factory):
    """Qwen2-1.5B-Instruct's layout: the real Qwen2.5 vocabulary and merges as a slow tokenizer's
    files, its tokenizer_config.json (added tokens, chat template), a qwen2 config.json."""
    src = REAL / "qwen2_5"
    if not (src / "tokenizer.json").is_file():
        pytest.skip("real tokenizer qwen2_5 not fetched (run tests/setup-tokenizers.sh)")
    d = tmp_path_factory.mktemp("slow") / "Qwen2-slow"
    d.mkdir()
    model = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    (d / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False), encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    shutil.copy(src / "tokenizer_config.json", d)
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    cfg = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, **shape}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_a_slow_tokenizer_is_checked_as_transformers_loads_it(slow_qwen2):
    """No tokenizer.json: the template's tokens are looked up in the tokenizer transformers builds
    from vocab.json + merges.txt (llama3 on Qwen2 would add <|eot_id|> as an untrained row)."""
    with pytest.raises(ConfigError) as err:
        ct.check("llama3", slow_qwen2)
    msg = str(err.value)
    assert "template 'llama3' does not fit the tokenizer in" in msg and str(slow_qwen2) in msg
    assert "'<|eot_id|>'" in msg and "new id 151665, an embedding row (151936 in config.json)" in msg
    assert ct.resolve(slow_qwen2)[0] == "qwen"
    ct.check("qwen", slow_qwen2)  # its own template fits


@pytest.mark.reliability(
    fault=(
        "a model folder with a slow tokenizer (vocab.json + merges.txt, no tokenizer.json) and a template "
        "whose tokens it lacks (`llama3` on Qwen2)"
    ),
    seen=(
        "refused before any job (`snakemake -n` too), the tokens looked up in the tokenizer as "
        "transformers loads it, naming the missing token"
    ),
    steps_lost="none",
    data_lost="none",
)
def test_snakemake_refuses_a_misfit_template_on_a_slow_tokenizer(slow_qwen2, tmp_path):
    work = make_workdir(tmp_path / "work", model__name_or_path=str(slow_qwen2), model__template="llama3")
    res = snakemake(work, "-n", timeout=240)
    log = res.stdout + res.stderr
    assert res.returncode != 0, log[-2000:]
    assert "llmft config error: config key model.template: template 'llama3' does not fit" in log, log[-2000:]
    assert "'<|eot_id|>'" in log and "Traceback" not in log


# -- chat templates that would hold the DAG build: a time, memory and output budget --------------

BOMBS = {
    # 10^10 empty iterations: the time budget.
    "silent loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "did not render 4 short probe conversations within 15 s",
    ),
    # 10^10 numbers written: the output cap.
    "loud loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
        "over its render budget: it wrote more than 1000000 characters",
    ),
    # a string doubled 40 times: the memory limit (or, on a loaded machine, the time budget).
    "doubling string": (
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
        "{{ ns.s|length }}",
        "it needed more than 1024 MiB of memory|within 15 s",
    ),
}


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_a_chat_template_bomb_is_refused_within_its_budget_naming_the_file(tmp_path, bomb):
    import re
    import time

    template, needle = BOMBS[bomb]
    d = model_folder(tmp_path / "m")
    (d / "chat_template.jinja").write_text(template)
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        ct.resolve(d)
    assert time.monotonic() - start < 40
    msg = str(err.value)
    assert f"the chat template in {d / 'chat_template.jinja'}" in msg and re.search(needle, msg), msg


@pytest.mark.reliability(
    fault=(
        "a model folder's chat template with nested `range()` loops (10^10 iterations) under "
        "`model.template: auto`"
    ),
    seen=(
        "refused before any job (`snakemake -n` too) after its 15 s render budget, naming the "
        "template's file; templates that write over 1 MB or take over 1 GiB are refused the same way"
    ),
    steps_lost="none",
    data_lost="none",
)
def test_snakemake_refuses_a_chat_template_bomb_in_bounded_time(tmp_path):
    import time

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    d = model_folder(tmp_path / "model", **shape)  # a decoder shape: the planner reads it first
    (d / "chat_template.jinja").write_text(BOMBS["silent loops"][0])
    work = make_workdir(tmp_path / "work", model__name_or_path=str(d), model__template="auto")
    start = time.monotonic()
    res = snakemake(work, "-n", timeout=240)
    log = res.stdout + res.stderr
    assert res.returncode != 0 and time.monotonic() - start < 120, log[-2000:]
    assert (
        f"llmft config error: config key model.template: the chat template in {d / 'chat_template.jinja'}"
        in log
    )
    assert "within 15 s" in log and "Traceback" not in log


# -- a named template against the folder's own chat template ------------------------------------

MISTRAL_V03 = (  # the chat template Mistral-7B-Instruct-v0.3 ships
    '{%- if messages[0]["role"] == "system" %}\n'
    '    {%- set system_message = messages[0]["content"] %}\n'
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, "
    "conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.last and system_message is defined %}\n"
    "            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- '[INST] ' + message['content'] + '[/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, "
    "with the exception of an initial optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def mistral_v03(path):
    return model_folder(path, ["[INST]", "[/INST]"], model_type="mistral", chat_template=MISTRAL_V03, **SHAPE)


def test_a_named_template_that_contradicts_the_chat_template_is_warned_naming_the_match(tmp_path):
    d = mistral_v03(tmp_path / "mistral")
    warning = ct.contradiction("llama2", d)
    assert warning and warning.startswith("template 'llama2' renders 4 of 4 probe conversations unlike")
    assert f"the chat template in {d / 'chat_template.jinja'}, which matches mistral (" in warning
    assert "set model.template: mistral (or auto)" in warning
    assert ct.contradiction("mistral", d) is None and ct.contradiction("auto", d) is None
    qwen = model_folder(
        tmp_path / "q", ["<|im_start|>", "<|im_end|>"], chat_template=CHATML, model_type="qwen2"
    )
    assert ct.contradiction("qwen", qwen) is None  # its own template: no word


@pytest.mark.reliability(
    fault="a `model.template` that contradicts the folder's own chat template (`llama2` on Mistral-v0.3's)",
    seen=(
        "the DAG is built and the run goes on, with a warning naming the chat template's file and the "
        "template it matches (`mistral`)"
    ),
    steps_lost="none",
    data_lost="none",
)
def test_snakemake_warns_of_a_named_template_that_contradicts_the_chat_template(tmp_path):
    d = mistral_v03(tmp_path / "mistral")
    work = make_workdir(tmp_path / "work", model__name_or_path=str(d), model__template="llama2")
    res = snakemake(work, "-n", timeout=240)
    assert res.returncode == 0, (res.stdout + res.stderr)[-2000:]
    assert "llmft: warning: config key model.template: template 'llama2' renders 4 of 4" in res.stderr
    assert "which matches mistral (" in res.stderr


@pytest.mark.parametrize("name,reference", [("qwen", published.chatml), ("llama3", published.llama3)])
def test_table_renders_the_format_the_model_authors_publish(name, reference):
    """The table against formats written out by hand (tests/published_formats.py), not against a
    fresh build of itself: every probe conversation, as the model's authors document it."""
    spec = ct.table()["templates"][name]
    eos = spec["stop_words"][0]
    for probe, messages, generation in ct.PROBES:
        system = next((m["content"] for m in messages if m["role"] == "system"), None)
        turns = [(m["role"], m["content"]) for m in messages if m["role"] != "system"]
        rendered = published.flatten(spec["renders"][probe], bos="<|begin_of_text|>", eos=eos)
        assert rendered == reference(turns, system, generation), probe
