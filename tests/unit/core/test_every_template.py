"""Every chat template of LLaMA-Factory 0.9.5 (all 121 of its TEMPLATES) on text rows: our SFTEncoder
gives, row by row, LLaMA-Factory's own input_ids and labels (its tokenizer and processor loader, its
get_template_and_fix_tokenizer, its SupervisedDatasetProcessor), or, where a template cannot tokenize
text without the model's processor, prepare stops naming it.

The rows: alpaca single-turn rows with and without a system prompt, alpaca rows with history and
sharegpt multi-turn rows; English, Chinese, code, mixed scripts, special-token look-alikes and a
"{{content}}" look-alike (tests/compat.py's conversations, 22 rows). And, for every template that
tokenizes, tool rows (compat's "sharegpt with tools": function calls, one or two at once, observations,
a tools column) in the template's tool format; chatglm3, glm4 and glmz1 get single calls only, their
tool format (LLaMA-Factory's glm4) raises for parallel calls, which is asserted.

The tokenizer: the repo's tiny byte-level BPE tokenizer (llmft.core.assets.build_tokenizer). LLaMA-Factory's
get_template_and_fix_tokenizer adds the EOS and stop words a template brings; both sides load the same
folder and get the same fixed tokenizer (the fit check that refuses such pairs for training is
chat_templates.check, tested in test_chat_templates.py). Templates with special tokens in their format
slots (chatglm3: [gMASK] sop; yuan: <sep>) get a folder with those tokens: without them LLaMA-Factory's
own ids would be None.

Text templates (BasePlugin, 73): all token-exact.

Multimodal templates (48, mm_plugin not BasePlugin): LLaMA-Factory needs the model's processor even for
text rows. A processor is built offline, from default image processors / feature extractors and the tiny
tokenizer with the processor's special tokens, saved with save_pretrained (one recipe per plugin class,
RECIPES), for 14 templates: gemma3, gemma3n, llava_next (and granite3_vision, llava_next_llama3,
llava_next_mistral, llava_next_qwen, llava_next_yi), llava, yi_vl, paligemma, paligemma_chat, mllama,
qwen2_audio. Those are token-exact with LLaMA-Factory run with the same processor.

The other 34 cannot be built here; for them the test asserts that SFTEncoder (prepare) on a folder
without a processor stops with the "needs the model's processor" message naming the template, and that
LLaMA-Factory itself cannot tokenize them without one ("Processor was not found"):

- the processor (or its image processor) needs torchvision, not installed (transformers 5 has
  torchvision-only image/video processors for them): every template whose plugin has a video token
  (its processor needs a video processor: qwen2_vl, dots_ocr, keye_vl, mimo_vl, qwen3_vl,
  qwen3_vl_nothink, qwen3_5, qwen3_5_nothink, qwen3_6, glm4v, glm4_5v, glm_ocr, qwen2_omni, qwen3_omni,
  qwen3_omni_nothink, intern_vl, intern_s1, gemma4, gemma4n, llava_next_video, llava_next_video_mistral,
  llava_next_video_yi, video_llava, ernie_vl), and pixtral, ministral3, mistral_small (PixtralProcessor),
  llama4 (Llama4ImageProcessor), lfm2_vl (Lfm2VlImageProcessor);
- the processor is remote code on the Hub, not in transformers: kimi_vl, minicpm_v, minicpm_o,
  minicpm_v_4_6, youtu_vl.

No template is left out: none is reward/ranking-only or raises for text rows in LLaMA-Factory's SFT
preprocessing (so the "other" count is 0).

Evaluation, the same 87 templates on the same folders and rows: llmft.evaluate.encode's (prompt ids,
answer ids) per row equal the input_ids and labels LLaMA-Factory feeds the model when predicting (the
processor its loader picks for an SFT predict set, _get_dataset_processor(..., do_generate=True): the
UnsupervisedDatasetProcessor; its labels carry the EOS efficient-EOS templates add, as evaluate's
answers do), with the processor where the template has one. The rows go in three batches: one-turn and
one-history-turn rows, which evaluate encodes from its template table (prompts.py) wherever
PromptEncoder.load says the table is exact (asserted to be the path taken; 21 text templates on these
folders: alpaca breeze cohere deepseek deepseek3 deepseekcoder default empty exaone falcon fewshot
granite3 index olmo openchat seed_coder solar telechat2 vicuna xuanyuan zephyr; the other plain ones
would have their tokenizer changed by LLaMA-Factory: EOS replaced, stop words set), else through
LLaMA-Factory's template; longer conversations and the "{{content}}" look-alikes, always through
LLaMA-Factory's template; and the tool rows (single calls only for chatglm3, glm4, glmz1), always
through LLaMA-Factory's template. For the 34 templates without a processor, evaluate.encode stops with
the same named "needs the model's processor" message as prepare (never LLaMA-Factory's "Processor was
not found").
"""

from __future__ import annotations

import re

import pytest
from llmft.core.assets import build_tokenizer
from llmft.core.config import ConfigError
from llmft.core.lf import chat_templates as ct
from llmft.core.lf.pretokenize import SFTEncoder

from tests import compat
from tests.lfref import dataset_attr, lf_convert

TEMPLATES = sorted(ct.table()["templates"])  # lf_templates.json: checked against LLaMA-Factory elsewhere
SPECS = ct.table()["templates"]

# plugin class -> how to build its processor offline: (processor class, sub-processors as
# (argument, class, kwargs)), special tokens the tokenizer carries under a name, other special tokens.
RECIPES = {
    "Gemma3Plugin": (
        "Gemma3Processor",
        [("image_processor", "Gemma3ImageProcessor", {})],
        {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
        [],
    ),
    "Gemma3nPlugin": (
        "Gemma3nProcessor",
        [
            ("feature_extractor", "Gemma3nAudioFeatureExtractor", {}),
            ("image_processor", "SiglipImageProcessor", {}),
        ],
        {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
            "boa_token": "<start_of_audio>",
            "eoa_token": "<end_of_audio>",
            "audio_token": "<audio_soft_token>",
        },
        [],
    ),
    "LlavaPlugin": (
        "LlavaProcessor",
        [("image_processor", "CLIPImageProcessor", {})],
        {"image_token": "<image>"},
        [],
    ),
    "LlavaNextPlugin": (
        "LlavaNextProcessor",
        [("image_processor", "LlavaNextImageProcessor", {})],
        {"image_token": "<image>"},
        [],
    ),
    "PaliGemmaPlugin": (
        "PaliGemmaProcessor",
        [("image_processor", "SiglipImageProcessor", {"image_seq_length": 16})],
        {"image_token": "<image>"},
        [],
    ),
    "MllamaPlugin": (
        "MllamaProcessor",
        [("image_processor", "MllamaImageProcessor", {})],
        {"image_token": "<|image|>"},
        ["<|python_tag|>"],
    ),
    "Qwen2AudioPlugin": (
        "Qwen2AudioProcessor",
        [("feature_extractor", "WhisperFeatureExtractor", {})],
        {"audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"},
        [],
    ),
}
TORCHVISION = "its processor needs torchvision (not installed)"
REMOTE = "its processor is remote code on the Hub, not in transformers"
NOT_BUILT = {
    **{
        name: TORCHVISION
        for name in (
            "qwen2_vl dots_ocr keye_vl mimo_vl qwen3_vl qwen3_vl_nothink qwen3_5 qwen3_5_nothink qwen3_6 "
            "glm4v glm4_5v glm_ocr qwen2_omni qwen3_omni qwen3_omni_nothink intern_vl intern_s1 gemma4 "
            "gemma4n llava_next_video llava_next_video_mistral llava_next_video_yi video_llava ernie_vl "
            "pixtral ministral3 mistral_small llama4 lfm2_vl"
        ).split()
    },
    **{name: REMOTE for name in "kimi_vl minicpm_v minicpm_o minicpm_v_4_6 youtu_vl".split()},
}


def kind(name: str) -> str:
    spec = SPECS[name]
    if not spec["multimodal"]:
        return "text"
    return "built" if spec["plugin"] in RECIPES else "refused"


NO_PARALLEL_CALLS = ("chatglm3", "glm4", "glmz1")  # LLaMA-Factory's glm4 tool format raises for them


def _parallel(raw: dict) -> bool:
    return any(m["from"] == "function_call" and m["value"].startswith("[") for m in raw["conversations"])


class Lab:
    """The module's set-up: rows read once (ours) and converted once (LLaMA-Factory's), tokenizer
    folders built on first use."""

    def __init__(self, root):
        self.root = root
        convs = compat.conversations(10, seed=11)
        convs.append({"system": "Keep {{content}} as is.", "turns": [("Echo {{content}}", "{{content}} ok")]})
        self.rows, self.aligned = [], []
        for fmt in compat.FORMATS:
            if fmt.name == "sharegpt with tools":
                continue
            raw = fmt.make(convs)
            self.rows += compat.read_ours(fmt, raw)
            self.aligned += lf_convert(raw, dataset_attr(fmt.formatting, fmt.columns, fmt.tags))
        # Tool rows (compat's "sharegpt with tools"); GLM-4's tool format refuses parallel calls.
        fmt = next(f for f in compat.FORMATS if f.name == "sharegpt with tools")
        raw = fmt.make(compat.conversations(12, seed=3))
        self.tool_rows = compat.read_ours(fmt, raw)
        self.tool_aligned = lf_convert(raw, dataset_attr(fmt.formatting, fmt.columns, fmt.tags))
        single = [i for i, r in enumerate(raw) if not _parallel(r)]
        self.single_call = ([self.tool_rows[i] for i in single], [self.tool_aligned[i] for i in single])
        self.parallel_call = self.tool_aligned[next(i for i, r in enumerate(raw) if _parallel(r))]
        self._folders: dict = {}

    def folder(self, name: str):
        spec = SPECS[name]
        key = spec["plugin"] if kind(name) == "built" else tuple(spec["slot_tokens"])
        if key not in self._folders:
            d = self.root / re.sub(r"\W", "_", str(key) or "plain")
            self._folders[key] = self._build(d, key)
        return self._folders[key]

    def _build(self, d, key):
        import transformers
        from transformers import AutoTokenizer

        build_tokenizer(d, 512)
        tok = AutoTokenizer.from_pretrained(d)
        recipe = RECIPES.get(key) if isinstance(key, str) else None
        named, extra = (recipe[2], recipe[3]) if recipe else ({}, list(key))
        if named or extra:
            tok.add_special_tokens({"additional_special_tokens": [*named.values(), *extra]})
        tok.save_pretrained(d)
        if recipe:
            processor_class, parts, _, _ = recipe
            tok = AutoTokenizer.from_pretrained(d, extra_special_tokens=named)
            subs = {arg: getattr(transformers, cls)(**kwargs) for arg, cls, kwargs in parts}
            getattr(transformers, processor_class)(tokenizer=tok, **subs).save_pretrained(d)
        return d


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    return Lab(tmp_path_factory.mktemp("every_template"))


def llamafactory_rows(folder, name: str, aligned: list[dict], predict: bool = False):
    """LLaMA-Factory's own: load_tokenizer (tokenizer and processor) on the folder, the template's
    fix, its SFT processor, or with `predict` the processor its loader picks for an SFT predict
    set (predict_with_generate: UnsupervisedDatasetProcessor, prompt ids and answer ids apart).
    Returns (outputs, processor)."""
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.data.loader import _get_dataset_processor
    from llamafactory.data.processor import SupervisedDatasetProcessor, UnsupervisedDatasetProcessor
    from llamafactory.hparams import DataArguments, ModelArguments
    from llamafactory.model import load_tokenizer

    from tests.lfref import ALIGNED

    module = load_tokenizer(ModelArguments(model_name_or_path=str(folder)))
    data_args = DataArguments(template=name, cutoff_len=1_000_000)
    template = get_template_and_fix_tokenizer(module["tokenizer"], data_args)
    proc = _get_dataset_processor(
        data_args, "sft", template, module["tokenizer"], module["processor"], do_generate=predict
    )
    assert type(proc) is (UnsupervisedDatasetProcessor if predict else SupervisedDatasetProcessor)
    return proc.preprocess_dataset({k: [ex[k] for ex in aligned] for k in ALIGNED}), module["processor"]


def test_every_template_has_a_category():
    from llamafactory.data.template import TEMPLATES as LF

    assert sorted(LF) == TEMPLATES and len(TEMPLATES) == 121
    refused = {n for n in TEMPLATES if kind(n) == "refused"}
    assert refused == set(NOT_BUILT), "a refused template needs its reason in NOT_BUILT (and the docstring)"
    counts = {k: sum(kind(n) == k for n in TEMPLATES) for k in ("text", "built", "refused")}
    assert counts == {"text": 73, "built": 14, "refused": 34}, counts


@pytest.mark.parametrize("name", [n for n in TEMPLATES if kind(n) != "refused"])
def test_template_is_token_exact_with_llamafactory(lab, name):
    folder = lab.folder(name)
    enc = SFTEncoder(folder, name)
    ours = enc.encode(lab.rows)
    theirs, processor = llamafactory_rows(folder, name, lab.aligned)
    if kind(name) == "built":
        assert processor is not None and type(enc.processor) is type(processor)
        assert type(processor).__name__ == RECIPES[SPECS[name]["plugin"]][0]
    else:
        assert enc.processor is None and processor is None
    assert_same(ours, theirs, lab.rows, name)


def assert_same(ours, theirs, rows, name):
    assert len(theirs["input_ids"]) == len(rows)
    for i, row in enumerate(rows):
        a, b = ours.offsets[i], ours.offsets[i + 1]
        assert ours.ids[a:b].tolist() == theirs["input_ids"][i], (name, row)
        assert ours.labels[a:b].tolist() == theirs["labels"][i], (name, row)


@pytest.mark.parametrize("name", [n for n in TEMPLATES if kind(n) != "refused"])
def test_tool_rows_are_token_exact_with_llamafactory(lab, name):
    """Function calls (one or two at once), observations and a tools column, in the template's own
    tool format or LLaMA-Factory's generic one."""
    rows, aligned = (lab.tool_rows, lab.tool_aligned) if name not in NO_PARALLEL_CALLS else lab.single_call
    folder = lab.folder(name)
    ours = SFTEncoder(folder, name).encode(rows)
    theirs, _ = llamafactory_rows(folder, name, aligned)
    assert_same(ours, theirs, rows, name)
    if name in NO_PARALLEL_CALLS:
        with pytest.raises(ValueError, match="does not support parallel functions"):
            llamafactory_rows(folder, name, [lab.parallel_call])


@pytest.mark.parametrize("name", sorted(NOT_BUILT))
def test_template_without_a_processor_is_refused_by_name(lab, name):
    folder = lab.folder("default")  # the plain tokenizer, no processor files
    with pytest.raises(ConfigError) as err:
        SFTEncoder(folder, name)
    msg = str(err.value)
    assert f"template {name!r} is multimodal" in msg and "needs the model's processor" in msg
    assert str(folder) in msg and "preprocessor_config.json" in msg
    # LLaMA-Factory itself cannot tokenize text rows with it there either.
    with pytest.raises(ValueError, match="(?i)processor was not found"):
        llamafactory_rows(folder, name, lab.aligned[:1])


# -- evaluation: llmft.evaluate.encode against LLaMA-Factory's predict inputs ------------------


def assert_same_predict(encoded, theirs, rows, name):
    """(prompt ids, answer ids) per row equal LLaMA-Factory's predict input_ids and labels."""
    assert len(encoded) == len(rows) and len(theirs["input_ids"]) == len(rows), name
    for i, row in enumerate(rows):
        prompt, answer = encoded[i]
        assert list(prompt) == theirs["input_ids"][i], (name, "prompt", row)
        assert list(answer) == theirs["labels"][i], (name, "answer", row)


def _evaluate_encode(rows, folder, name, caplog):
    """evaluate.encode on the rows; its ids and the path it logged ("table" or "llamafactory")."""
    from llmft.evaluate import run as evaluate

    caplog.clear()
    with caplog.at_level("INFO", logger="llmft.evaluate"):
        _, encoded = evaluate.encode(rows, str(folder), name)
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "llmft.evaluate")
    path = (
        "table"
        if "from the template table" in said
        else "llamafactory"
        if "from LLaMA-Factory" in said
        else ""
    )
    assert path, said
    return encoded, path


def _eval_groups(rows: list[dict]) -> dict[str, list[int]]:
    """Row indices by what evaluate.encode may do with them: shapes the template table has (one
    turn or one of history), longer conversations and the "{{content}}" look-alikes (LLaMA-Factory's
    template for both: the table refuses a whole batch for one such row)."""
    from llmft.core import conversation

    groups: dict[str, list[int]] = {"table shapes": [], "longer": [], "look-alike": []}
    for i, row in enumerate(rows):
        if "{{" in repr(row):
            groups["look-alike"].append(i)
        elif len(conversation.contents(row)) in (2, 4):
            groups["table shapes"].append(i)
        else:
            groups["longer"].append(i)
    assert all(groups.values()), groups
    return groups


def _table_is_exact(folder, name: str) -> bool:
    from llmft.core.lf.prompts import PromptEncoder
    from transformers import AutoTokenizer

    return PromptEncoder.load(AutoTokenizer.from_pretrained(folder), name)[0] is not None


@pytest.mark.parametrize("name", [n for n in TEMPLATES if kind(n) != "refused"])
def test_evaluation_prompts_equal_llamafactory_predict(lab, name, caplog):
    """Plain rows (the template table where it is exact, else LLaMA-Factory's template) and tool
    rows (always LLaMA-Factory's template), against LLaMA-Factory's predict inputs."""
    folder = lab.folder(name)
    paths = {}
    for group, idx in _eval_groups(lab.rows).items():
        rows = [lab.rows[i] for i in idx]
        encoded, paths[group] = _evaluate_encode(rows, folder, name, caplog)
        theirs, _ = llamafactory_rows(folder, name, [lab.aligned[i] for i in idx], predict=True)
        assert_same_predict(encoded, theirs, rows, name)
    table = _table_is_exact(folder, name)
    assert paths == {
        "table shapes": "table" if table else "llamafactory",
        "longer": "llamafactory",
        "look-alike": "llamafactory",
    }
    assert not (table and SPECS[name]["multimodal"])
    rows, aligned = (lab.tool_rows, lab.tool_aligned) if name not in NO_PARALLEL_CALLS else lab.single_call
    encoded, path = _evaluate_encode(rows, folder, name, caplog)
    assert path == "llamafactory"
    theirs, _ = llamafactory_rows(folder, name, aligned, predict=True)
    assert_same_predict(encoded, theirs, rows, name)


def test_evaluation_template_table_is_used(lab):
    """The table path is exercised: on these folders it is exact for 21 text templates (the others
    are not plain templates, or LLaMA-Factory would change the tokenizer: replace its EOS, set
    stop words as its extra special tokens)."""
    exact = [n for n in TEMPLATES if kind(n) == "text" and _table_is_exact(lab.folder(n), n)]
    assert len(exact) == 21, exact


@pytest.mark.parametrize("name", sorted(NOT_BUILT))
def test_evaluation_without_a_processor_is_refused_by_name(lab, name):
    from llmft.evaluate import run as evaluate

    folder = lab.folder("default")  # the plain tokenizer, no processor files
    with pytest.raises(ConfigError) as err:
        evaluate.encode(lab.rows[:1], str(folder), name)
    msg = str(err.value)
    assert f"template {name!r} is multimodal" in msg and "needs the model's processor" in msg
    assert str(folder) in msg and "preprocessor_config.json" in msg
    assert "processor was not found" not in msg.lower()
