"""`model.template: auto` picks LLaMA-Factory's template from the model folder, a template that does
not fit the tokenizer stops the run, multimodal templates tokenize text rows with the model's
processor exactly as LLaMA-Factory does, and a tokenizer that transformers loads differently from
its tokenizer.json is refused. Real LLaMA-Factory, real tokenizer files, no mocks."""

from __future__ import annotations

import json
import shutil

import pytest
from llmft.core import chat_templates as ct
from llmft.core.config import ConfigError
from llmft.core.pretokenize import SFTEncoder, messages_of
from llmft.data import tokcheck
from llmft.data.assets import build_tokenizer, synthetic_rows
from llmft.data.sources import DataError

from tests import published_formats as published
from tests.conftest import REPO, make_workdir, snakemake
from tests.lfref import aligned_from_canonical, lf_sft
from tests.reliability import reliability

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
        "lf_templates.json is stale: python -m llmft.core.chat_templates --write (from workflow/)"
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


def test_auto_falls_back_on_model_type_and_the_tokenizer_decides_between_candidates(tmp_path):
    llama2 = model_folder(tmp_path / "l2")  # no <|eot_id|>: llama3 would add it as a new id
    assert ct.resolve(llama2) == ("llama2", "no chat template; model_type llama → llama2")
    llama3 = model_folder(
        tmp_path / "l3", ["<|eot_id|>", "<|eom_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    )
    assert ct.resolve(llama3) == ("llama3", "no chat template; model_type llama → llama3")
    unknown = model_folder(tmp_path / "u", model_type="nonesuch")
    name, why = ct.resolve(unknown)
    assert name == "default" and "model_type nonesuch" in why


def test_a_template_whose_tokens_are_not_in_the_vocabulary_is_refused(tmp_path):
    """Mistral-like: no <|im_start|>/<|im_end|>; qwen would make <|im_end|> id len(vocab)."""
    d = model_folder(tmp_path / "mistralish")
    with pytest.raises(ConfigError) as err:
        ct.check("qwen", d)
    msg = str(err.value)
    assert "template 'qwen'" in msg and str(d) in msg and "'<|im_end|>'" in msg
    assert "new id 512" in msg and "past the model's 512 embeddings" in msg
    assert "set model.template: llama2" in msg  # what auto picks there, and fits
    ct.check("llama2", d)  # fits


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
    assert stats["template"] == "llama2" and stats["tokenizer_check"]["checked"]


@reliability(
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
    assert str(d) in log and "set model.template: llama2" in log
    assert "Traceback" not in log


# -- real tokenizers (tests/setup-tokenizers.sh) ---------------------------------------------

# family -> (config.json model_type, architectures, vocab_size, the template auto must pick)
REAL_CASES = {
    "qwen3": ("qwen3", ["Qwen3ForCausalLM"], 151936, "qwen3"),
    "qwen2_5": ("qwen2", ["Qwen2ForCausalLM"], 152064, "qwen"),
    "llama3": ("llama", ["LlamaForCausalLM"], 128256, "llama3"),
    "llama2": ("llama", ["LlamaForCausalLM"], 32000, "llama2"),
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
