"""Which LLaMA-Factory chat template fits a model folder (`model.template: auto`), and whether a
chosen one fits its tokenizer at all.

Picking: the folder's own chat template (tokenizer_config.json `chat_template`, chat_template.jinja)
renders a few probe conversations with jinja2, as transformers' `apply_chat_template` does; each
LLaMA-Factory template's rendering of the same conversations (recorded once from the installed
version into lf_templates.json) is turned into text with the folder's special tokens. The template
that matches on the most probes wins, exact first; ties, and chat templates that match none, go by
the model type (config.json `model_type`, architectures) and by LLaMA-Factory's own model-name
table. A folder without a chat template (nor processor) is a base model: `default`, as
LLaMA-Factory advises for base models. A folder without a processor config never gets a
multimodal template (LLaMA-Factory needs the processor to tokenize even text rows with one, and its
collator always does).

Fitting: the special tokens a template brings (stop words, the EOS it puts in place of the
tokenizer's, tokens in its format slots, its thought words) must already be in the tokenizer's
vocabulary, and every id it yields below config.json's `vocab_size`. Otherwise LLaMA-Factory's
`fix_special_tokens` adds them as new ids past the model's embedding table (Mistral's 32768-token
tokenizer with template qwen gets id 32768 for <|im_end|>).

All of this reads files only (json, jinja2, optionally `tokenizers`): it runs when Snakemake builds
the DAG, where importing LLaMA-Factory (~8 s) would be paid by every `snakemake -n`. A folder with
only a slow tokenizer's files (vocab.json + merges.txt, tokenizer.model) is read through the
tokenizer transformers builds from them, as LLaMA-Factory will load it.
`python -m llmft.core.lf.chat_templates --write` regenerates lf_templates.json from the installed
LLaMA-Factory; a test checks the file against it.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from llmft.core.config import ConfigError
from llmft.core.io import read_optional
from llmft.core.lf.prompts import Recorder

if TYPE_CHECKING:
    from llmft.core.settings import Model

log = logging.getLogger("llmft.core.lf.chat_templates")

TABLE = Path(__file__).with_name("lf_templates.json")
AUTO = "auto"
# The builtin tiny model's tokenizer has no chat template; its pipeline template is `default`.
BUILTIN_TEMPLATE = "default"
# What auto picks for a folder without a chat template (a base model), as LLaMA-Factory advises.
BASE_TEMPLATE = "default"
# Files whose presence lets transformers' AutoProcessor build a processor (LLaMA-Factory's loader).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")

# Probe conversations: (name, messages, add_generation_prompt). Texts without leading or trailing
# spaces: many chat templates trim contents.
_S = {"role": "system", "content": "You are terse."}
_U1 = {"role": "user", "content": "What is two plus two?"}
_A1 = {"role": "assistant", "content": "Four."}
_U2 = {"role": "user", "content": "And three plus three?"}
_A2 = {"role": "assistant", "content": "Six."}
PROBES = (
    ("system, user, assistant", [_S, _U1, _A1], False),
    ("user, assistant", [_U1, _A1], False),
    ("two turns", [_S, _U1, _A1, _U2, _A2], False),
    ("generation prompt", [_S, _U1], True),
)

# model_type (config.json) -> LLaMA-Factory templates to try in order; the first that fits the
# tokenizer wins (llama: Llama-3 has <|eot_id|>, Llama-2 does not). Text-only Gemma-3 is `gemma2`,
# as LLaMA-Factory registers Gemma-3-1B.
MODEL_TYPES = {
    "llama": ["llama3", "llama2"],
    "mistral": ["mistral", "llama2"],
    "mistral3": ["mistral_small"],
    "mixtral": ["mistral"],
    "ministral": ["ministral"],
    "qwen2": ["qwen"],
    "qwen2_moe": ["qwen"],
    "qwen3": ["qwen3"],
    "qwen3_moe": ["qwen3"],
    "qwen3_next": ["qwen3_nothink"],
    "qwen2_vl": ["qwen2_vl"],
    "qwen2_5_vl": ["qwen2_vl"],
    "qwen3_vl": ["qwen3_vl"],
    "qwen3_vl_moe": ["qwen3_vl"],
    "gemma": ["gemma"],
    "gemma2": ["gemma2"],
    "gemma3_text": ["gemma2"],
    "gemma3": ["gemma3"],
    "gemma3n": ["gemma3n"],
    "gemma3n_text": ["gemma2"],
    "paligemma": ["paligemma"],
    "llama4": ["llama4"],
    "mllama": ["mllama"],
    "llava": ["llava"],
    "llava_next": ["llava_next"],
    "phi3": ["phi"],
    "phi": ["phi"],
    "deepseek_v3": ["deepseek3"],
    "deepseek_v2": ["deepseek"],
    "gpt_oss": ["gpt_oss"],
    "olmo": ["olmo"],
    "olmo2": ["olmo"],
    "granite": ["granite3"],
    "granitemoe": ["granite3"],
    "cohere": ["cohere"],
    "cohere2": ["cohere"],
    "glm4": ["glm4"],
    "glm4_moe": ["glm4_moe"],
    "chatglm": ["glm4", "chatglm3"],
    "exaone": ["exaone"],
    "internlm2": ["intern2"],
    "falcon_h1": ["falcon_h1"],
    "falcon": ["falcon"],
    "lfm2": ["lfm2"],
    "yuan": ["yuan"],
    "dbrx": ["dbrx"],
    "hunyuan_v1_dense": ["hunyuan"],
    "seed_oss": ["seed_oss"],
    "ernie4_5": ["ernie_nothink"],
    "starcoder2": ["starchat"],
}

_MARKER = re.compile(r"<[|｜]?[^<>\s]{1,40}?[|｜]?>")


class TemplateError(ConfigError):
    """A template does not fit the model folder; the message names both and what to set."""


# -- the table from the installed LLaMA-Factory ------------------------------------------------


def _flat(elements: list) -> list:
    out = []
    for e in elements:
        if isinstance(e, list) and e and isinstance(e[0], list):
            out.extend(e)
        elif isinstance(e, str) and out and isinstance(out[-1], str):
            out[-1] += e  # adjacent texts: one piece, as text is all that is compared
        else:
            out.append(e)
    return [e for e in out if e != ""]


def _slot_tokens(tpl) -> list[str]:
    names = set()
    for attr in ("format_user", "format_assistant", "format_system", "format_function", "format_observation",
                 "format_tools", "format_prefix"):  # fmt: skip
        for slot in getattr(getattr(tpl, attr), "slots", None) or ():
            if isinstance(slot, dict) and "token" in slot:
                names.add(slot["token"])
    return sorted(names)


def build_table() -> dict:
    """Per template: what fix_special_tokens and the formatters need from a tokenizer, whether it is
    multimodal, and its rendering of the probe conversations (imports LLaMA-Factory)."""
    from llamafactory.data.mm_plugin import BasePlugin
    from llamafactory.data.template import TEMPLATES, ReasoningTemplate
    from llamafactory.extras.constants import DEFAULT_TEMPLATE, SUPPORTED_MODELS

    templates = {}
    for name, tpl in sorted(TEMPLATES.items()):
        renders = {}
        for probe, msgs, generation in PROBES:
            if generation:
                prompt, _ = tpl.encode_oneturn(Recorder(), [*msgs[1:], _A1], msgs[0]["content"])
                renders[probe] = _flat(prompt)
            else:
                system = msgs[0]["content"] if msgs[0]["role"] == "system" else None
                turns = [m for m in msgs if m["role"] != "system"]
                # Without the EOS that the SFT processor appends under efficient_eos: the
                # template's own jinja (and a model's chat template) ends the turn without it.
                prompt, answer = tpl.encode_oneturn(Recorder(), turns, system)
                renders[probe] = _flat(prompt + answer)
        reasoning = isinstance(tpl, ReasoningTemplate)
        templates[name] = {
            "multimodal": type(tpl.mm_plugin) is not BasePlugin,
            "plugin": type(tpl.mm_plugin).__name__,
            "reasoning": reasoning,
            "stop_words": list(tpl.stop_words),
            "replace_eos": tpl.replace_eos,
            "efficient_eos": tpl.efficient_eos,
            "slot_tokens": _slot_tokens(tpl),
            "thought_markers": sorted({m for w in tpl.thought_words for m in _MARKER.findall(w)})
            if reasoning
            else [],
            "renders": renders,
        }
    # LLaMA-Factory's model-name table: a hub repository's name (lower case) -> its template.
    names = {}
    for model, template in DEFAULT_TEMPLATE.items():
        for path in SUPPORTED_MODELS.get(model, {}).values():
            names[path.rsplit("/", 1)[-1].lower()] = template
    return {
        "llamafactory": metadata.version("llamafactory"),
        "templates": templates,
        "model_names": dict(sorted(names.items())),
    }


@cache
def table() -> dict:
    return json.loads(TABLE.read_text(encoding="utf-8"))


def is_multimodal(template: str) -> bool:
    spec = table()["templates"].get(template)
    return bool(spec and spec["multimodal"])


# -- a model folder ------------------------------------------------------------------------


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Folder:
    """What the files of a model (or tokenizer) folder say: chat template, special tokens,
    vocabulary, model type and embedding size, processor files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        config = read_optional(self.path / "config.json", {})
        config = config if isinstance(config, dict) else {}  # refused by the config check
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        self.model_type = config.get("model_type")
        self.text_model_type = text.get("model_type")
        self.architectures = list(config.get("architectures") or [])
        self.vocab_size = config.get("vocab_size") or text.get("vocab_size")
        self.tokenizer_config = tc = read_optional(self.path / "tokenizer_config.json", {})
        self.special = {
            k: _token_text(tc.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        self.chat_template = self._chat_template()
        self.processor_files = [f for f in PROCESSOR_FILES if (self.path / f).is_file()]
        self.vocab = self._vocab()

    def _chat_template(self) -> str | None:
        """The chat template, its file kept in `chat_template_file` (errors name it)."""
        jinja = self.path / "chat_template.jinja"
        self.chat_template_file = jinja
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        self.chat_template_file = self.path / "tokenizer_config.json"
        tpl = self.tokenizer_config.get("chat_template")
        if isinstance(tpl, list):  # named templates: the default one
            tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
        if isinstance(tpl, str):
            return tpl
        self.chat_template_file = self.path / "chat_template.json"
        proc = read_optional(self.chat_template_file, {})
        proc = proc.get("chat_template") if isinstance(proc, dict) else None
        return proc if isinstance(proc, str) else None

    def _vocab(self) -> dict[str, int] | None:
        """token -> id (the model's vocabulary and the added tokens) from tokenizer.json, or without
        one as transformers loads the slow tokenizer's files; None when that cannot load."""
        tj = self.path / "tokenizer.json"
        backend = self.backend()
        if not tj.is_file():
            return None if backend is None else backend.get_vocab(with_added_tokens=True)
        if backend is not None:
            out = backend.get_vocab(with_added_tokens=True)
        else:  # a file the installed `tokenizers` cannot read: its JSON
            data = read_optional(tj, {})
            vocab = (data.get("model") or {}).get("vocab")
            out = {}
            if isinstance(vocab, dict):
                out.update(vocab)
            elif isinstance(vocab, list):  # Unigram: [piece, score] by id
                out.update({piece[0]: i for i, piece in enumerate(vocab)})
            for tok in data.get("added_tokens") or ():
                out[tok["content"]] = tok["id"]
        for id_, tok in (self.tokenizer_config.get("added_tokens_decoder") or {}).items():
            if isinstance(tok, dict) and "content" in tok:
                out.setdefault(tok["content"], int(id_))
        return out

    def backend(self):
        """tokenizer.json through the `tokenizers` library; without one (vocab.json + merges.txt,
        tokenizer.model), the tokenizer transformers builds from the slow files, as LLaMA-Factory
        loads it (slow: seconds). None when absent or unreadable."""
        if not hasattr(self, "_backend"):
            self._backend, self.load_error = None, None
            try:
                if (self.path / "tokenizer.json").is_file():
                    from tokenizers import Tokenizer

                    self._backend = Tokenizer.from_file(str(self.path / "tokenizer.json"))
                else:
                    self._backend = _slow_backend(self.path)
            except Exception as exc:  # noqa: BLE001 - reported by fit_problems, or where it is loaded
                self.load_error = f"{type(exc).__name__}: {exc}"
        return self._backend

    @property
    def has_processor(self) -> bool:
        return bool(self.processor_files)

    def token_id(self, token: str) -> int | None:
        return None if self.vocab is None else self.vocab.get(token)

    def model_types(self) -> list[str]:
        out = [t for t in (self.model_type, self.text_model_type) if t]
        # A multimodal architecture saved as text only (Gemma3ForCausalLM under model_type gemma3).
        if self.model_type == "gemma3" and any(a.endswith("ForCausalLM") for a in self.architectures):
            out.insert(0, "gemma3_text")
        return out


def _slow_backend(path: Path):
    """The `tokenizers` backend of the tokenizer transformers loads from a folder's slow files
    (local files only, no remote code); None when the folder has no tokenizer files at all."""
    from llmft.core.modelfiles import TOKENIZER_FILES

    if not any(any(path.glob(pattern)) for pattern in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True).backend_tokenizer


def read_folder(path: str | Path) -> Folder:
    """The Folder of `path`, read once per version of its files (resolve and check both need it)."""
    path = Path(path)
    names = (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        *PROCESSOR_FILES,
    )
    stamp = tuple((path / f).stat().st_mtime_ns if (path / f).exists() else None for f in names)
    return _folder(str(path), str(path.resolve()), stamp)


@cache
def _folder(path: str, _real: str, _stamp: tuple) -> Folder:
    return Folder(path)


# -- rendering ---------------------------------------------------------------------------


# Wall-clock seconds the chat template may take to render all probes (a process start included).
RENDER_SECONDS = 15


def render_probes(folder: Folder) -> tuple[dict[str, str], dict[str, bool]]:
    """The folder's chat template applied to the probes as transformers' apply_chat_template applies
    it: ({probe: text}, {probe: whether it appends the generation prompt regardless}). Probes it
    refuses (e.g. a system turn) are left out. Rendered in its own process (chatrender) within a time,
    memory and output budget; past one, TemplateError names the file. Once per Folder."""
    if not hasattr(folder, "_renders"):
        folder._renders = _render_probes(folder)
    return folder._renders


def _render_probes(folder: Folder) -> tuple[dict[str, str], dict[str, bool]]:
    request = {
        "template": folder.chat_template,
        "special": {k: v for k, v in folder.special.items() if v is not None},
        "probes": [list(p) for p in PROBES],
    }
    where = f"the chat template in {folder.chat_template_file}"
    script = Path(__file__).with_name("chatrender.py")
    try:
        proc = subprocess.run(
            [sys.executable, "-I", str(script)],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=RENDER_SECONDS,
        )
        reply = json.loads(proc.stdout)
    except subprocess.TimeoutExpired:
        raise TemplateError(
            f"{where} did not render {len(PROBES)} short probe conversations within {RENDER_SECONDS} s "
            "(loops without bound?); fix or remove it, or set model.template to a LLaMA-Factory template"
        ) from None
    except ValueError:
        raise TemplateError(f"{where} could not be rendered: {proc.stderr.strip()[-500:]}") from None
    if "budget" in reply:
        raise TemplateError(
            f"{where} is over its render budget: {reply['budget']}; fix or remove it, or set "
            "model.template to a LLaMA-Factory template"
        )
    if reply.get("error"):
        log.info("%s does not compile: %s", where, reply["error"])
    rendered, always = {}, {}
    for probe, out in reply["renders"].items():
        if "error" in out:
            log.info("%s does not render %r: %s", where, probe, out["error"])
        else:
            rendered[probe], always[probe] = out["text"], out["always"]
    return rendered, always


def effective_eos(spec: dict, folder: Folder) -> str | None:
    """The EOS token after LLaMA-Factory's fix_special_tokens."""
    if spec["replace_eos"] and spec["stop_words"]:
        return spec["stop_words"][0]
    return folder.special["eos_token"] or "<|endoftext|>"


def render_lf(spec: dict, folder: Folder, probe: str) -> str:
    out = []
    for elem in spec["renders"][probe]:
        if isinstance(elem, str):
            out.append(elem)
        elif elem[0] == "bos":
            out.append(folder.special["bos_token"] or "")  # no BOS token: LLaMA-Factory adds none
        elif elem[0] == "eos":
            out.append(effective_eos(spec, folder) or "")
        else:
            out.append(elem[1])
    return "".join(out)


# -- fitting -----------------------------------------------------------------------------


def needed_tokens(spec: dict, folder: Folder) -> list[tuple[str, str]]:
    """(token, why) of the special tokens the template needs from the tokenizer."""
    out = []
    if spec["replace_eos"] and spec["stop_words"]:
        out.append((spec["stop_words"][0], "the EOS token it sets"))
    stops = spec["stop_words"][1:] if spec["replace_eos"] else spec["stop_words"]
    out += [(t, "a stop word") for t in stops]
    if not spec["replace_eos"] and folder.special["eos_token"] is None:
        out.append(("<|endoftext|>", "the EOS token it adds (the tokenizer has none)"))
    out += [(t, "a token of its format") for t in spec["slot_tokens"]]
    out += [(t, "a thought word") for t in spec["thought_markers"]]
    seen, unique = set(), []
    for token, why in out:
        if token not in seen:
            seen.add(token)
            unique.append((token, why))
    return unique


def fit_problems(template: str, folder: Folder, text_ids: bool = True) -> list[str]:
    """Why `template` does not fit the folder's tokenizer and model; empty when it fits.

    A stop word that LLaMA-Factory adds but that neither ends the answers (the EOS it sets) nor
    occurs in the template's text is never yielded (Llama-3.0's tokenizer lacks llama3's second stop
    word <|eom_id|>): it is only logged. `text_ids`: also encode the template's rendering of the
    probes with tokenizer.json and check its ids (loads the tokenizer)."""
    spec = table()["templates"].get(template)
    if spec is None:
        return []
    if folder.vocab is None:
        if folder.load_error:
            return [f"transformers cannot load the tokenizer ({folder.load_error})"]
        log.info("%s has no tokenizer: template %s's tokens not checked", folder.path, template)
        return []
    problems, thoughts = [], []
    size = folder.vocab_size
    new_id = max(folder.vocab.values(), default=-1) + 1  # transformers adds a token at len(tokenizer)
    text = "".join(render_lf(spec, folder, p) for p, _, _ in PROBES)
    for token, why in needed_tokens(spec, folder):
        tid = folder.token_id(token)
        if tid is None:
            if why == "a stop word" and token not in text:
                log.info(
                    "template %s: stop word %r is not in %s's vocabulary (never yielded)",
                    template,
                    token,
                    folder.path,
                )
                continue
            if why == "a thought word":
                thoughts.append(token)
                continue
            problems.append(
                f"{token!r} ({why}) is not in the tokenizer's vocabulary: LLaMA-Factory would add it as "
                f"new id {new_id}"
                + (
                    (
                        f", past the model's {size} embeddings (config.json vocab_size)"
                        if new_id >= size
                        else f", an embedding row ({size} in config.json) the model never trained"
                    )
                    if size
                    else ""
                )
            )
        elif size and tid >= size:
            problems.append(
                f"{token!r} ({why}) has id {tid}, past the model's {size} embeddings (config.json vocab_size)"
            )
    if thoughts:
        problems.append(
            f"its thought words {thoughts} are not tokens of the tokenizer: every answer would carry them as "
            "plain text pieces (a reasoning template on a model that was not trained to think)"
        )
    if size and not problems:
        for name in ("bos_token", "eos_token", "pad_token"):
            tid = folder.token_id(folder.special[name]) if folder.special[name] else None
            if tid is not None and tid >= size:
                problems.append(f"the tokenizer's {name} has id {tid}, past the model's {size} embeddings")
        top = _max_text_id(folder, spec) if text_ids else None
        if top is not None and top >= size:
            problems.append(
                f"the tokenizer encodes the template's text to id {top}, past the model's {size} embeddings "
                "(config.json vocab_size)"
            )
    return problems


def _max_text_id(folder: Folder, spec: dict) -> int | None:
    """The largest id the tokenizer gives the template's rendering of the probes (tokenizer.json
    through the `tokenizers` library; None without it)."""
    tok = folder.backend()
    if tok is None:
        return None
    texts = [render_lf(spec, folder, probe) for probe, _, _ in PROBES]
    ids = [i for enc in tok.encode_batch(texts, add_special_tokens=False) for i in enc.ids]
    return max(ids) if ids else None


def processor_problem(template: str, folder: Folder) -> str | None:
    """A multimodal template on a folder without a processor config: LLaMA-Factory cannot tokenize
    (its plugin wants the processor even for text rows) nor train (its collator adds a fake image)."""
    if not is_multimodal(template) or folder.has_processor:
        return None
    twin = text_twin(template)
    return (
        f"template {template!r} is multimodal ({table()['templates'][template]['plugin']}) and needs the "
        f"model's processor, but {folder.path} has no {' or '.join(PROCESSOR_FILES[:2])}; LLaMA-Factory "
        "tokenizes and trains such a template only with it"
        + (
            f"; for a text-only model set model.template: {twin} (or auto)"
            if twin
            else "; set model.template: auto"
        )
    )


def text_twin(template: str) -> str | None:
    """The text-only template that renders the probes most like the multimodal `template`."""
    specs = table()["templates"]
    mine = specs[template]["renders"]
    best, score = None, 0
    for name, spec in specs.items():
        if spec["multimodal"]:
            continue
        same = sum(spec["renders"][p] == mine[p] for p, _, _ in PROBES)
        if same > score or (same == score and best and _prefer(name, best, template)):
            best, score = name, same
    return best if score == len(PROBES) else None  # only a template that renders every probe alike


def _prefer(a: str, b: str, like: str) -> bool:
    """Tie-break of two names: the one sharing a longer prefix with `like`, then the one of closer
    length (gemma3's text twin is gemma2, as LLaMA-Factory registers Gemma-3's text models)."""

    def common(x):
        n = 0
        while n < min(len(x), len(like)) and x[n] == like[n]:
            n += 1
        return n

    return (common(a), -abs(len(a) - len(like))) > (common(b), -abs(len(b) - len(like)))


# -- picking -----------------------------------------------------------------------------


def _hints(folder: Folder) -> list[tuple[str, str]]:
    """(template, why) suggested by the model type and LLaMA-Factory's model-name table."""
    out = []
    for mt in folder.model_types():
        out += [(t, f"model_type {mt} → {t}") for t in MODEL_TYPES.get(mt, ())]
    names = table()["model_names"]
    for name in (folder.path.name.lower(),):
        if name in names:
            out.append(
                (names[name], f"LLaMA-Factory's model table lists {folder.path.name} as {names[name]}")
            )
    return out


def _same(spec: dict, folder: Folder, probe: str, hf: str, always_prompt: bool) -> bool:
    """The template's rendering of `probe` equals the chat template's (`hf`); with a chat template
    that always appends the generation prompt, up to that appended header."""
    lf = render_lf(spec, folder, probe)
    if lf == hf:
        return True
    if not always_prompt or not hf.startswith(lf) or hf == lf:
        return False
    gen = render_lf(spec, folder, "generation prompt")
    header = gen[gen.rfind(_U1["content"]) + len(_U1["content"]) :]
    return header.endswith(hf[len(lf) :])


def _matching(spec: dict, folder: Folder, rendered: dict, always_prompt: dict) -> list[str]:
    """The probes on which the template renders as the chat template did (`rendered`)."""
    return [p for p in rendered if _same(spec, folder, p, rendered[p], always_prompt[p])]


def candidates(folder: Folder) -> list[str]:
    """Templates the folder can use: text-only ones unless it has a processor."""
    return [n for n, s in table()["templates"].items() if folder.has_processor or not s["multimodal"]]


def resolve(model_dir: str | Path) -> tuple[str, str]:
    """(template, why) for `model.template: auto`."""
    folder = read_folder(model_dir)
    specs = table()["templates"]
    hints = _hints(folder)
    hint_rank = {t: i for i, (t, _) in reversed(list(enumerate(hints)))}
    pool = [n for n in candidates(folder) if not fit_problems(n, folder, text_ids=False)]
    if folder.chat_template:
        rendered, always_prompt = render_probes(folder)
        scores = {}
        for name in pool:
            same = _matching(specs[name], folder, rendered, always_prompt)
            if any(p != "generation prompt" for p in same):
                scores[name] = same
        top = max((len(s) for s in scores.values()), default=0)
        # One matching probe out of several is weak evidence: the model type decides first then.
        weak = top < min(2, len(rendered)) and any(t in pool for t, _ in hints)
        if scores and not weak:
            # Equal renderings: the model type's template, then a multimodal one only for a folder
            # with a processor (a vision model), then by name.
            best = sorted(
                (n for n, s in scores.items() if len(s) == top),
                key=lambda n: (
                    hint_rank.get(n, len(hints)),
                    specs[n]["multimodal"] != folder.has_processor,
                    n,
                ),
            )
            name = best[0]
            if top == len(PROBES):
                why = f"chat template matches {name} exactly"
            else:
                differ = [p for p, _, _ in PROBES if p not in scores[name]]
                why = (
                    f"chat template matches {name} on {top} of {len(PROBES)} probes (not {', '.join(differ)})"
                )
            if len(best) > 1:
                why += f"; as well: {', '.join(best[1:6])}" + (
                    f" (chosen by {hints[hint_rank[name]][1]})" if name in hint_rank else ""
                )
            return name, why
    if not folder.chat_template and not folder.has_processor:
        # A base model: it learned no chat format, and LLaMA-Factory's guidance for base models is
        # `default` (the model type's chat template would teach an instruct model's format to it).
        # A folder with a processor keeps its model type's template: only a multimodal one feeds it.
        return BASE_TEMPLATE, (
            f"no chat template (a base model): {BASE_TEMPLATE}, LLaMA-Factory's template for base models "
            "(set model.template to choose)"
        )
    lead = "chat template matches no LLaMA-Factory template" if folder.chat_template else "no chat template"
    for name, why in hints:
        if name in pool:
            return name, f"{lead}; {why}"
    kind = f"model_type {folder.model_type}" if folder.model_type else "no model_type"
    return (
        BUILTIN_TEMPLATE,
        f"{lead} and {kind} names none: {BUILTIN_TEMPLATE} (set model.template to choose)",
    )


def check(template: str, model_dir: str | Path) -> None:
    """Raise TemplateError when `template` does not fit the folder, naming a template that does."""
    folder = read_folder(model_dir)
    problem = processor_problem(template, folder)
    if problem:
        raise TemplateError(problem)
    problems = fit_problems(template, folder)
    if problems:
        try:
            fitting, why = resolve(model_dir)
        except Exception:  # noqa: BLE001 - the suggestion is a courtesy
            fitting, why = None, ""
        advice = (
            f"set model.template: {fitting} ({why})"
            if fitting and fitting != template
            else "choose another model.template"
        )
        raise TemplateError(
            f"template {template!r} does not fit the tokenizer in {folder.path}: "
            + "; ".join(problems)
            + f"; {advice}"
        )


def contradiction(template: str, model_dir: str | Path) -> str | None:
    """A warning when a named template formats the probe conversations unlike the folder's own chat
    template while another LLaMA-Factory template matches it better (llama2 on Mistral-v0.3, whose
    chat template matches mistral): training would teach the model another format than its own."""
    folder = read_folder(model_dir)
    specs = table()["templates"]
    if template == AUTO or template not in specs or not folder.chat_template:
        return None
    try:
        best, why = resolve(model_dir)
    except TemplateError as exc:  # a chat template over its budget: the named template is used as is
        return f"{exc}; not compared with model.template {template}"
    if best == template or not why.startswith(f"chat template matches {best} "):
        return None
    rendered, always = render_probes(folder)
    mine = _matching(specs[template], folder, rendered, always)
    if len(mine) >= len(_matching(specs[best], folder, rendered, always)):
        return None
    return (
        f"template {template!r} renders {len(rendered) - len(mine)} of {len(rendered)} probe conversations "
        f"unlike the chat template in {folder.chat_template_file}, which matches {best} ({why}): the model "
        f"would be trained on {template}'s format, not its own; set model.template: {best} (or auto) "
        "unless that is meant"
    )


def resolved(template: str, model_dir: str | Path | None) -> tuple[str, str]:
    """(name, why): `template` itself unless it is auto."""
    if template != AUTO:
        return template, "model.template"
    if model_dir is None:
        return BUILTIN_TEMPLATE, f"the builtin model's template is {BUILTIN_TEMPLATE}"
    return resolve(model_dir)


def for_model(model: Model, model_dir: str | Path | None) -> tuple[str, str]:
    """(name, why) of the model section's template for the model in `model_dir` (the builtin
    model's folder is built by the pipeline: its template is known, whatever its files say)."""
    return _for(model.name_or_path, model.template, model_dir)


def _for(name_or_path: str, template: str, model_dir: str | Path | None) -> tuple[str, str]:
    from llmft.core.config import BUILTIN_MODEL

    return resolved(template, None if name_or_path == BUILTIN_MODEL else model_dir)


def for_workflow(model_cfg: Model, workdir: str | Path) -> tuple[str, str]:
    """(name, why) of the template every stage gets, as the workflow resolves it when its DAG is
    built: auto picked from the model folder (relative to `workdir`), and the pick, or a named
    template, checked to fit that folder's tokenizer. The builtin model is built by a rule:
    prepare_data checks its fit."""
    from llmft.core.config import BUILTIN_MODEL

    model = model_cfg.name_or_path
    model_dir = None if model == BUILTIN_MODEL else Path(workdir) / model  # an absolute path stays
    try:
        template, why = resolved(model_cfg.template, model_dir)
        if model_dir is not None:
            check(template, model_dir)
            # A named template that contradicts the folder's own chat template: warned, the run goes on.
            warning = contradiction(model_cfg.template, model_dir)
            if warning:
                print(f"llmft: warning: config key model.template: {warning}", file=sys.stderr)
    except ConfigError as exc:
        raise ConfigError(f"config key model.template: {exc}") from None
    return template, why


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Regenerate lf_templates.json, or pick a template for a folder")
    ap.add_argument(
        "--write", action="store_true", help=f"write {TABLE.name} from the installed LLaMA-Factory"
    )
    ap.add_argument("folder", nargs="?", help="a model folder: print the template auto picks and why")
    args = ap.parse_args()
    if args.write:
        data = build_table()
        TABLE.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {TABLE} (LLaMA-Factory {data['llamafactory']}, {len(data['templates'])} templates)")
    if args.folder:
        name, why = resolve(args.folder)
        print(f"{name}: {why}")


if __name__ == "__main__":
    main()
