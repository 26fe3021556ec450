"""Preference data for LLaMA-Factory's dpo (pairs) and kto (tagged rows) stages: read, validate row by
row, dedup, split stably, and tokenize once as LLaMA-Factory's PairwiseDatasetProcessor /
FeedbackDatasetProcessor do.

Sources have the shapes of `data.sources` (a file with a format, or a LLaMA-Factory dataset_info.json
entry) and are read by the same code (sources.iter_raw, lfdataset). Row shapes, as LLaMA-Factory's
converters read them:

- pairs, alpaca: instruction, input, chosen, rejected (strings), optional system and history;
- pairs, sharegpt: conversations (or messages) ending with a user turn, chosen and rejected message
  objects whose role is an assistant (or function_call) role;
- KTO, alpaca: instruction, input, output and a boolean tag; KTO, sharegpt: conversations ending with
  the answer and a boolean tag. The tag column is `kto_tag` (or `label`, as LLaMA-Factory's
  kto_en_demo spells it; a row whose boolean `label` contradicts its `kto_tag` is refused); a
  dataset_info entry names it in columns.kto_tag.

The prompt and each answer go through the SFT row checks (sources.check_alpaca / check_sharegpt), so
a bad field is named as for SFT rows. Every row-level fault is a RowError: under invalid_rows: drop the
row goes to rejected.jsonl with its reason, under fail the stage stops after listing every bad row,
as prepare_data does. What is wrong with a whole source (a file that cannot be read, pairs and KTO
rows in one run) stops the stage.

Canonical rows (train.jsonl, heldout.jsonl; LLaMA-Factory's default sharegpt tags):
  pairs {"messages": [{"from": "human", "value": ...}, ...], "chosen": {"from": "gpt", "value": ...},
         "rejected": {...}, optional "system", "tools"}
  KTO   {"messages": [..., the user turn, the answer], "kto_tag": true|false, optional "system", "tools"}

Tokens: LLaMA-Factory's processors through `datasets`' map, as its loader runs them. Pairs are
encoded once, untruncated, to measure them; a pair that fits is not cut, so that encoding is saved,
with one column more than LLaMA-Factory's: the pair's length (LENGTH_COLUMN).
KTO rows are encoded again in their split's order: the KL pairs depend on batch neighbours. The rows
are held in memory (preference sets are small next to SFT corpora).

Identity and split: a row's dedup key is its normalised content (prompt + chosen + rejected, or prompt +
completion + tag); its side of the split is decided by its prompt's content with core.heldout.is_heldout,
so every pair of one prompt sits on one side, and adding rows never moves a row across the split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import random
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from llmft.core.conversation import DEFAULT_SHAREGPT_TAG, ROLE_OF
from llmft.core.dedup import SeenKeys
from llmft.core.heldout import is_heldout
from llmft.core.io import write_json
from llmft.core.lf import lfdataset
from llmft.core.sources import (
    BAD_FUNCTION_CALL,
    BAD_TOOLS,
    MISSING,
    NOT_AN_OBJECT,
    ROLE_ORDER,
    UNKNOWN_ROLE,
    WRONG_TYPE,
    DataError,
    FileError,
    RowError,
    _Invalid,
    formatter_problem,
    iter_raw,
    validate,
)
from llmft.core.text import normalise
from llmft.preference.stage import LENGTH_COLUMN

log = logging.getLogger("llmft.preference.data")

PAIRS, KTO = "pairs", "kto"
TRAIN_NAME, HELDOUT_NAME = "llmft_pref_train", "llmft_pref_heldout"
BUILTIN = {"builtin:synthetic_pairs": PAIRS, "builtin:synthetic_kto": KTO}
TAG_COLUMNS = ("kto_tag", "label")
# Reason codes of preference rows, beside sources.py's.
SAME_ANSWER = "chosen_equals_rejected"
MIXED_FORMAT = "mixed_format"
BAD_TAG = "bad_tag"
TOO_LONG = "too_long"
DUPLICATE = "duplicate"
EXAMPLES_KEPT = 20


# -- the builtin task


def _question(rng: random.Random) -> tuple[str, str, str, str, str]:
    """(task, instruction, input, right answer, wrong answer): a word's category or the number of
    words in a list, asked in words the SFT demo's data never uses, so the preference stage teaches
    something sft did not."""
    from llmft.core.words import CATEGORIES, NUMBER_WORDS, WORDS

    if rng.random() < 0.5:
        word = rng.choice(WORDS)
        right = next(c for c, ws in CATEGORIES.items() if word in ws)
        wrong = rng.choice([c for c in CATEGORIES if c != right])
        return "category", f"Name the category of {word}.", "", right, wrong
    words = rng.sample(WORDS, rng.randint(2, 5))
    wrong = rng.choice([w for k, w in NUMBER_WORDS.items() if k != len(words)])
    return "count", "Count the words.", " ".join(words), NUMBER_WORDS[len(words)], wrong


def synthetic_rows(n: int, kind: str = PAIRS, seed: int = 0) -> list[dict]:
    """n rows of the builtin preference task (alpaca rows with the task label), each question once:
    as pairs, the right answer chosen and a wrong one of the same kind rejected; as KTO rows, each
    question twice, the right answer tagged desirable and a wrong one undesirable."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        task, instruction, words, right, wrong = _question(rng)
        if (instruction, words) in seen:
            continue
        seen.add((instruction, words))
        base = {"instruction": instruction, "input": words, "task": task}
        if kind == PAIRS:
            out.append({**base, "chosen": right, "rejected": wrong})
        else:
            out.append({**base, "output": right, "kto_tag": True})
            out.append({**base, "output": wrong, "kto_tag": False})
    return out[:n]


# -- rows


def _shape(raw: dict, attr: dict | None) -> tuple[str | None, str]:
    """(kind: pairs, kto or None, the form the row is written in: alpaca or sharegpt)."""
    if attr is not None:
        kind = PAIRS if attr.get("ranking") else KTO if attr.get("kto_tag") else None
        return kind, attr["formatting"]
    if "chosen" in raw or "rejected" in raw:
        kind = PAIRS
    elif any(c in raw for c in TAG_COLUMNS):
        kind = KTO
    else:
        kind = None
    form = (
        "sharegpt" if ("conversations" in raw or "messages" in raw) and "instruction" not in raw else "alpaca"
    )
    return kind, form


def _tag_column(raw: dict, attr: dict | None) -> str:
    if attr is not None:
        return attr["kto_tag"]
    return next((c for c in TAG_COLUMNS if c in raw), TAG_COLUMNS[0])


def _answer_text(value, field: str, fmt: str, attr: dict | None) -> tuple[str, str]:
    """(role tag, text) of a chosen/rejected value: a string (alpaca) or a message object (sharegpt)."""
    if fmt == "alpaca":
        if value is None:
            raise _Invalid(MISSING, "is missing", field)
        if not isinstance(value, str):
            raise _Invalid(WRONG_TYPE, f"must be a string, got {type(value).__name__}", field)
        return "gpt", value
    role_key = attr["role_tag"] if attr else "from"
    content_key = attr["content_tag"] if attr else "value"
    if value is None:
        raise _Invalid(MISSING, "is missing", field)
    if not isinstance(value, dict):
        raise _Invalid(WRONG_TYPE, f"must be a message object, got {type(value).__name__}", field)
    if attr is None and role_key not in value and "role" in value:
        role_key, content_key = "role", "content"
    role = value.get(role_key)
    # LLaMA-Factory's converter takes the roles of its even (answer) positions here
    answer_roles = (
        {"gpt", "assistant", "function_call"}
        if attr is None
        else {attr["assistant_tag"], attr["function_tag"]}
    )
    if role not in answer_roles:
        known = ", ".join(sorted(map(str, answer_roles)))
        raise _Invalid(UNKNOWN_ROLE, f"role {role!r} is not an answer role ({known})", f"{field}.{role_key}")
    tag = "function_call" if role in ("function_call", (attr or {}).get("function_tag")) else "gpt"
    return tag, value.get(content_key)


def _sft_check(prompt_raw: dict, answer: tuple[str, str] | None, fmt: str, source, number, clean):
    """The SFT checks on the prompt with one answer appended: (canonical messages, system, tools)."""
    raw = dict(prompt_raw)
    if fmt == "alpaca":
        raw["output"] = answer[1] if answer else raw.get("output")
    else:
        field = "conversations" if raw.get("conversations") is not None else "messages"
        role_key, content_key = ("from", "value") if field == "conversations" else ("role", "content")
        conv = raw.get(field)
        if answer and isinstance(conv, list):
            role = (
                answer[0]
                if field == "conversations"
                else ("assistant" if answer[0] == "gpt" else "function_call")
            )
            raw[field] = [*conv, {role_key: role, content_key: answer[1]}]
    row = validate(source, number, raw, fmt, clean)
    if isinstance(row, RowError):
        return row
    from llmft.core import conversation

    tag = DEFAULT_SHAREGPT_TAG
    msgs = [{"from": tag[m["role"]], "value": m["content"]} for m in conversation.messages(row)]
    return msgs, conversation.system(row), conversation.tools(row)


def _rename(err: RowError, n_turns: int, side: str, fmt: str, attr: dict | None) -> RowError:
    """A check's error named as the file names it: on the appended answer turn, the chosen or
    rejected column; elsewhere, a dataset_info entry's column names."""
    if not err.field:
        return err
    if fmt == "alpaca" and err.field == "output":
        return dataclasses.replace(err, field=side)
    for field in ("conversations", "messages"):
        prefix = f"{field}[{n_turns + 1}]"
        if err.field.startswith(prefix):
            rest = err.field[len(prefix) :]
            if attr is not None:
                rest = rest.replace(".value", "." + attr["content_tag"])
            return dataclasses.replace(err, field=side + rest)
    if attr is not None:
        return dataclasses.replace(err, field=lfdataset.field_name(err.field, attr))
    return err


def check_row(source: str, number: int, raw: object, fmt: str, attr: dict | None, clean: bool = True):
    """(kind, canonical row) or a RowError naming row, field and reason. `fmt`: the source's
    format (alpaca or sharegpt); `attr`: a dataset_info entry's columns and tags (lfdataset)."""
    if isinstance(raw, RowError):
        return raw
    if not isinstance(raw, dict):
        return RowError(source, number, NOT_AN_OBJECT, f"expected an object, got {type(raw).__name__}")
    view = raw
    if attr is not None:
        view = lfdataset.view(raw, attr)
    kind, form = _shape(raw, attr)
    try:
        if form != fmt:
            seen = (
                ("conversations" if "conversations" in raw else "messages")
                if form == "sharegpt"
                else "instruction"
            )
            raise _Invalid(MIXED_FORMAT, f"makes it a {form} row in a source of format {fmt}", seen)
        if kind is None:
            raise _Invalid(
                MISSING,
                "is missing: a preference row needs chosen and rejected (a pair) or a boolean kto_tag "
                "(KTO); an SFT row belongs under data.sources",
                "chosen",
            )
        if kind == PAIRS:
            return _pair(source, number, raw, view, fmt, attr, clean)
        return _kto(source, number, raw, view, fmt, attr, clean)
    except _Invalid as exc:
        return RowError(source, number, exc.reason, exc.detail, exc.field)


def _strip(view: dict) -> dict:
    return {k: v for k, v in view.items() if k not in ("chosen", "rejected", *TAG_COLUMNS)}


def _pair(source, number, raw, view, fmt, attr, clean):
    cols = (attr["chosen"], attr["rejected"]) if attr else ("chosen", "rejected")
    # (a text `label`, a topic say, is no KTO tag: only a boolean one is)
    tag = "kto_tag" if "kto_tag" in raw else "label" if isinstance(raw.get("label"), bool) else None
    if tag and attr is None:
        raise _Invalid(
            MIXED_FORMAT, "a KTO tag in a pair row (chosen/rejected): one row is one or the other", tag
        )
    prompt = _strip(view)
    if fmt == "alpaca":
        prompt.pop("output", None)
    conv = prompt.get("conversations", prompt.get("messages"))
    n_turns = len(conv) if isinstance(conv, list) else 0
    if n_turns and isinstance(conv[-1], dict):
        last = conv[-1].get("from", conv[-1].get("role"))
        if last in ("gpt", "assistant", "function_call"):
            field = "conversations" if "conversations" in prompt else "messages"
            detail = (
                f"ends with a {last} turn: a pair's prompt ends with the user turn (the answers are "
                "chosen and rejected)"
            )
            raise _Invalid(ROLE_ORDER, detail, lfdataset.field_name(field, attr) if attr else field)
    sides = {}
    for side, col in zip(("chosen", "rejected"), cols, strict=True):
        answer = _answer_text(raw.get(col), col, fmt, attr)
        done = _sft_check(prompt, answer, fmt, source, number, clean)
        if isinstance(done, RowError):
            err = _rename(done, n_turns, col, fmt, attr)
            raise _Invalid(err.reason, err.detail, err.field)
        sides[side] = done
    msgs, system, tools = sides["chosen"]
    chosen, rejected = msgs[-1], sides["rejected"][0][-1]
    if normalise(chosen["value"]) == normalise(rejected["value"]):
        raise _Invalid(SAME_ANSWER, "equals the chosen answer: the pair prefers nothing", cols[1])
    row = {"messages": msgs[:-1], "chosen": chosen, "rejected": rejected}
    return PAIRS, _extras(row, raw, system, tools)


def _kto(source, number, raw, view, fmt, attr, clean):
    col = _tag_column(raw, attr)
    if attr is None and ("chosen" in raw or "rejected" in raw):
        raise _Invalid(MIXED_FORMAT, "chosen/rejected in a KTO row: one row is one or the other", "chosen")
    tag = raw.get(col)
    if not isinstance(tag, bool):
        # LLaMA-Factory reads a tag that is not a JSON boolean as no tag and drops the row unnamed.
        got = "missing" if tag is None else f"{tag!r} ({type(tag).__name__})"
        raise _Invalid(BAD_TAG, f"must be true (desirable) or false (undesirable), got {got}", col)
    other = raw.get("label") if attr is None and col == "kto_tag" else None
    if isinstance(other, bool) and other != tag:
        raise _Invalid(
            BAD_TAG, f"is {str(other).lower()} but kto_tag is {str(tag).lower()}: one row, one tag", "label"
        )
    done = _sft_check(_strip(view), None, fmt, source, number, clean)
    if isinstance(done, RowError):
        field = lfdataset.field_name(done.field, attr) if attr is not None else done.field
        raise _Invalid(done.reason, done.detail, field)
    msgs, system, tools = done
    return KTO, _extras({"messages": msgs, "kto_tag": tag}, raw, system, tools)


def _extras(row: dict, raw: dict, system: str, tools: str) -> dict:
    if system:
        row["system"] = system
    if tools:
        row["tools"] = tools
    if isinstance(raw.get("task"), str):
        row["task"] = raw["task"]  # the demo's task label, for per-task metrics; never trained on
    return row


# -- identity


def _norm_turns(msgs: list[dict]) -> str:
    return "\x1e".join(m["from"] + "\x1f" + normalise(m["value"]).casefold() for m in msgs)


def prompt_key(row: dict) -> str:
    """Hash of the prompt's normalised content (turns, system, tools): decides the row's side."""
    text = _norm_turns(row["messages"][:-1] if "kto_tag" in row else row["messages"])
    text += (
        "\x1dsystem\x1f"
        + normalise(row.get("system", "")).casefold()
        + "\x1dtools\x1f"
        + row.get("tools", "")
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def content_key(row: dict) -> str:
    """Hash of the whole row's normalised content: prompt + chosen + rejected, or prompt + completion
    + tag. Equal keys are duplicates."""
    if "kto_tag" in row:
        tail = _norm_turns(row["messages"][-1:]) + f"\x1d{row['kto_tag']}"
    else:
        tail = _norm_turns([row["chosen"]]) + "\x1d" + _norm_turns([row["rejected"]])
    return hashlib.sha256(f"{prompt_key(row)}\x1d{tail}".encode()).hexdigest()


# -- LLaMA-Factory's view of canonical rows


def aligned(row: dict) -> dict:
    """What LLaMA-Factory's sharegpt converter makes of a canonical row (_prompt, _response, ...)."""
    msgs = [{"role": ROLE_OF[m["from"]], "content": m["value"]} for m in row["messages"]]
    if "kto_tag" in row:
        empty = {"role": "assistant", "content": ""}
        prompt, response = msgs[:-1], [msgs[-1], empty] if row["kto_tag"] else [empty, msgs[-1]]
    else:
        prompt = msgs
        response = [
            {"role": ROLE_OF[row[s]["from"]], "content": row[s]["value"]} for s in ("chosen", "rejected")
        ]
    return {
        "_prompt": prompt,
        "_response": response,
        "_system": row.get("system", ""),
        "_tools": row.get("tools", ""),
        "_images": None,
        "_videos": None,
        "_audios": None,
    }


def dataset_info(kind: str, train_columns: set, heldout_columns: set) -> dict:
    """LLaMA-Factory's entries for the two splits: sharegpt, default tags; `ranking` for pairs, the
    kto_tag column for KTO rows; system and tools only where rows have them."""

    def entry(file_name: str, extra: set) -> dict:
        cols = {"messages": "messages"}
        cols.update({"chosen": "chosen", "rejected": "rejected"} if kind == PAIRS else {"kto_tag": "kto_tag"})
        cols.update({k: k for k in ("system", "tools") if k in extra})
        out = {"file_name": file_name, "formatting": "sharegpt", "columns": cols}
        if kind == PAIRS:
            out["ranking"] = True
        return out

    return {
        TRAIN_NAME: entry("train.jsonl", train_columns),
        HELDOUT_NAME: entry("heldout.jsonl", heldout_columns),
    }


class Tokenizer:
    """LLaMA-Factory's own PairwiseDatasetProcessor or FeedbackDatasetProcessor for the template, run
    through `datasets`' map with LLaMA-Factory's batch size: KTO's mismatched KL pairs are made
    within each batch of that size, so the batches must be LLaMA-Factory's."""

    def __init__(self, tokenizer_dir: str | Path, template_name: str, kind: str, cutoff_len: int):
        from llamafactory.data.processor import FeedbackDatasetProcessor, PairwiseDatasetProcessor
        from llamafactory.hparams import DataArguments
        from llmft.core.lf.pretokenize import load_processor, load_tokenizer_and_template

        self.tokenizer, self.template = load_tokenizer_and_template(tokenizer_dir, template_name)
        self.kind = kind
        self.data_args = DataArguments(template=template_name, cutoff_len=cutoff_len)
        cls = PairwiseDatasetProcessor if kind == PAIRS else FeedbackDatasetProcessor
        processor = load_processor(tokenizer_dir, self.tokenizer, template_name)
        self.proc = cls(
            template=self.template, tokenizer=self.tokenizer, processor=processor, data_args=self.data_args
        )

    def dataset(self, rows: list[dict], untruncated: bool = False):
        """The tokenized rows as LLaMA-Factory's loader makes them (its map call, its columns);
        `untruncated`: with no cutoff, to measure rows (a row that fits is not cut either way)."""
        from datasets import Dataset

        columns = ("_prompt", "_response", "_system", "_tools", "_images", "_videos", "_audios")
        data = Dataset.from_dict({c: [aligned(r)[c] for r in rows] for c in columns})
        saved = self.data_args.cutoff_len
        if untruncated:
            self.data_args.cutoff_len = 1 << 30
        try:
            out = data.map(
                self.proc.preprocess_dataset,
                batched=True,
                batch_size=self.data_args.preprocessing_batch_size,
                remove_columns=list(columns),
                load_from_cache_file=False,
                # datasets would otherwise hash the processor, the whole tokenizer with it, to name
                # a cache file that an in-memory dataset never gets (seconds for a large vocabulary)
                new_fingerprint=self._fingerprint(rows, untruncated),
            )
        finally:
            self.data_args.cutoff_len = saved
        if len(out) != len(rows):  # the processor drops rows of a shape the checks refuse
            raise AssertionError(f"LLaMA-Factory's processor kept {len(out)} of {len(rows)} checked rows")
        return out

    def _fingerprint(self, rows: list[dict], untruncated: bool) -> str:
        digest = hashlib.sha256(
            f"{self.data_args.template}\x1f{self.data_args.cutoff_len}\x1f{untruncated}".encode()
        )
        digest.update(str(self.tokenizer.name_or_path).encode())
        for row in rows:
            digest.update(content_key(row).encode())
        return digest.hexdigest()[:16]

    def lengths(self, data) -> list[dict[str, tuple[int, int]]]:
        """Per row of an untruncated `dataset`, {side: (prompt tokens, answer tokens)}: `chosen` and
        `rejected`, or `completion` for a KTO row."""
        if self.kind == PAIRS:
            both = zip(data["chosen_labels"], data["rejected_labels"], strict=True)
            return [{"chosen": _split_len(c), "rejected": _split_len(r)} for c, r in both]
        return [{"completion": _split_len(labels)} for labels in data["labels"]]


def _split_len(labels: list[int]) -> tuple[int, int]:
    prompt = next((i for i, x in enumerate(labels) if x != -100), len(labels))
    return prompt, len(labels) - prompt


# -- reading


def _raw_rows(src: dict, max_row_bytes: int | None, synthetic_rows_n: int) -> Iterator[tuple[int, object]]:
    if src["path"] in BUILTIN:
        yield from enumerate(synthetic_rows(synthetic_rows_n, BUILTIN[src["path"]]), 1)
        return
    yield from iter_raw(src["path"], src.get("split", "train"), max_row_bytes)


@dataclasses.dataclass
class _Source:
    path: str
    kind: str | None = None
    first: int = 0  # the row number of its first valid row
    rows: int = 0
    invalid: int = 0
    duplicates: int = 0
    too_long: int = 0
    train_rows: int = 0
    heldout_rows: int = 0


@dataclasses.dataclass
class _Run:
    """What prepare_preference collects while it reads."""

    rejected: list = dataclasses.field(default_factory=list)
    by_reason: Counter = dataclasses.field(default_factory=Counter)
    sources: list = dataclasses.field(default_factory=list)
    sides: dict = dataclasses.field(default_factory=lambda: {False: [], True: []})
    kind: str | None = None
    first_kind_source: int = 0
    invalid: int = 0

    def reject(self, err: RowError, stats: _Source, invalid: bool = True) -> None:
        self.rejected.append(err.as_dict())
        self.by_reason[err.reason] += 1
        if invalid:
            stats.invalid += 1
            self.invalid += 1


def _read_source(i: int, src: dict, run: _Run, opts: dict, seen: SeenKeys) -> list:
    """Valid, distinct rows of one source as (row number, row). A row of the other kind than the
    source's first valid row is a bad row (mixed_format); a source whose rows are of the other kind
    than the earlier sources' stops the stage (one run trains one method)."""
    path, fmt, attr = str(src["path"]), src.get("format", "alpaca"), src.get("attr")
    stats = _Source(path)
    run.sources.append(stats)
    kept = []
    try:
        for number, raw in _raw_rows(src, opts["max_row_bytes"], opts["synthetic_rows"]):
            stats.rows += 1
            done = check_row(path, number, raw, fmt, attr, opts["clean_text"])
            if not isinstance(done, RowError) and stats.kind not in (None, done[0]):
                detail = f"is a {_WHAT[done[0]]} among {_WHAT[stats.kind]}s (the first at row {stats.first})"
                done = RowError(path, number, MIXED_FORMAT, detail)
            if isinstance(done, RowError):
                run.reject(done, stats)
                continue
            kind, row = done
            if stats.kind is None:
                stats.kind, stats.first = kind, number
                _same_kind(i, stats, run)
            kept.append((number, row))
    except FileError as exc:
        raise DataError(str(exc)) from None
    if stats.rows == 0:
        raise DataError(f"config key preference.data.sources[{i}].path: {path} holds no rows")
    # Exact duplicates by content, the earlier row kept (dedup.SeenKeys: 8 bytes a row).
    keys = np.array([int(content_key(row)[:16], 16) for _, row in kept], dtype=np.uint64)
    new = seen.add(keys)
    for number, _ in (k for k, fresh in zip(kept, new, strict=True) if not fresh):
        stats.duplicates += 1
        run.reject(RowError(path, number, DUPLICATE, "exact duplicate of an earlier row"), stats, False)
    return [k for k, fresh in zip(kept, new, strict=True) if fresh]


def _same_kind(i: int, stats: _Source, run: _Run) -> None:
    if run.kind is None:
        run.kind, run.first_kind_source = stats.kind, i
    elif stats.kind != run.kind:
        raise DataError(
            f"config key preference.data.sources[{i}]: {stats.path} row {stats.first} is a "
            f"{_WHAT[stats.kind]}, but preference.data.sources[{run.first_kind_source}] holds "
            f"{_WHAT[run.kind]}s: one run trains on one kind (dpo-style pairs or KTO rows)"
        )


_WHAT = {PAIRS: "preference pair (chosen/rejected)", KTO: "KTO row (a kto_tag)"}


def _tools_refused(number: int, row: dict, stats: _Source, run: _Run, tok: Tokenizer) -> bool:
    """Whether the template's formatters refuse the row's tools or one of its calls (named as
    prepare_data names them), which would otherwise stop LLaMA-Factory's processor with a traceback."""
    checks = [("tools", "tools", row["tools"])] if row.get("tools") else []
    turns = [(f"messages[{k}].value", m) for k, m in enumerate(row["messages"], 1)]
    turns += [(f"{side}.value", row[side]) for side in ("chosen", "rejected") if side in row]
    checks += [("function", field, m["value"]) for field, m in turns if m["from"] == "function_call"]
    for kind, field, content in checks:
        problem = formatter_problem(tok.template, kind, content)
        if problem:
            reason = BAD_TOOLS if kind == "tools" else BAD_FUNCTION_CALL
            run.reject(RowError(stats.path, number, reason, problem, field), stats)
            return True
    return False


def _length_filter(kept: list, stats: _Source, run: _Run, tok: Tokenizer, cutoff_len: int):
    """(the rows that fit, their indices in the encoded rows, the encoded rows): every row tokenized
    once, untruncated, and its sides measured; a row over cutoff_len is named in rejected.jsonl."""
    kept = [(number, row) for number, row in kept if not _tools_refused(number, row, stats, run, tok)]
    data = tok.dataset([row for _, row in kept], untruncated=True)
    rows, index = [], []
    for i, ((number, row), sides) in enumerate(zip(kept, tok.lengths(data), strict=True)):
        over = [(s, p + a) for s, (p, a) in sides.items() if p + a > cutoff_len]
        if over:
            side, total = max(over, key=lambda x: x[1])
            prompt, answer = sides[side]
            detail = (
                f"makes the row too long: prompt {prompt} + {side} {answer} = {total} tokens with the "
                f"template, over preference.data.cutoff_len {cutoff_len}"
            )
            stats.too_long += 1
            run.reject(RowError(stats.path, number, TOO_LONG, detail, side), stats, False)
            continue
        rows.append(row)
        index.append(i)
    return rows, index, data


# The kind of row each preference.method trains on.
METHOD_KIND = {"dpo": PAIRS, "kto": KTO}


def _check_method(kind: str, method: str | None) -> None:
    """Pairs train under dpo, KTO rows under kto: never one as the other (LLaMA-Factory would fail
    on the missing columns mid-job, or train on half of each row)."""
    if method is None or METHOD_KIND[method] == kind:
        return
    fix = {"kto": "builtin:synthetic_kto or a KTO file", "dpo": "builtin:synthetic_pairs or a pair file"}
    fix = fix[method]
    raise DataError(
        f"config key preference.method is {method}, which trains on {METHOD_KIND[method]}, but "
        f"preference.data.sources hold {kind}: give {fix}, or set preference.method: "
        f"{'dpo' if kind == PAIRS else 'kto'}"
    )


def prepare_preference(
    sources: list[dict],
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    template: str,
    opts: dict,
) -> dict:
    """Write train.jsonl, heldout.jsonl, rejected.jsonl, dataset_info.json, tokenized/ and stats.json
    into `out_dir`. `opts`: the validated preference.data keys (cutoff_len, heldout_fraction,
    split_salt, invalid_rows, max_dropped_fraction, clean_text, max_row_bytes, synthetic_rows).

    Everything is written into a spool folder first and moved into place at the end, stats.json
    last: a failed run leaves nothing in `out_dir` (an empty `out_dir` is removed)."""
    out_dir = Path(out_dir)
    tmp = out_dir / ".prepare_preference.tmp"
    started = time.perf_counter()
    done = False
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        run, tok, sides, encoded = _collect(sources, opts, tokenizer_dir, template)
        _check_method(run.kind, opts.get("method"))
        stats = _write(run, tok, sides, encoded, tmp, opts)
        stats["template"] = template
        stats["seconds"] = round(time.perf_counter() - started, 2)
        # An earlier run's stats.json goes first: until the new one is written, nothing vouches for
        # a folder whose files were being replaced.
        (out_dir / "stats.json").unlink(missing_ok=True)
        for name in ("train.jsonl", "heldout.jsonl", "rejected.jsonl", "dataset_info.json"):
            (tmp / name).replace(out_dir / name)
        shutil.rmtree(out_dir / "tokenized", ignore_errors=True)
        (tmp / "tokenized").replace(out_dir / "tokenized")
        write_json(out_dir / "stats.json", stats)
        done = True
        log.info("prepared %d train / %d held-out %s", stats["train_rows"], stats["heldout_rows"], run.kind)
        return stats
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not done:
            with contextlib.suppress(OSError):
                out_dir.rmdir()


def _collect(sources: list[dict], opts: dict, tokenizer_dir, template: str):
    """Read, validate, dedup, length-filter and split every source; stop on what the options refuse."""
    run, seen, tok = _Run(), SeenKeys(), None
    sides: dict[bool, list[dict]] = {False: [], True: []}
    # Per side, the encoded rows of each source it takes rows from: (encoded rows, indices).
    encoded: dict[bool, list] = {False: [], True: []}
    for i, src in enumerate(sources):
        kept = _read_source(i, src, run, opts, seen)
        stats = run.sources[-1]
        if not kept or (run.invalid and opts["invalid_rows"] == "fail"):
            continue  # every bad row is listed before the stage stops
        if tok is None:
            tok = Tokenizer(tokenizer_dir, template, run.kind, opts["cutoff_len"])
        rows, index, data = _length_filter(kept, stats, run, tok, opts["cutoff_len"])
        picked: dict[bool, list[int]] = {False: [], True: []}
        for row, k in zip(rows, index, strict=True):
            held = is_heldout(prompt_key(row), opts["heldout_fraction"], opts["split_salt"])
            sides[held].append(row)
            picked[held].append(k)
        for held in (False, True):
            encoded[held].append((data, picked[held]))
        stats.train_rows, stats.heldout_rows = len(picked[False]), len(picked[True])
    _check(run, sides, opts)
    return run, tok, sides, encoded


def _check(run: _Run, sides: dict, opts: dict) -> None:
    read = max(1, sum(s.rows for s in run.sources))
    if run.invalid and opts["invalid_rows"] == "fail":
        shown = "\n  ".join(e["message"] for e in run.rejected if e["reason"] not in (DUPLICATE,))
        lines = shown.split("\n  ")
        more = len(lines) - EXAMPLES_KEPT
        by_reason = ", ".join(f"{k} {v}" for k, v in sorted(run.by_reason.items()) if k != DUPLICATE)
        raise DataError(
            f"{run.invalid} bad preference row(s) ({by_reason}); preference.data.invalid_rows is 'fail':\n  "
            + "\n  ".join(lines[:EXAMPLES_KEPT])
            + (f"\n  ... and {more} more (every one is in the log)" if more > 0 else "")
        )
    too_long = sum(s.too_long for s in run.sources)
    limit = opts["max_dropped_fraction"]
    for what, count, fix in (
        ("exceed preference.data.cutoff_len", too_long, "raise preference.data.cutoff_len"),
        ("are invalid", run.invalid, "fix the data"),
    ):
        if count / read > limit:
            example = next(e["message"] for e in run.rejected if e["reason"] not in (DUPLICATE,))
            raise DataError(
                f"{count} of {read} preference rows {what} (e.g. {example}): {fix}, or allow the loss "
                f"with preference.data.max_dropped_fraction (now {limit:g})"
            )
    if not sides[False]:
        raise DataError("no preference training rows left after validation, dedup and the length filter")
    if not sides[True]:
        raise DataError(
            f"no held-out preference rows: raise preference.data.heldout_fraction or add rows "
            f"({len(sides[False])} train rows kept)"
        )


def _tokenized(tok: Tokenizer, rows: list[dict], encoded: list):
    """One side's tokenized rows. Pairs: the rows the length check encoded (each pair is encoded on
    its own, and a row that fits is not cut), with LENGTH_COLUMN beside LLaMA-Factory's columns. KTO
    rows: encoded again in the side's final order, as LLaMA-Factory's processor pairs each prompt with
    its batch neighbour's answer (the KL pairs)."""
    from datasets import concatenate_datasets

    if tok.kind == KTO:
        return tok.dataset(rows)
    data = concatenate_datasets([data.select(index) for data, index in encoded])
    both = zip(data["chosen_input_ids"], data["rejected_input_ids"], strict=True)
    return data.add_column(LENGTH_COLUMN, [max(len(c), len(r)) for c, r in both])


def _write(run: _Run, tok: Tokenizer, sides: dict, encoded: dict, tmp: Path, opts: dict) -> dict:
    from datasets import DatasetDict

    for e in run.rejected:
        log.warning("preference row dropped: %s", e["message"])
    with open(tmp / "rejected.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(e, ensure_ascii=False) + "\n" for e in run.rejected)
    columns = {}
    for held, name in ((False, "train.jsonl"), (True, "heldout.jsonl")):
        rows = sides[held]
        columns[held] = {k for r in rows for k in ("system", "tools") if k in r}
        with open(tmp / name, "w", encoding="utf-8") as fh:
            for r in rows:
                line = dict(r)
                for k in columns[held]:
                    line.setdefault(k, "")  # one JSON schema per file for datasets' reader
                fh.write(json.dumps(line, ensure_ascii=False) + "\n")
    write_json(tmp / "dataset_info.json", dataset_info(run.kind, columns[False], columns[True]))
    splits = {"train": False, "validation": True}
    DatasetDict(
        {name: _tokenized(tok, sides[held], encoded[held]) for name, held in splits.items()}
    ).save_to_disk(str(tmp / "tokenized"))
    fingerprint = hashlib.sha256("".join(content_key(r) for r in sides[False] + sides[True]).encode())
    return {
        "kind": run.kind,
        "sources": [dataclasses.asdict(s) for s in run.sources],
        "rows_read": sum(s.rows for s in run.sources),
        "invalid": run.invalid,
        "invalid_by_reason": dict(sorted(run.by_reason.items())),
        "invalid_examples": [e for e in run.rejected if e["reason"] != DUPLICATE][:EXAMPLES_KEPT],
        "duplicates": sum(s.duplicates for s in run.sources),
        "too_long": sum(s.too_long for s in run.sources),
        "train_rows": len(sides[False]),
        "heldout_rows": len(sides[True]),
        "desirable_train_rows": sum(bool(r.get("kto_tag")) for r in sides[False])
        if run.kind == KTO
        else None,
        "cutoff_len": opts["cutoff_len"],
        "heldout_fraction": opts["heldout_fraction"],
        # rows that name no task are not a task
        "tasks_heldout": dict(Counter(str(r["task"]) for r in sides[True] if r.get("task"))),
        "tokenized": {
            "path": "tokenized",
            "splits": {"train": len(sides[False]), "validation": len(sides[True])},
        },
        "fingerprint": fingerprint.hexdigest()[:16],
    }


# -- the evaluate side


@dataclasses.dataclass(frozen=True)
class HeldoutRow:
    """One held-out row. `prompt`: the prompt messages as {"role", "content"} with LLaMA-Factory's role
    names (user, assistant, observation, function), ending with the user turn; `system`, `tools`: as
    the template receives them ("" = none). Pairs: `chosen` and `rejected` are the two answer texts,
    `completion` and `tag` are None. KTO rows: `completion` is the answer text and `tag` True
    (desirable) or False, `chosen` and `rejected` are None. `task`: the demo's task label or ""."""

    prompt: tuple
    system: str
    tools: str
    chosen: str | None = None
    rejected: str | None = None
    completion: str | None = None
    tag: bool | None = None
    task: str = ""


def heldout_pairs(path: str | Path) -> list[HeldoutRow]:
    """The held-out rows of prepare_preference (its heldout.jsonl, or the folder that holds it), in
    file order, as HeldoutRow: (prompt messages, chosen, rejected) for pairs, (prompt messages,
    completion, tag) for KTO rows. The prompt is what the template encodes before the answer
    (LLaMA-Factory's _prompt); a model's preference is its log-likelihood of chosen vs rejected
    given it."""
    path = Path(path)
    if path.is_dir():
        path = path / "heldout.jsonl"
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            a = aligned(row)
            common = {
                "prompt": tuple(a["_prompt"]),
                "system": a["_system"],
                "tools": a["_tools"],
                "task": row.get("task", ""),
            }
            if "kto_tag" in row:
                out.append(HeldoutRow(**common, completion=row["messages"][-1]["value"], tag=row["kto_tag"]))
            else:
                out.append(
                    HeldoutRow(**common, chosen=row["chosen"]["value"], rejected=row["rejected"]["value"])
                )
    return out
