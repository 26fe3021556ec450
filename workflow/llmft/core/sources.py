"""Reading and validating dataset rows.

Containers, all read in bounded pieces so memory does not grow with the file: JSON Lines (line by
line), JSON arrays (a streaming parser over 1 MiB blocks), Parquet (batch by batch), and folders
written by `datasets`' `save_to_disk` (memory-mapped Arrow, batch by batch).

Row formats: alpaca (instruction / input / output, optional system and history) and sharegpt
(`conversations` of from/value or `messages` of role/content). Both become one canonical row, the
alpaca-with-history form that LLaMA-Factory reads: history pairs, then the last user turn and the
answer. Sharegpt rows with tool turns (function_call, observation) or a `tools` field keep their
messages instead (conversation.py describes both forms). Every problem is a `RowError` naming the
row, the field and a reason code.
"""

from __future__ import annotations

import codecs
import contextvars
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llmft.core.conversation import ROLE_OF
from llmft.core.io import path_problem
from llmft.core.text import clean_text

# Reason codes, as counted in stats.json.
BAD_ENCODING = "bad_encoding"
BAD_JSON = "bad_json"
NOT_AN_OBJECT = "not_an_object"
MISSING = "missing_field"
EMPTY = "empty_field"
WRONG_TYPE = "wrong_type"
UNKNOWN_ROLE = "unknown_role"
ROLE_ORDER = "role_order"
BAD_TOOLS = "bad_tools"
BAD_FUNCTION_CALL = "bad_function_call"
NUL_CHARACTER = "nul_character"
UNUSED_COLUMN = "unused_column"
ROW_TOO_LARGE = "row_too_large"
TOO_DEEP = "too_deep"

FORMATS = ("alpaca", "sharegpt")
# Tool roles of other formats (OpenAI's): named in the error, not guessed at. Every other name of
# conversation.ROLE_OF is read (a sharegpt tag or LLaMA-Factory's role name).
OTHER_TOOL_ROLES = {"function", "tool"}

_BLOCK = 1 << 20

# Lists and objects one inside another in a row or in a field's JSON text (tools, a call): deeper
# JSON would overflow the recursion of Python's reader (about 1 000 levels) here or in
# LLaMA-Factory's formatters; real rows nest a few levels.
MAX_DEPTH = 100
DEEP = f"nests lists and objects ([ and {{) more than {MAX_DEPTH} levels deep, the most a row may"

# Columns LLaMA-Factory reads for other stages or for media, which llmft's SFT stage would drop
# without a word (the rows would train as plain text): refused by name, with the stage that uses them.
_MEDIA = "llmft's SFT stage trains on text only and would drop them, leaving any <{tag}> placeholder as text"
_PREFERENCE = (
    "a preference pair, for LLaMA-Factory's dpo/rm stage (dataset_info ranking: true); llmft's SFT "
    "stage does not train on it: give the file under preference.data.sources"
)
UNUSED_COLUMNS = {
    "images": f"holds images, for a multimodal model (LLaMA-Factory's columns.images); {_MEDIA}",
    "videos": f"holds videos (LLaMA-Factory's columns.videos); {_MEDIA}",
    "audios": f"holds audio (LLaMA-Factory's columns.audios); {_MEDIA}",
    "chosen": f"holds {_PREFERENCE}",
    "rejected": f"holds {_PREFERENCE}",
}
_KTO = (
    "holds a KTO label (desirable or not), for LLaMA-Factory's kto stage (columns.kto_tag); llmft's "
    "SFT stage would drop it and train on every answer, the undesirable ones too: give the file under "
    "preference.data.sources"
)
_PRETRAINING = (
    "is pretraining text (LLaMA-Factory's pt stage reads a 'text' column); llmft's SFT stage needs "
    "instruction and output (alpaca) or conversations (sharegpt)"
)
# The fields of an SFT row: a row with none of them but a `text` is pretraining text.
_SFT_FIELDS = ("instruction", "input", "output", "conversations", "messages")
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


# Whether row texts are cleaned (clean_text) before they become canonical rows: config key
# data.clean_text, set for one validate() call. False = the texts as LLaMA-Factory reads them.
_CLEAN = contextvars.ContextVar("llmft_clean_text", default=True)


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
    if "\x00" in value:
        at = value.index("\x00") + 1
        detail = f"holds a NUL character (at character {at}): binary or corrupt text"
        raise _Invalid(NUL_CHARACTER, detail, field)
    if _CLEAN.get():
        value = clean_text(value)
        if required and not value:
            raise _Invalid(EMPTY, "is empty", field)
    elif required and not value.strip():
        # Kept as LLaMA-Factory reads it otherwise, but a turn without text is refused either way:
        # LLaMA-Factory would train on it (an empty answer teaches only the end-of-turn token).
        raise _Invalid(EMPTY, "is empty" if not value else "holds only whitespace", field)
    return value


# -- row formats


def _refuse_unused(raw: dict) -> None:
    """A column another LLaMA-Factory stage reads (preference, KTO, media) or pretraining text."""
    for col, why in UNUSED_COLUMNS.items():
        if raw.get(col) not in (None, [], "", {}):
            raise _Invalid(UNUSED_COLUMN, why.format(tag=col.rstrip("s")), col)
    if isinstance(raw.get("label"), bool):
        raise _Invalid(UNUSED_COLUMN, _KTO, "label")
    if raw.get("text") is not None and all(raw.get(f) is None for f in _SFT_FIELDS):
        raise _Invalid(UNUSED_COLUMN, _PRETRAINING, "text")


def check_alpaca(raw: object) -> dict:
    """instruction and output required; input, system, history, tools optional (null = empty)."""
    if not isinstance(raw, dict):
        raise _Invalid(NOT_AN_OBJECT, f"expected an object, got {type(raw).__name__}")
    _refuse_unused(raw)
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
    tools = _tools(raw.get("tools"))
    if tools:  # LLaMA-Factory's alpaca converter passes a tools column on too: a tool row
        from llmft.core.conversation import messages

        tool_row = {"messages": messages(row)}
        if system:
            tool_row["system"] = system
        tool_row["tools"] = tools
        row = tool_row
    _copy_task(raw, row)
    return row


def _spelling(raw: dict) -> tuple[str, str, str]:
    """(list field, role key, content key): `conversations` of from/value or `messages` of role/content."""
    if raw.get("conversations") is not None:
        return "conversations", "from", "value"
    if raw.get("messages") is not None:
        return "messages", "role", "content"
    raise _Invalid(MISSING, "is missing (or 'messages')", "conversations")


class TooDeep(ValueError):
    """JSON nested deeper than MAX_DEPTH."""


def _too_deep(value: object) -> bool:
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= MAX_DEPTH:
                    return True
                stack.append((child, depth + 1))
    return False


def _deeper(value: object, text: str, start: int = 0, end: int | None = None) -> bool:
    """Whether a decoded value nests deeper than MAX_DEPTH; its JSON text[start:end] rules most
    values out by its count of brackets, without a walk."""
    end = len(text) if end is None else end
    return text.count("[", start, end) + text.count("{", start, end) > MAX_DEPTH and _too_deep(value)


def loads(text: str) -> object:
    """json.loads, with JSON nested deeper than MAX_DEPTH a TooDeep."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(DEEP) from None
    if _deeper(value, text):
        raise TooDeep(DEEP)
    return value


def _tools(value) -> str:
    """The `tools` value as the JSON string LLaMA-Factory's tool formatter reads ("" = no tools).

    A list or object (a JSON file's tools given inline, or a Parquet struct column) is serialised
    with json.dumps(ensure_ascii=False), as LLaMA-Factory's openai converter does: its sharegpt
    converter would hand the object itself to the formatter, which only decodes strings. Every tool
    formatter decodes the string and writes the tools anew, so how the JSON is spaced never reaches
    the tokens; a string is kept as given."""
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, str):
        if not _valid_utf8(value):
            raise _Invalid(BAD_ENCODING, "is not valid UTF-8", "tools")
        text = value.strip()
        if not text:
            return ""
    else:
        raise _Invalid(WRONG_TYPE, f"must be a JSON string (or a list), got {type(value).__name__}", "tools")
    try:
        decoded = loads(text)
    except json.JSONDecodeError as exc:
        raise _Invalid(BAD_TOOLS, f"is not valid JSON ({_where(exc, exc.pos + 1)})", "tools") from None
    except TooDeep as exc:
        raise _Invalid(TOO_DEEP, str(exc), "tools") from None
    if isinstance(decoded, dict) and not decoded:
        return text  # empty, as "[]": LLaMA-Factory writes an empty tool text (and a system block)
    if not isinstance(decoded, list):
        raise _Invalid(BAD_TOOLS, f"must be a JSON list of tools, got {type(decoded).__name__}", "tools")
    for i, tool in enumerate(decoded, 1):
        inner = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else tool
        if not isinstance(inner, dict) or not isinstance(inner.get("name"), str):
            raise _Invalid(BAD_TOOLS, f"tool {i} must be an object with a 'name'", "tools")
    return text


def _check_call(text: str, field: str) -> None:
    """A function_call turn that is JSON must be what LLaMA-Factory's function formatter reads: a
    call or a list of calls, each with a name and arguments. Text that is not JSON may still hold
    the call inside the template's tool-call words or after a thought; the template's own formatter
    decides that (check_with_template)."""
    try:
        value = loads(text)
    except json.JSONDecodeError:
        return
    except TooDeep as exc:
        raise _Invalid(TOO_DEEP, str(exc), field) from None
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise _Invalid(BAD_FUNCTION_CALL, "is an empty list of calls", field)
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
            raise _Invalid(
                BAD_FUNCTION_CALL, 'must be a call {"name": ..., "arguments": ...} or a list of them', field
            )


def check_sharegpt(raw: object) -> dict:
    """An optional system turn, then prompt turns (user, observation) and answer turns (assistant,
    function_call) alternating, ending with an answer: LLaMA-Factory's sharegpt rules.

    Rows without tool turns or tools become the alpaca-with-history form, as before; the others keep
    their messages (with LLaMA-Factory's role names) and their tools (see conversation.py)."""
    if not isinstance(raw, dict):
        raise _Invalid(NOT_AN_OBJECT, f"expected an object, got {type(raw).__name__}")
    _refuse_unused(raw)
    field, role_key, content_key = _spelling(raw)
    conv = raw[field]
    if not isinstance(conv, list):
        raise _Invalid(WRONG_TYPE, f"must be a list of messages, got {type(conv).__name__}", field)
    if not conv:
        raise _Invalid(EMPTY, "is empty", field)
    system = _text(raw.get("system"), "system", False)
    tools = _tools(raw.get("tools"))
    turns: list[tuple[str, str]] = []  # (role in LLaMA-Factory's names, content)
    for i, msg in enumerate(conv, 1):
        where = f"{field}[{i}]"
        if not isinstance(msg, dict):
            raise _Invalid(WRONG_TYPE, f"must be an object, got {type(msg).__name__}", where)
        role = msg.get(role_key)
        if role is None:
            raise _Invalid(MISSING, "is missing", f"{where}.{role_key}")
        if not isinstance(role, str):
            raise _Invalid(WRONG_TYPE, f"must be a string, got {type(role).__name__}", f"{where}.{role_key}")
        if role in OTHER_TOOL_ROLES:
            raise _Invalid(
                UNKNOWN_ROLE,
                f"unknown role {role!r}: sharegpt tool turns are 'function_call' and 'observation'",
                f"{where}.{role_key}",
            )
        if role not in ROLE_OF:
            known = ", ".join(sorted(set(ROLE_OF) - OTHER_TOOL_ROLES))
            raise _Invalid(UNKNOWN_ROLE, f"unknown role {role!r} (known: {known})", f"{where}.{role_key}")
        lf_role = ROLE_OF[role]
        content = _text(msg.get(content_key), f"{where}.{content_key}", lf_role != "system")
        if lf_role == "system":
            if turns or i != 1:
                raise _Invalid(ROLE_ORDER, "a system message may only come first", where)
            if system and content:
                raise _Invalid(ROLE_ORDER, "system prompt given twice (field and first message)", where)
            system = system or content
            continue
        if len(turns) % 2 == 0 and lf_role not in ("user", "observation"):
            after = turns[-1][0] if turns else "the start"
            raise _Invalid(
                ROLE_ORDER, f"expected a user turn (or observation) after {after}, got {role}", where
            )
        if len(turns) % 2 == 1 and lf_role not in ("assistant", "function"):
            after = turns[-1][0]
            raise _Invalid(
                ROLE_ORDER, f"expected a assistant turn (or function_call) after {after}, got {role}", where
            )
        if lf_role == "function":
            _check_call(content, f"{where}.{content_key}")
        turns.append((lf_role, content))
    if not turns:
        raise _Invalid(EMPTY, "has no user/assistant turns", field)
    if len(turns) % 2:
        raise _Invalid(ROLE_ORDER, f"ends with a {turns[-1][0]} turn: no answer to train on", field)
    if tools or any(r in ("observation", "function") for r, _ in turns):
        row = {"messages": [{"role": r, "content": c} for r, c in turns]}
        if system:
            row["system"] = system
        if tools:
            row["tools"] = tools
        _copy_task(raw, row)
        return row
    pairs = [[turns[i][1], turns[i + 1][1]] for i in range(0, len(turns), 2)]
    row = {"instruction": pairs[-1][0], "input": "", "output": pairs[-1][1]}
    if system:
        row["system"] = system
    if len(pairs) > 1:
        row["history"] = pairs[:-1]
    _copy_task(raw, row)
    return row


def formatter_problem(template, kind: str, content: str) -> str | None:
    """Why LLaMA-Factory's tool formatter (`kind` "tools") or function formatter ("function") of
    `template` refuses `content`, or None. They differ: GLM-4 takes one call at a time, the default
    tool format needs parameters."""
    from llamafactory.data.template import Llama2Template

    try:
        if kind == "tools":
            template.format_tools.apply(content=content)
        elif isinstance(template, Llama2Template):  # (mistral) called without thought/tool-call words
            template.format_function.apply(content=content)
        else:
            words = {"thought_words": template.thought_words, "tool_call_words": template.tool_call_words}
            template.format_function.apply(content=content, **words)
    except Exception as exc:  # noqa: BLE001 - any refusal of the formatter is the row's fault
        name = "tool" if kind == "tools" else "function"
        return f"the template's {name} formatter refuses it ({type(exc).__name__}: {exc})"
    return None


def check_with_template(source: str, number: int, raw: dict, row: dict, template) -> RowError | None:
    """Run a tool row's tools and function calls through LLaMA-Factory's formatters of `template`
    (formatter_problem), so a row they refuse is a named bad row here instead of a traceback in the
    tokenizer."""
    if "messages" not in row:
        return None
    if row.get("tools"):
        problem = formatter_problem(template, "tools", row["tools"])
        if problem:
            return RowError(source, number, BAD_TOOLS, problem, "tools")
    if not any(m["role"] == "function" for m in row["messages"]):
        return None  # (alpaca rows with tools end here: they have no calls)
    field, role_key, content_key = _spelling(raw)
    # Where each message of the row stands in the file's list (a leading system turn is not one).
    raw_positions = [i for i, m in enumerate(raw[field], 1) if m.get(role_key) != "system"]
    for k, msg in enumerate(row["messages"]):
        problem = msg["role"] == "function" and formatter_problem(template, "function", msg["content"])
        if problem:
            where = f"{field}[{raw_positions[k]}].{content_key}"
            return RowError(source, number, BAD_FUNCTION_CALL, problem, where)
    return None


def _copy_task(raw: dict, row: dict) -> None:
    # The demo's task label: carried through for per-task metrics, never trained on.
    task = raw.get("task")
    if isinstance(task, str):
        row["task"] = task


CHECKS = {"alpaca": check_alpaca, "sharegpt": check_sharegpt}


def validate(source: str, number: int, raw: object, fmt: str, clean: bool = True) -> dict | RowError:
    """The canonical row, or a RowError naming row, field and reason.

    `clean` (config data.clean_text): texts through clean_text (NFC, unified newlines, stripped
    ends); False keeps them exactly as LLaMA-Factory reads the file, so the tokens are its tokens."""
    if isinstance(raw, RowError):
        return raw
    if not clean:
        token = _CLEAN.set(False)
        try:
            return validate(source, number, raw, fmt)
        finally:
            _CLEAN.reset(token)
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


def iter_raw(
    path: str | Path, split: str = "train", max_row_bytes: int | None = None
) -> Iterator[tuple[int, object]]:
    """(row number from 1, raw row or RowError) for every row of a dataset file or folder.

    `max_row_bytes` (config data.max_row_bytes; None = its schema default): a longer JSON row is
    never held in memory whole."""
    max_row_bytes = max_row_bytes or default_max_row_bytes()
    problem = path_problem(path)
    if problem:
        raise FileError(f"{path} {problem}")
    kind = container(path)
    if kind == "jsonl":
        return _iter_jsonl(Path(path), max_row_bytes)
    if kind == "json":
        return _iter_json(Path(path), max_row_bytes)
    if kind == "parquet":
        return _iter_parquet(Path(path))
    return _iter_arrow_folder(Path(path), split)


def default_max_row_bytes() -> int:
    """The schema's default of data.max_row_bytes, for callers without a validated config."""
    from llmft.core.config import load_schema

    return load_schema()["properties"]["data"]["properties"]["max_row_bytes"]["default"]


def _json_error(exc: json.JSONDecodeError, text: str, start: int = 0) -> str:
    """The decoder's reason with where it stopped, counted from the row's start in `text` (its `msg`
    alone ends mid-sentence: "Invalid control character at")."""
    at = exc.pos - start + 1
    if exc.msg.startswith("Invalid control character") and text[exc.pos : exc.pos + 1] == "\x00":
        return f"not valid JSON (a NUL byte at character {at} of the row: binary or corrupt data)"
    if exc.msg == "Extra data":
        return f"not valid JSON (more data after the row's value, at character {at})"
    return f"not valid JSON ({_where(exc, at)} of the row)"


def _where(exc: json.JSONDecodeError, at: int) -> str:
    # Some decoder reasons end in "at" (the position follows in str(exc)): "Invalid control character at".
    return f"{exc.msg.removesuffix(' at')} at character {at}"


def _iter_jsonl(path: Path, max_row_bytes: int) -> Iterator[tuple[int, object]]:
    number = 0
    with open(path, "rb") as fh:
        while raw := fh.readline(max_row_bytes + 1):
            number += 1
            if len(raw) > max_row_bytes and not raw.endswith(b"\n"):
                size = len(raw)
                while raw and not raw.endswith(b"\n"):  # skip the rest in bounded pieces
                    raw = fh.readline(_BLOCK)
                    size += len(raw)
                size -= raw.endswith(b"\n")  # the row's bytes, not its line end
                detail = (
                    f"is {size} bytes, over data.max_row_bytes ({max_row_bytes}); longer rows are not "
                    "read (raise the key if the row is meant)"
                )
                yield number, RowError(str(path), number, ROW_TOO_LARGE, detail)
                continue
            # surrogateescape keeps undecodable bytes visible to validation, which names the field.
            line = raw.decode("utf-8", "surrogateescape")
            if not line.strip():
                continue
            try:
                yield number, loads(line)
            except json.JSONDecodeError as exc:
                yield number, RowError(str(path), number, BAD_JSON, _json_error(exc, line))
            except TooDeep as exc:
                yield number, RowError(str(path), number, TOO_DEEP, str(exc))


def _iter_json(path: Path, max_row_bytes: int) -> Iterator[tuple[int, object]]:
    """A JSON array read element by element, 1 MiB at a time; a .json file that is not an array is
    read as JSON Lines, as `datasets` does."""
    with open(path, "rb") as fh:
        head = fh.read(64).lstrip()
    if not head.startswith(b"["):
        yield from _iter_jsonl(path, max_row_bytes)
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
            except RecursionError:  # where this row ends is not known
                raise FileError(
                    f"{path} row {number + 1}: {DEEP}; the rest of the file is unreadable"
                ) from None
            except json.JSONDecodeError as exc:
                # Read on while the row may just be cut by the block edge, up to the row cap.
                if len(buf) - pos <= max_row_bytes and more():
                    continue
                if len(buf) - pos > max_row_bytes:
                    raise FileError(
                        f"{path} row {number + 1}: longer than data.max_row_bytes ({max_row_bytes}); "
                        "the rest of the array is not read (raise the key if the row is meant)"
                    ) from None
                why = _json_error(exc, buf, pos)
                raise FileError(
                    f"{path} row {number + 1}: {why}; the rest of the file is unreadable"
                ) from None
            if isinstance(value, (int, float)) and len(buf) - end < 64 and more():
                continue  # a number near the block edge may be cut ("1.5e" parses as 1.5): read on
            number += 1
            if _deeper(value, buf, pos, end):
                value = RowError(str(path), number, TOO_DEEP, DEEP)
            pos = end
            yield number, value
            char = next_char()
            if char == "]":
                return
            if char != ",":
                raise FileError(f"{path} row {number}: expected ',' or ']' after the row")
            pos += 1


def _iter_parquet(path: Path) -> Iterator[tuple[int, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    number = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=2048):
            for row in batch.to_pylist():
                number += 1
                yield number, row
    except (pa.ArrowException, OSError) as exc:
        raise FileError(f"{path}: not a readable Parquet file after row {number} ({exc})") from None


def _iter_arrow_folder(path: Path, split: str) -> Iterator[tuple[int, object]]:
    """The Arrow files of a save_to_disk folder, read batch by batch with plain reads: a memory map
    would count every page read as resident and grow with the dataset. The metadata is checked
    first: it may only name regular files inside the folder."""
    import pyarrow as pa

    if (path / "dataset_dict.json").exists():
        splits = _metadata(path / "dataset_dict.json").get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise FileError(f"{path / 'dataset_dict.json'}: 'splits' must be a list of split names")
        if split not in splits:
            raise FileError(f"{path}: no split {split!r} in this DatasetDict (has {sorted(splits)})")
        path = _inside(path, split, "dataset_dict.json", "split", folder=True)
    files = _metadata(path / "state.json").get("_data_files")
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        raise FileError(f"{path / 'state.json'}: '_data_files' must be a list of {{filename: ...}} objects")
    number = 0
    for data_file in files:
        file = _inside(path, data_file.get("filename"), "state.json", "_data_files filename")
        try:
            with pa.OSFile(str(file)) as fh:
                for batch in pa.ipc.open_stream(fh):
                    for row in batch.to_pylist():
                        number += 1
                        yield number, row
        except (pa.ArrowException, OSError) as exc:
            raise FileError(f"{file}: not a readable Arrow stream after row {number} ({exc})") from None


def _metadata(file: Path) -> dict:
    """A save_to_disk metadata file (state.json, dataset_dict.json) as an object, or a FileError."""
    problem = path_problem(file)
    if problem:
        raise FileError(f"{file} {problem}")
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FileError(f"{file}: not valid JSON metadata ({exc})") from None
    if not isinstance(value, dict):
        raise FileError(f"{file}: must hold a JSON object")
    return value


def _inside(base: Path, name: object, meta: str, what: str, folder: bool = False) -> Path:
    """The file (or split folder) that `meta` of `base` names, refused unless it is a plain name
    whose real path stays inside `base` and is a regular file (a folder for a split)."""
    where = f"{base / meta}: {what} {name!r}"
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
        raise FileError(f"{where} is not a plain name inside {base}")
    target = base / name
    problem = path_problem(target)
    if problem:
        raise FileError(f"{where}: {target} {problem}")
    if not target.resolve().is_relative_to(base.resolve()):
        raise FileError(f"{where}: {target} leads outside {base}")
    if target.is_dir() != folder:
        raise FileError(f"{where}: {target} is {'not ' if folder else ''}a folder")
    return target


class DataError(ValueError):
    """The data is wrong; the message names the file, the row and the field."""
