"""Reading and validating dataset rows.

Containers, all read in bounded pieces so memory does not grow with the file: JSON Lines (line by
line), JSON arrays (a streaming parser over 1 MiB blocks), Parquet (batch by batch), and folders
written by `datasets`' `save_to_disk` (memory-mapped Arrow, batch by batch).

Row formats: alpaca (instruction / input / output, optional system and history) and sharegpt
(`conversations` of from/value or `messages` of role/content). Both become one canonical row, the
alpaca-with-history form that LLaMA-Factory reads: history pairs, then the last user turn and the
answer. Every problem is a `RowError` naming the row, the field and a reason code.
"""

from __future__ import annotations

import codecs
import json
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Reason codes, as counted in stats.json.
BAD_ENCODING = "bad_encoding"
BAD_JSON = "bad_json"
NOT_AN_OBJECT = "not_an_object"
MISSING = "missing_field"
EMPTY = "empty_field"
WRONG_TYPE = "wrong_type"
UNKNOWN_ROLE = "unknown_role"
ROLE_ORDER = "role_order"

FORMATS = ("alpaca", "sharegpt")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
TOOL_ROLES = {"function_call", "observation", "function", "tool"}

_BLOCK = 1 << 20
_MAX_ROW = 64 << 20
_WS = re.compile(r"[ \t\n\r]*")


@dataclass
class RowError:
    """One bad row: where it is, which field, and why."""

    source: str
    row: int
    reason: str
    detail: str
    field: str | None = None

    def message(self) -> str:
        where = f"field '{self.field}' " if self.field else ""
        return f"{self.source} row {self.row}: {where}{self.detail}"

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "row": self.row,
            "field": self.field,
            "reason": self.reason,
            "message": self.message(),
        }


class _Invalid(Exception):
    def __init__(self, reason: str, detail: str, field: str | None = None):
        super().__init__(detail)
        self.reason, self.detail, self.field = reason, detail, field


class FileError(ValueError):
    """A whole file cannot be read on (not a row problem): e.g. broken JSON array syntax."""


# -- text


def clean_text(text: str) -> str:
    """What the model trains on: NFC, unified newlines, stripped ends; inner spacing is kept
    (indentation in code answers matters)."""
    if not text.isascii():
        text = unicodedata.normalize("NFC", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.strip()


def normalise(text: str) -> str:
    """Identity of a text for dedup and comparisons: clean_text plus inner runs of spaces collapsed."""
    text = clean_text(text)
    return "\n".join(" ".join(line.split()) for line in text.split("\n"))


def _valid_utf8(text: str) -> bool:
    # Undecodable bytes arrive as lone surrogates (surrogateescape), as do JSON "\ud800" escapes.
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _text(value, field: str, required: bool) -> str:
    if value is None:
        if required:
            raise _Invalid(MISSING, "is missing", field)
        return ""
    if not isinstance(value, str):
        raise _Invalid(WRONG_TYPE, f"must be a string, got {type(value).__name__}", field)
    if not _valid_utf8(value):
        raise _Invalid(BAD_ENCODING, "is not valid UTF-8", field)
    value = clean_text(value)
    if required and not value:
        raise _Invalid(EMPTY, "is empty", field)
    return value


# -- row formats


def check_alpaca(raw: object) -> dict:
    """instruction and output required; input, system, history optional (null = empty)."""
    if not isinstance(raw, dict):
        raise _Invalid(NOT_AN_OBJECT, f"expected an object, got {type(raw).__name__}")
    row = {
        "instruction": _text(raw.get("instruction"), "instruction", True),
        "input": _text(raw.get("input"), "input", False),
        "output": _text(raw.get("output"), "output", True),
    }
    system = _text(raw.get("system"), "system", False)
    if system:
        row["system"] = system
    history = raw.get("history")
    if history is not None:
        if not isinstance(history, list):
            raise _Invalid(
                WRONG_TYPE,
                f"must be a list of [user, assistant] pairs, got {type(history).__name__}",
                "history",
            )
        pairs = []
        for i, pair in enumerate(history, 1):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise _Invalid(WRONG_TYPE, f"item {i} must be a [user, assistant] pair", "history")
            pairs.append([_text(pair[0], f"history[{i}][0]", True), _text(pair[1], f"history[{i}][1]", True)])
        if pairs:
            row["history"] = pairs
    _copy_task(raw, row)
    return row


def check_sharegpt(raw: object) -> dict:
    """An optional system turn, then user/assistant turns alternating, ending with the assistant."""
    if not isinstance(raw, dict):
        raise _Invalid(NOT_AN_OBJECT, f"expected an object, got {type(raw).__name__}")
    if raw.get("conversations") is not None:
        field, role_key, content_key = "conversations", "from", "value"
    elif raw.get("messages") is not None:
        field, role_key, content_key = "messages", "role", "content"
    else:
        raise _Invalid(MISSING, "is missing (or 'messages')", "conversations")
    conv = raw[field]
    if not isinstance(conv, list):
        raise _Invalid(WRONG_TYPE, f"must be a list of messages, got {type(conv).__name__}", field)
    if not conv:
        raise _Invalid(EMPTY, "is empty", field)
    system = _text(raw.get("system"), "system", False)
    turns: list[tuple[str, str]] = []
    for i, msg in enumerate(conv, 1):
        where = f"{field}[{i}]"
        if not isinstance(msg, dict):
            raise _Invalid(WRONG_TYPE, f"must be an object, got {type(msg).__name__}", where)
        role = msg.get(role_key)
        if role is None:
            raise _Invalid(MISSING, "is missing", f"{where}.{role_key}")
        if not isinstance(role, str):
            raise _Invalid(WRONG_TYPE, f"must be a string, got {type(role).__name__}", f"{where}.{role_key}")
        if role in TOOL_ROLES:
            raise _Invalid(UNKNOWN_ROLE, f"tool turns ({role!r}) are not supported", f"{where}.{role_key}")
        if role not in ROLES:
            known = ", ".join(sorted(ROLES))
            raise _Invalid(UNKNOWN_ROLE, f"unknown role {role!r} (known: {known})", f"{where}.{role_key}")
        content = _text(msg.get(content_key), f"{where}.{content_key}", ROLES[role] != "system")
        role = ROLES[role]
        if role == "system":
            if turns or i != 1:
                raise _Invalid(ROLE_ORDER, "a system message may only come first", where)
            if system and content:
                raise _Invalid(ROLE_ORDER, "system prompt given twice (field and first message)", where)
            system = system or content
            continue
        expected = "user" if len(turns) % 2 == 0 else "assistant"
        if role != expected:
            after = turns[-1][0] if turns else "the start"
            raise _Invalid(ROLE_ORDER, f"expected a {expected} turn after {after}, got {role}", where)
        turns.append((role, content))
    if not turns:
        raise _Invalid(EMPTY, "has no user/assistant turns", field)
    if len(turns) % 2:
        raise _Invalid(ROLE_ORDER, "ends with a user turn: no answer to train on", field)
    pairs = [[turns[i][1], turns[i + 1][1]] for i in range(0, len(turns), 2)]
    row = {"instruction": pairs[-1][0], "input": "", "output": pairs[-1][1]}
    if system:
        row["system"] = system
    if len(pairs) > 1:
        row["history"] = pairs[:-1]
    _copy_task(raw, row)
    return row


def _copy_task(raw: dict, row: dict) -> None:
    # The demo's task label: carried through for per-task metrics, never trained on.
    task = raw.get("task")
    if isinstance(task, str):
        row["task"] = task


CHECKS = {"alpaca": check_alpaca, "sharegpt": check_sharegpt}


def validate(source: str, number: int, raw: object, fmt: str) -> dict | RowError:
    """The canonical row, or a RowError naming row, field and reason."""
    if isinstance(raw, RowError):
        return raw
    try:
        return CHECKS[fmt](raw)
    except _Invalid as exc:
        return RowError(source, number, exc.reason, exc.detail, exc.field)


# -- containers


def container(path: str | Path) -> str:
    """jsonl, json, parquet or arrow (a save_to_disk folder), from the path."""
    path = Path(path)
    if path.is_dir():
        return "arrow"
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".jsonl":
        return "jsonl"
    if suffix == ".json":
        return "json"
    raise FileError(f"{path}: not a .json, .jsonl or .parquet file nor a save_to_disk folder")


def iter_raw(path: str | Path, split: str = "train") -> Iterator[tuple[int, object]]:
    """(row number from 1, raw row or RowError) for every row of a dataset file or folder."""
    kind = container(path)
    if kind == "jsonl":
        return _iter_jsonl(Path(path))
    if kind == "json":
        return _iter_json(Path(path))
    if kind == "parquet":
        return _iter_parquet(Path(path))
    return _iter_arrow_folder(Path(path), split)


def _iter_jsonl(path: Path) -> Iterator[tuple[int, object]]:
    loads = json.loads
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            # surrogateescape keeps undecodable bytes visible to validation, which names the field.
            line = raw.decode("utf-8", "surrogateescape")
            if not line.strip():
                continue
            try:
                yield number, loads(line)
            except json.JSONDecodeError as exc:
                yield number, RowError(str(path), number, BAD_JSON, f"not valid JSON ({exc.msg})")


def _iter_json(path: Path) -> Iterator[tuple[int, object]]:
    """A JSON array read element by element, 1 MiB at a time; a .json file that is not an array is
    read as JSON Lines, as `datasets` does."""
    with open(path, "rb") as fh:
        head = fh.read(64).lstrip()
    if not head.startswith(b"["):
        yield from _iter_jsonl(path)
        return
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    with open(path, "rb") as fh:
        buf, pos, eof = "", 0, False

        def more() -> bool:
            nonlocal buf, pos, eof
            if eof:
                return False
            block = fh.read(_BLOCK)
            eof = not block
            buf = buf[pos:] + utf8.decode(block, final=eof)
            pos = 0
            return True

        def next_char() -> str:
            """The next non-space character (not consumed); '' at the end of the file."""
            nonlocal pos
            pos = _WS.match(buf, pos).end()
            while pos >= len(buf):
                if not more():
                    return ""
                pos = _WS.match(buf, pos).end()
            return buf[pos]

        if next_char() != "[":
            raise FileError(f"{path}: a .json dataset must be an array of rows")
        pos += 1
        number = 0
        while True:
            char = next_char()
            if char == "]" and number == 0:
                return
            if not char:
                raise FileError(f"{path}: ends inside the array after row {number}")
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as exc:
                # Read on while the row may just be cut by the block edge; a row can't be 64 MiB.
                if len(buf) - pos < _MAX_ROW and more():
                    continue
                raise FileError(
                    f"{path} row {number + 1}: not valid JSON ({exc.msg}); the rest of the file is unreadable"
                ) from None
            if isinstance(value, (int, float)) and len(buf) - end < 64 and more():
                continue  # a number near the block edge may be cut ("1.5e" parses as 1.5): read on
            number += 1
            pos = end
            yield number, value
            char = next_char()
            if char == "]":
                return
            if char != ",":
                raise FileError(f"{path} row {number}: expected ',' or ']' after the row")
            pos += 1


def _iter_parquet(path: Path) -> Iterator[tuple[int, object]]:
    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=2048):
        for row in batch.to_pylist():
            number += 1
            yield number, row


def _iter_arrow_folder(path: Path, split: str) -> Iterator[tuple[int, object]]:
    """The Arrow files of a save_to_disk folder, read batch by batch with plain reads: a memory map
    would count every page read as resident and grow with the dataset."""
    import pyarrow as pa

    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        if split not in splits:
            raise FileError(f"{path}: no split {split!r} in this DatasetDict (has {sorted(splits)})")
        path = path / split
    state = json.loads((path / "state.json").read_text())
    number = 0
    for data_file in state["_data_files"]:
        with pa.OSFile(str(path / data_file["filename"])) as fh:
            for batch in pa.ipc.open_stream(fh):
                for row in batch.to_pylist():
                    number += 1
                    yield number, row
