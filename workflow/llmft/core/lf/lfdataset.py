"""A LLaMA-Factory dataset_info.json entry as a data source, read as LLaMA-Factory 0.9.5 reads it.

A `data.sources` item `{dataset_info: path/to/dataset_info.json, name: my_data, weight: 1.0}` names
one entry of such a file. The entry's `file_name` is resolved against the file's folder (LLaMA-
Factory's `dataset_dir`); its `formatting`, `columns` and `tags` decide which fields of a row are
read, with LLaMA-Factory's defaults and its rule that an entry's `columns` (or `tags`) replaces all
defaults: a column or tag the entry does not name is not read. What this offline, SFT-only pipeline
cannot read as LLaMA-Factory would (hub or script sources, preference or KTO data, media columns,
sampling) is refused, naming the entry and the key.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmft.core.conversation import ROLE_OF
from llmft.core.io import path_problem

# LLaMA-Factory's DatasetAttr defaults (data/parser.py), used when an entry has no `columns`/`tags`.
COLUMN_DEFAULTS = {
    "prompt": "instruction",
    "query": "input",
    "response": "output",
    "history": None,
    "messages": "conversations",
    "system": None,
    "tools": None,
    "images": None,
    "videos": None,
    "audios": None,
    "chosen": None,
    "rejected": None,
    "kto_tag": None,
}
TAG_DEFAULTS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
REMOTE_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
UNSUPPORTED_COLUMNS = {
    "images": "image data",
    "videos": "video data",
    "audios": "audio data",
    "chosen": "preference (chosen/rejected) data",
    "rejected": "preference (chosen/rejected) data",
    "kto_tag": "KTO data",
}
SUFFIXES = (".json", ".jsonl", ".parquet")
# llmft's own role names: a role of the file that matches no tag of the entry must not become one.
_OWN_ROLES = {*ROLE_OF, "tool"}


class LFDatasetError(ValueError):
    """An entry that cannot be read; the message names the config key, the entry and its key."""


def attributes(entry: dict) -> dict:
    """The columns and tags LLaMA-Factory's DatasetAttr.join takes from an entry, and its ranking."""
    attr = {
        "formatting": entry.get("formatting", "alpaca"),
        "ranking": bool(entry.get("ranking", False)),
        **COLUMN_DEFAULTS,
        **TAG_DEFAULTS,
    }
    if "columns" in entry:
        attr.update({k: entry["columns"].get(k) for k in COLUMN_DEFAULTS})
    if "tags" in entry:
        attr.update({k: entry["tags"].get(k) for k in TAG_DEFAULTS})
    return attr


def resolve(
    src: dict, base_dir: str | Path = ".", where: str = "data.sources[0]", preference: bool = False
) -> dict:
    """{"path": the data file, "format": alpaca|sharegpt, "attr": attributes(entry), "entry": name,
    "dataset_info": the dataset_info.json} for a source item with `dataset_info` and `name`.

    `path` is relative when `dataset_info` is (relative to the same folder as it), as Snakemake
    wants its inputs. `preference`: a preference.data source, which must be a pair entry (ranking
    with columns.chosen and columns.rejected) or a KTO entry (columns.kto_tag); an SFT source must be
    neither."""
    info = Path(src["dataset_info"])
    full = info if info.is_absolute() else Path(base_dir) / info
    key = f"config key {where}.dataset_info"
    table = _read_table(full, key)
    name = _entry_name(src, table, full, where)
    entry = table[name]
    what = f"entry {name!r} of {full}"
    formatting = _check_entry(entry, key, what, where, preference)
    data = info.parent / entry["file_name"]
    data_full = data if data.is_absolute() else Path(base_dir) / data
    _check_data_file(data_full, entry["file_name"], key, what)
    return {
        "path": str(data),
        "format": formatting,
        "attr": attributes(entry),
        "entry": name,
        "dataset_info": str(info),
    }


def _read_table(full: Path, key: str) -> dict:
    """The named entries of a dataset_info.json; refused when it is missing or not a JSON object."""
    if not full.is_file():
        raise LFDatasetError(f"{key}: {full} not found")
    try:
        table = json.loads(full.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LFDatasetError(f"{key}: {full} is not valid JSON ({exc})") from None
    if not isinstance(table, dict):
        raise LFDatasetError(f"{key}: {full} must hold an object of named entries")
    return table


def _entry_name(src: dict, table: dict, full: Path, where: str) -> str:
    """The entry the source item names; refused when it names none or one the file lacks."""
    name = src.get("name")
    if not name:
        entries = ", ".join(sorted(table)) or "none"
        raise LFDatasetError(f"config key {where}.name: missing; the entry of {full} to read ({entries})")
    if name not in table:
        raise LFDatasetError(
            f"config key {where}.name: {full} has no entry {name!r} "
            f"(entries: {', '.join(sorted(table)) or 'none'})"
        )
    return name


def _check_entry(entry: object, key: str, what: str, where: str, preference: bool = False) -> str:
    """The entry's formatting; refused when LLaMA-Factory would read it in a way this pipeline cannot."""
    if not isinstance(entry, dict):
        raise LFDatasetError(f"{key}: {what} must be an object")
    remote = [k for k in REMOTE_KEYS if k in entry]
    if remote:
        raise LFDatasetError(
            f"{key}: {what} loads from {remote[0]} ({entry[remote[0]]!r}); this pipeline reads local "
            "files only: download the data and point the entry's file_name at it"
        )
    if "file_name" not in entry:
        raise LFDatasetError(f"{key}: {what} has no file_name")
    columns = entry.get("columns") if isinstance(entry.get("columns"), dict) else {}
    if preference:
        _check_preference_entry(entry, columns, key, what)
    elif entry.get("ranking"):
        raise LFDatasetError(
            f"{key}: {what} sets ranking (preference data for DPO/RM); the SFT stage does not train on "
            "it: give it under preference.data.sources"
        )
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise LFDatasetError(
            f"{key}: {what} has formatting {formatting!r}; only alpaca and sharegpt are supported"
        )
    for col, kind in UNSUPPORTED_COLUMNS.items():
        if preference and col in PREFERENCE_COLUMNS:
            continue
        if columns.get(col):
            where_to = " (under preference.data.sources)" if col in PREFERENCE_COLUMNS else ""
            raise LFDatasetError(
                f"{key}: {what} sets columns.{col} ({kind}); this stage trains on text "
                f"{'preference data' if preference else 'SFT'} only{where_to}"
            )
    if entry.get("num_samples") is not None:
        raise LFDatasetError(
            f"{key}: {what} sets num_samples (LLaMA-Factory samples rows at random); use weight in "
            f"{where} instead"
        )
    if entry.get("split", "train") != "train":
        raise LFDatasetError(f"{key}: {what} sets split {entry['split']!r}; a local file has only 'train'")
    for section in ("columns", "tags"):
        if section in entry and not isinstance(entry[section], dict):
            raise LFDatasetError(f"{key}: {what} has {section} that is not an object")
    return formatting


PREFERENCE_COLUMNS = ("chosen", "rejected", "kto_tag")


def _check_preference_entry(entry: dict, columns: dict, key: str, what: str) -> None:
    """A pair entry (ranking, columns.chosen and columns.rejected) or a KTO entry (columns.kto_tag,
    no ranking), as LLaMA-Factory's dpo and kto stages read them."""
    if entry.get("ranking"):
        missing = [c for c in ("chosen", "rejected") if not columns.get(c)]
        if missing:
            raise LFDatasetError(
                f"{key}: {what} sets ranking but not columns.{missing[0]}: LLaMA-Factory reads the pair "
                "from columns.chosen and columns.rejected"
            )
        if columns.get("kto_tag"):
            raise LFDatasetError(
                f"{key}: {what} sets ranking and columns.kto_tag: an entry holds pairs or KTO rows, not both"
            )
    elif not columns.get("kto_tag"):
        raise LFDatasetError(
            f"{key}: {what} is no preference data: set ranking: true with columns.chosen and "
            "columns.rejected (pairs), or columns.kto_tag (KTO rows)"
        )


def _check_data_file(data_full: Path, file_name: str, key: str, what: str) -> None:
    """Whether the entry's file is one file llmft reads: not a folder, nor a missing, odd or empty file."""
    problem = path_problem(data_full)
    if problem and problem != "not found":
        raise LFDatasetError(f"{key}: {what}: file_name {file_name!r} {problem} ({data_full})")
    if data_full.is_dir():
        raise LFDatasetError(
            f"{key}: {what} names a folder ({data_full}); llmft reads one file per entry: give each file "
            "its own entry and source"
        )
    if not data_full.is_file():
        raise LFDatasetError(f"{key}: {what}: file_name {file_name!r} not found ({data_full})")
    if data_full.suffix not in SUFFIXES:
        raise LFDatasetError(f"{key}: {what}: file_name {file_name!r} is not .json, .jsonl or .parquet")
    if data_full.stat().st_size == 0:
        raise LFDatasetError(f"{key}: {what}: {data_full} is empty")


# Raw columns that other LLaMA-Factory stages read (media, preference, KTO, pretraining text): kept
# in the view when the entry maps nothing to them, so the row checks refuse them by name.
OTHER_STAGE_COLUMNS = ("images", "videos", "audios", "chosen", "rejected", "label", "text")


def view(raw: object, attr: dict) -> object:
    """_view, plus the OTHER_STAGE_COLUMNS the entry does not map."""
    out = _view(raw, attr)
    if isinstance(raw, dict):
        used = {v for v in attr.values() if isinstance(v, str)}
        out.update({c: raw[c] for c in OTHER_STAGE_COLUMNS if c in raw and c not in used and c not in out})
    return out


def _view(raw: object, attr: dict) -> object:
    """A raw row as LLaMA-Factory's converter for `attr` reads it, in llmft's own spelling (alpaca
    instruction/input/output/system/history/tools; sharegpt conversations of from/value with
    human/gpt/observation/function_call/system), so the ordinary checks apply. Fields the entry does
    not map are not read; roles that match no tag are kept, for the checks to name."""
    if not isinstance(raw, dict):
        return raw
    out: dict = {}
    if attr["formatting"] == "alpaca":
        for ours, col in (("instruction", "prompt"), ("input", "query"), ("output", "response")):
            out[ours] = raw.get(attr[col]) if attr[col] else None
        if not attr["prompt"]:  # LLaMA-Factory joins whichever of prompt and query are there
            out["instruction"], out["input"] = out["input"], None
        if attr["history"] and isinstance(raw.get(attr["history"]), list):
            out["history"] = raw[attr["history"]]
    else:
        roles = {
            attr["user_tag"]: "human",
            attr["assistant_tag"]: "gpt",
            attr["observation_tag"]: "observation",
            attr["function_tag"]: "function_call",
            attr["system_tag"]: "system",
        }
        roles.pop(None, None)
        messages = raw.get(attr["messages"]) if attr["messages"] else None
        if isinstance(messages, list):
            conv = []
            for m in messages:
                if isinstance(m, dict):
                    role = m.get(attr["role_tag"]) if attr["role_tag"] else None
                    content = m.get(attr["content_tag"]) if attr["content_tag"] else None
                    if isinstance(role, str) and role not in roles and role in _OWN_ROLES:
                        role = f"{role} (matches no tag of the entry)"
                    m = {"from": roles.get(role, role) if isinstance(role, str) else role, "value": content}
                conv.append(m)
            out["conversations"] = conv
            if conv and isinstance(conv[0], dict) and conv[0]["from"] == "system" and attr["system_tag"]:
                # LLaMA-Factory takes a first system turn and then ignores the system column
                return out | ({"tools": raw.get(attr["tools"])} if attr["tools"] else {})
        else:
            out["conversations"] = messages
    if attr["system"]:
        out["system"] = raw.get(attr["system"])
    if attr["tools"]:
        out["tools"] = raw.get(attr["tools"])
    return out


def field_name(field: str | None, attr: dict) -> str | None:
    """A RowError field in llmft's spelling, named as the file names it."""
    if not field:
        return field
    if attr["formatting"] == "alpaca":
        head, sep, rest = field.partition("[")
        col = {"instruction": "prompt", "input": "query", "output": "response"}.get(head, head)
        name = attr.get(col) or head
        if head == "instruction" and not attr["prompt"]:
            name = attr["query"] or head
        return name + sep + rest
    if field.startswith("conversations"):
        field = (attr["messages"] or "conversations") + field[len("conversations") :]
        field = field.replace(".from", "." + (attr["role_tag"] or "from"))
        field = field.replace(".value", "." + (attr["content_tag"] or "value"))
    return field
