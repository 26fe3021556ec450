"""Tokenize SFT rows exactly as LLaMA-Factory 0.9.5 does, in batches, and save them where its
`tokenized_path` loads them.

LLaMA-Factory encodes a row piece by piece: its template turns each message into strings and
special tokens, and every string goes through `tokenizer.encode` on its own (a few calls a row, each
wrapped in tens of microseconds of Python around a fast Rust call). Here the same template code runs
against a recording tokenizer that only collects those strings; all strings of a chunk are then
encoded in one batched call of the Rust tokenizer and spliced back. Because the template logic is
LLaMA-Factory's own, every template (reasoning, efficient-EOS, replaced EOS) is reproduced; the tests
compare the result with LLaMA-Factory's own preprocessing row by row.

Rows longer than `cutoff_len` are dropped before this point, so LLaMA-Factory's truncation never
applies and is not reproduced.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass
from itertools import chain
from pathlib import Path

import numpy as np
from llmft.core import conversation
from llmft.core.conversation import messages as messages_of  # noqa: F401 - the name callers and tests use
from llmft.core.lf.fasttok import FastPath, SpanTable, gather

log = logging.getLogger("llmft.core.lf.pretokenize")

IGNORE_INDEX = -100
TOKENIZED_DIR = "tokenized"
BPE_WORD_CACHE = 200_000

# LLaMA-Factory arguments that change what its preprocessing produces, with their defaults. When
# `sft.extra` sets one of them to another value, the pre-tokenized data would no longer be what
# LLaMA-Factory makes, so sft tokenizes itself instead (tests check this table against LLaMA-Factory).
PREPROCESSING_DEFAULTS = {
    "train_on_prompt": False,
    "mask_history": False,
    "packing": None,
    "neat_packing": False,
    "tool_format": None,
    "default_system": None,
    "enable_thinking": True,
    "preserve_thinking": False,
    "streaming": False,
    "max_samples": None,
    "val_size": 0.0,
    "mix_strategy": "concat",
    "interleave_probs": None,
    "eval_on_each_dataset": False,
    "predict_with_generate": False,
    "use_fast_tokenizer": True,
    "split_special_tokens": False,
    "add_tokens": None,
    "add_special_tokens": None,
    "new_special_tokens_config": None,
}


def blockers(extra: dict) -> list[str]:
    """Keys of `sft.extra` that make the pre-tokenized data differ from LLaMA-Factory's own."""
    out = []
    for key, value in extra.items():
        if key not in PREPROCESSING_DEFAULTS:
            continue
        default = PREPROCESSING_DEFAULTS[key]
        if value == default or (key == "packing" and value is False):
            continue
        out.append(key)
    return sorted(out)


def load_tokenizer_and_template(tokenizer_dir: str | Path, template_name: str):
    """The tokenizer as LLaMA-Factory loads it for training, fixed by the template (EOS, pad)."""
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(tokenizer_dir), use_fast=True, split_special_tokens=False, padding_side="right"
    )
    template = get_template_and_fix_tokenizer(tokenizer, DataArguments(template=template_name))
    return tokenizer, template


def load_processor(tokenizer_dir: str | Path, tokenizer, template_name: str):
    """The model's processor as LLaMA-Factory's `load_tokenizer` loads and patches it; None for a
    text-only template (its plugin never reads it). A multimodal template needs it even for text
    rows: without it, stop here naming the folder and the text-only template to use."""
    from llmft.core.lf.chat_templates import TemplateError, is_multimodal, processor_problem, read_folder

    if not is_multimodal(template_name):
        return None
    problem = processor_problem(template_name, read_folder(tokenizer_dir))
    if problem:
        raise TemplateError(problem)
    from llamafactory.hparams import ModelArguments
    from llamafactory.model.patcher import patch_processor
    from transformers import AutoProcessor

    try:
        try:
            processor = AutoProcessor.from_pretrained(str(tokenizer_dir), use_fast=True)
        except ValueError:  # LLaMA-Factory tries the other kind
            processor = AutoProcessor.from_pretrained(str(tokenizer_dir), use_fast=False)
    except Exception as exc:  # noqa: BLE001 - named in the message below
        raise TemplateError(
            f"template {template_name!r} is multimodal and needs the processor of {tokenizer_dir}, which "
            f"transformers cannot load ({type(exc).__name__}: {exc})"
        ) from None
    if "Processor" not in type(processor).__name__:  # as LLaMA-Factory: a bare tokenizer is none
        raise TemplateError(
            f"template {template_name!r} is multimodal, but {tokenizer_dir} loads as a "
            f"{type(processor).__name__}, not a processor (no processor_config.json or "
            "preprocessor_config.json)"
        )
    patch_processor(processor, tokenizer, ModelArguments(model_name_or_path=str(tokenizer_dir)))
    return processor


class _Recorder:
    """Stands in for the tokenizer inside the template: `encode` returns the text itself as a
    placeholder; everything else (special token ids, EOS) is the real tokenizer's."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        # Read on every row by the template; transformers' attribute lookup is slow, so look once.
        self.bos_token_id = tokenizer.bos_token_id
        self.eos_token_id = tokenizer.eos_token_id
        self._token_ids: dict[str, int] = {}

    def convert_tokens_to_ids(self, token):
        if not isinstance(token, str):
            return self._tokenizer.convert_tokens_to_ids(token)
        if token not in self._token_ids:
            self._token_ids[token] = self._tokenizer.convert_tokens_to_ids(token)
        return self._token_ids[token]

    def encode(self, text: str, add_special_tokens: bool = False, **_) -> list:
        if add_special_tokens:
            raise AssertionError("LLaMA-Factory templates encode without special tokens")
        return [text]

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@dataclass
class Encoded:
    """A chunk of rows as flat arrays: row i is ids[offsets[i]:offsets[i + 1]]."""

    ids: np.ndarray  # int32, as LLaMA-Factory's dataset stores input_ids
    labels: np.ndarray  # int64
    offsets: np.ndarray  # int64, len(rows) + 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def select(self, keep: np.ndarray) -> Encoded:
        """The rows where `keep` is true, in order."""
        lengths = self.lengths[keep]
        element_mask = np.repeat(keep, self.lengths)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Encoded(self.ids[element_mask], self.labels[element_mask], offsets)


def _fill(part: list, values: list[str]) -> list:
    """A planned element list with the row's texts in place; empty strings dropped, as the
    template drops them."""
    out = []
    for elem in part:
        if type(elem) is tuple:
            elem = elem[0] + values[elem[1]] + elem[2]
            if elem:
                out.append(elem)
        else:
            out.append(elem)
    return out


class SFTEncoder:
    """input_ids and labels of SFT rows, equal to LLaMA-Factory's SupervisedDatasetProcessor output."""

    def __init__(self, tokenizer_dir: str | Path, template_name: str):
        from llamafactory.data.formatter import EmptyFormatter, StringFormatter
        from llamafactory.data.mm_plugin import BasePlugin
        from llamafactory.data.template import Template
        from tokenizers import Tokenizer, models

        self.tokenizer, self.template = load_tokenizer_and_template(tokenizer_dir, template_name)
        self.processor = load_processor(tokenizer_dir, self.tokenizer, template_name)
        self._recorder = _Recorder(self.tokenizer)
        self._eos = self.tokenizer.eos_token_id
        if self.tokenizer.is_fast:
            # A private copy of the Rust tokenizer, set up the way transformers' `encode` sets it up
            # for every call: no truncation, no padding, special tokens split or not as configured.
            backend = Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
            backend.no_truncation()
            backend.no_padding()
            backend.encode_special_tokens = bool(self.tokenizer.split_special_tokens)
            if isinstance(backend.model, models.BPE):
                # BPE memoises words; its default 10k entries thrash on real vocabularies. A larger
                # memo changes no output, only speed.
                backend.model._resize_cache(BPE_WORD_CACHE)
            self._backend = backend
            self._fast, why = FastPath.for_tokenizer(backend)
            log.info("ASCII shortcut %s: %s", "on" if self._fast else "off", why)
            self._fast_checked = False
        else:
            self._backend = self._fast = None
            why = "slow (Python) tokenizer"
        self.ascii_shortcut_reason = why
        # Plain templates (formatters that only substitute texts, no media plugin) can be planned
        # once per row shape instead of run per row.
        tpl = self.template
        self._plain = (
            type(tpl) is Template
            and type(tpl.mm_plugin) is BasePlugin
            and all(
                type(f) in (StringFormatter, EmptyFormatter)
                for f in (tpl.format_user, tpl.format_assistant, tpl.format_system, tpl.format_prefix)
            )
        )
        self._plans: dict[tuple[int, bool], list] = {}
        self._constants: dict[str, list[int]] = {}  # template strings without row text, encoded once
        # Token ids of pieces, constants and special tokens for the chunk-at-once path (_encode_chunk).
        self._table = SpanTable(self._key_ids)

    @property
    def ascii_shortcut(self) -> bool:
        """Whether the ASCII shortcut (fasttok.FastPath) encodes texts: decided for the tokenizer,
        and turned off for good when the first chunk's check finds a difference."""
        return self._fast is not None

    def _check_fast(self, texts: list[str]) -> None:
        """Once per process, on the probes and the first chunk's first distinct texts: any
        difference from the tokenizer, no shortcut."""
        self._fast_checked = True
        differ = self._fast.check(self._backend, texts[:256])
        if differ:
            log.warning("ASCII shortcut off: differs from the tokenizer on %r", differ[0][:200])
            self._fast = None
            self.ascii_shortcut_reason = f"differs from the tokenizer on {differ[0][:80]!r}"

    def _first_texts(self, rows: list[dict], n: int = 256) -> list[str]:
        """The first `n` distinct strings the general path would encode for `rows`, in its order."""
        seen: dict[str, None] = {}
        for row in rows:
            for src, tgt in (self._planned_pairs(row) or self._template_pairs(row))[2]:
                for part in (src, tgt):
                    for elem in part:
                        if isinstance(elem, str):
                            seen.setdefault(elem)
            if len(seen) >= n:
                break
        return list(seen)[:n]

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        if self._backend is None:  # slow tokenizers: what LLaMA-Factory does, one call per string
            return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        if self._fast is not None and not self._fast_checked:
            self._check_fast(texts)
        fast = self._fast
        if fast is None:
            return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]
        out: list = [None] * len(texts)
        rest = []
        for i, text in enumerate(texts):
            if fast.takes(text):
                out[i] = fast.encode(text)
            else:
                rest.append(i)
        if rest:
            encoded = self._backend.encode_batch_fast([texts[i] for i in rest], add_special_tokens=False)
            for i, enc in zip(rest, encoded, strict=True):
                out[i] = enc.ids
        return out

    def _template_pairs(self, row: dict) -> tuple[list, list, list]:
        """(prefix ids, prefix labels, [(prompt elements, answer elements)]) by running the template."""
        plugin = self.template.mm_plugin
        msgs = plugin.process_messages(conversation.messages(row), [], [], [], self.processor)
        prefix_ids, prefix_labels = plugin.process_token_ids(
            [], [], [], [], [], self.tokenizer, self.processor
        )
        # Tool rows pass their tools: the template formats them into the system turn (the recorder
        # sees the formatters' strings like any other text).
        system, tools = conversation.system(row), conversation.tools(row)
        pairs = self.template.encode_multiturn(self._recorder, msgs, system, tools)
        return prefix_ids, prefix_labels, pairs

    def _planned_pairs(self, row: dict) -> tuple[list, list, list] | None:
        """The same from a per-shape plan: the template run once with markers in place of the texts,
        the markers then replaced by each row's texts. Exact for plain templates, whose formatters
        only substitute {{content}}; None (run the template) for anything else, tool rows included."""
        if not self._plain or "messages" in row:
            return None
        contents = [c for pair in row.get("history") or () for c in pair]
        contents += ["\n".join(t for t in (row["instruction"], row.get("input", "")) if t), row["output"]]
        system = row.get("system") or ""
        # A text holding a marker or a placeholder would be read differently by the formatters.
        if any("\x00" in c or "{{" in c for c in (*contents, system)):
            return None
        key = (len(contents), bool(system))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(*key)
        values = contents + [system]
        pairs = []
        for src, tgt in plan:
            pairs.append(tuple(_fill(part, values) for part in (src, tgt)))
        return [], [], pairs

    def _make_plan(self, n_messages: int, has_system: bool) -> list:
        msgs = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"\x00{i}\x00"}
            for i in range(n_messages)
        ]
        system_marker = f"\x00{n_messages}\x00" if has_system else ""
        pairs = self.template.encode_multiturn(self._recorder, msgs, system_marker, "")
        marker = re.compile(r"\x00(\d+)\x00")
        plan = []
        for src, tgt in pairs:
            compiled = []
            for part in (src, tgt):
                out = []
                for elem in part:
                    if not isinstance(elem, str):
                        out.append(elem)
                        continue
                    found = marker.findall(elem)
                    if len(found) > 1:
                        raise AssertionError(f"two texts in one template string: {elem!r}")
                    if found:
                        head, tail = marker.split(elem)[0], marker.split(elem)[2]
                        out.append((head, int(found[0]), tail))
                    else:
                        out.append(elem)
                compiled.append(out)
            plan.append(tuple(compiled))
        return plan

    def _assemble(self, prefix_ids: list, prefix_labels: list, turns: list) -> tuple[list[int], list[int]]:
        """input_ids and labels from each turn's (prompt ids, answer ids), as the SFT processor
        builds them when nothing is truncated."""
        ids, labels = list(prefix_ids), list(prefix_labels)
        efficient_eos = self.template.efficient_eos
        for turn, (src_ids, tgt_ids) in enumerate(turns):
            ids += src_ids
            ids += tgt_ids
            if efficient_eos and turn != 0:
                labels += [self._eos] + [IGNORE_INDEX] * (len(src_ids) - 1)
            else:
                labels += [IGNORE_INDEX] * len(src_ids)
            labels += tgt_ids
        if efficient_eos:
            ids.append(self._eos)
            labels.append(self._eos)
        return ids, labels

    def _encode_rows(self, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
        """Any rows: template (or plan) per row, then every distinct string of the chunk in one call."""
        plans = []
        pieces: dict[str, int] = {}
        for row in rows:
            prefix_ids, prefix_labels, pairs = self._planned_pairs(row) or self._template_pairs(row)
            for src, tgt in pairs:
                for part in (src, tgt):
                    for elem in part:
                        if isinstance(elem, str) and elem not in pieces:
                            pieces[elem] = len(pieces)
            plans.append((prefix_ids, prefix_labels, pairs))
        encoded = self._encode_texts(list(pieces))

        def expand(part: list) -> list[int]:
            out: list[int] = []
            for elem in part:
                if isinstance(elem, str):
                    out += encoded[pieces[elem]]
                else:
                    out.append(elem)
            return out

        return [
            self._assemble(prefix_ids, prefix_labels, [(expand(src), expand(tgt)) for src, tgt in pairs])
            for prefix_ids, prefix_labels, pairs in plans
        ]

    def _direct(self, row: dict) -> tuple[list[int], list[int]] | None:
        """The common case in one pass: a plain template's plan, texts through the ASCII shortcut.
        None when a text needs the general path (not plain ASCII, holds a marker, a tool row, ...)."""
        if "messages" in row:
            return None
        contents = [c for pair in row.get("history") or () for c in pair]
        contents += ["\n".join(t for t in (row["instruction"], row.get("input", "")) if t), row["output"]]
        system = row.get("system") or ""
        values = contents + [system]
        if any("\x00" in v or "{{" in v for v in values):
            return None
        key = (len(contents), bool(system))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(*key)
        fast, constants = self._fast, self._constants
        turns = []
        for parts in plan:
            turn = []
            for part in parts:
                out: list[int] = []
                for elem in part:
                    if type(elem) is tuple:
                        text = elem[0] + values[elem[1]] + elem[2]
                        if text:
                            if not fast.takes(text):
                                return None
                            out += fast.encode(text)
                    elif type(elem) is str:
                        if elem not in constants:
                            constants[elem] = self._encode_texts([elem])[0]
                        out += constants[elem]
                    else:
                        out.append(elem)
                turn.append(out)
            turns.append(turn)
        return self._assemble([], [], turns)

    def _key_ids(self, key) -> tuple[int, ...]:
        if type(key) is int:  # a special token of the template
            return (key,)
        if key[0] == "\x01":  # a template string without row text
            return tuple(self._encode_texts([key[1:]])[0])
        return self._fast.key_ids(key)

    def _encode_chunk(self, rows: list[dict]) -> tuple[Encoded, list[int]]:
        """What `_direct` makes of each row, for a whole chunk at once: every row becomes a run of
        keys (pieces of its texts, template constants, special tokens) whose token ids are gathered
        from the SpanTable in one numpy call. Returns the encoded rows and the indices of the rows it
        did not take (they need the general path), which the Encoded leaves out."""
        fast, plans = self._fast, self._plans
        keys: list = []
        part_keys: list[int] = []  # keys per template part
        part_labels: list[bool] = []  # the part's tokens are labels (answer) or masked (prompt)
        row_keys: list[int] = []
        rest: list[int] = []
        for index, row in enumerate(rows):
            if "messages" in row:  # tool rows: the template's own run
                rest.append(index)
                continue
            contents = [c for pair in row.get("history") or () for c in pair]
            contents += ["\n".join(t for t in (row["instruction"], row.get("input", "")) if t), row["output"]]
            system = row.get("system") or ""
            values = contents + [system]
            if any("\x00" in v or "{{" in v for v in values):
                rest.append(index)
                continue
            key = (len(contents), bool(system))
            plan = plans.get(key)
            if plan is None:
                plan = plans[key] = self._make_plan(*key)
            first_key, first_part = len(keys), len(part_keys)
            taken = True
            for parts in plan:
                for label, part in zip((False, True), parts, strict=True):
                    before = len(keys)
                    for elem in part:
                        kind = type(elem)
                        if kind is tuple:
                            text = elem[0] + values[elem[1]] + elem[2]
                            if text:
                                if not fast.takes(text):
                                    taken = False
                                    break
                                keys += fast.keys(text)
                        elif kind is str:
                            keys.append("\x01" + elem)
                        else:
                            keys.append(elem)
                    if not taken:
                        break
                    part_keys.append(len(keys) - before)
                    part_labels.append(label)
                if not taken:
                    break
            if not taken:
                del keys[first_key:], part_keys[first_part:], part_labels[first_part:]
                rest.append(index)
                continue
            row_keys.append(len(keys) - first_key)
        table = self._table
        idx = table.lookup(keys)
        lengths = table.length[idx]
        ids = gather(table.tokens, table.start[idx], lengths)
        is_label = np.repeat(np.repeat(np.array(part_labels, dtype=bool), part_keys), lengths)
        labels = np.where(is_label, ids.astype(np.int64), IGNORE_INDEX)
        token_ends = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(lengths, out=token_ends[1:])
        key_ends = np.zeros(len(row_keys) + 1, dtype=np.int64)
        np.cumsum(row_keys, out=key_ends[1:])
        return Encoded(ids, labels, token_ends[key_ends]), rest

    def encode(self, rows: list[dict]) -> Encoded:
        results: list = [None] * len(rows)
        if self._plain and self._fast is not None and not self._fast_checked:
            self._check_fast(self._first_texts(rows))
        if self._plain and self._fast is not None:
            if not self.template.efficient_eos:
                chunk, rest = self._encode_chunk(rows)
                if not rest:
                    return chunk
                return _merge(chunk, self._encode_list([rows[i] for i in rest]), rest, len(rows))
            results = [self._direct(row) for row in rows]
        rest = [i for i, r in enumerate(results) if r is None]
        if rest:
            for i, done in zip(rest, self._encode_rows([rows[i] for i in rest]), strict=True):
                results[i] = done
        return _as_arrays(results)

    def _encode_list(self, rows: list[dict]) -> Encoded:
        return _as_arrays(self._encode_rows(rows))


def _as_arrays(results: list[tuple[list[int], list[int]]]) -> Encoded:
    offsets = np.zeros(len(results) + 1, dtype=np.int64)
    np.cumsum([len(ids) for ids, _ in results], out=offsets[1:])
    return Encoded(
        np.array(list(chain.from_iterable(ids for ids, _ in results)), dtype=np.int32),
        np.array(list(chain.from_iterable(labels for _, labels in results)), dtype=np.int64),
        offsets,
    )


def _merge(first: Encoded, second: Encoded, second_rows: list[int], n: int) -> Encoded:
    """Rows of two Encoded interleaved: `second` holds rows `second_rows` of n, `first` the others."""
    from_second = np.zeros(n, dtype=bool)
    from_second[second_rows] = True
    lengths = np.empty(n, dtype=np.int64)
    lengths[~from_second] = first.lengths
    lengths[from_second] = second.lengths
    starts = np.empty(n, dtype=np.int64)
    starts[~from_second] = first.offsets[:-1]
    starts[from_second] = second.offsets[:-1] + len(first.ids)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Encoded(
        gather(np.concatenate((first.ids, second.ids)), starts, lengths),
        gather(np.concatenate((first.labels, second.labels)), starts, lengths),
        offsets,
    )


# -- the saved dataset: the layout `datasets.DatasetDict.save_to_disk` writes and LLaMA-Factory's
#    `tokenized_path` loads, with the features LLaMA-Factory's preprocessing produces.


def features():
    from datasets import Features, List, Value

    return Features(
        {
            "input_ids": List(Value("int32")),
            "attention_mask": List(Value("int8")),
            "labels": List(Value("int64")),
            "images": Value("null"),
            "videos": Value("null"),
            "audios": Value("null"),
        }
    )


def record_batch(enc: Encoded):
    """One Arrow record batch of encoded rows, built from the flat arrays without Python loops."""
    import pyarrow as pa

    n = len(enc.offsets) - 1
    offsets = pa.array(enc.offsets.astype(np.int32))
    return pa.RecordBatch.from_arrays(
        [
            pa.ListArray.from_arrays(offsets, pa.array(enc.ids, type=pa.int32())),
            pa.ListArray.from_arrays(offsets, pa.array(np.ones(len(enc.ids), dtype=np.int8))),
            pa.ListArray.from_arrays(offsets, pa.array(enc.labels, type=pa.int64())),
            pa.nulls(n),
            pa.nulls(n),
            pa.nulls(n),
        ],
        schema=arrow_schema(),
    )


def arrow_schema():
    return features().arrow_schema


class SplitWriter:
    """Streams record batches into one split folder of a saved DatasetDict."""

    FILE = "data-00000-of-00001.arrow"

    def __init__(self, folder: Path):
        from datasets.arrow_writer import ArrowWriter

        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._writer = ArrowWriter(features=features(), path=str(folder / self.FILE))

    def write(self, batch) -> None:
        import pyarrow as pa

        if batch.num_rows:
            self._writer.write_table(pa.Table.from_batches([batch]))

    def close(self) -> int:
        from datasets import Dataset

        rows, _ = self._writer.finalize()
        self._writer.close()
        ds = Dataset.from_file(str(self.folder / self.FILE))
        # The two metadata files exactly as Dataset.save_to_disk writes them.
        state = {k: ds.__dict__[k] for k in ("_fingerprint", "_format_columns", "_format_kwargs")}
        state.update(
            {
                "_format_type": ds.__dict__["_format_type"],
                "_output_all_columns": ds.__dict__["_output_all_columns"],
                "_split": None,
                "_data_files": [{"filename": self.FILE}],
            }
        )
        (self.folder / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
        info = asdict(ds.info)
        (self.folder / "dataset_info.json").write_text(
            json.dumps({k: info[k] for k in sorted(info)}, indent=2)
        )
        return rows


def write_dataset_dict(folder: Path, splits: list[str]) -> None:
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": splits}))
