"""Dataset preparation: read, validate, clean, dedup, length-filter, split stably, write LLaMA-Factory's
dataset_info.json and stats.

A row's side of the split is decided by a hash of its normalised content, so appending rows for the
next nightly retrain never moves an existing row between train and held-out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import unicodedata
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from .io import write_json, write_jsonl

log = logging.getLogger("llmft.data")

TRAIN_NAME = "llmft_train"
HELDOUT_NAME = "llmft_heldout"
ALPACA_FIELDS = ("instruction", "input", "output")


class DataError(ValueError):
    """A dataset row is wrong; the message names the file, the row and the field."""


def normalise(text: str) -> str:
    """NFC, unified newlines, stripped ends, inner runs of spaces collapsed."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(" ".join(line.split()) for line in text.strip().split("\n"))


def content_key(row: dict) -> str:
    """Hash of a row's normalised content: the identity used for dedup and the split."""
    payload = "\x1f".join(normalise(row.get(f, "")).casefold() for f in ALPACA_FIELDS)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def is_heldout(key: str, fraction: float, salt: str) -> bool:
    """Deterministic side of the split for a content key (independent of every other row)."""
    digest = hashlib.sha256(f"{salt}\x1f{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def iter_alpaca(path: str | Path) -> Iterator[tuple[int, object]]:
    """Yield (row number, raw row) from .jsonl (streamed) or .json (an array); numbers start at 1."""
    path = Path(path)
    if path.suffix == ".jsonl":
        with open(path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield lineno, DataError(f"{path} row {lineno}: not valid UTF-8 ({exc.reason})")
                    continue
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as exc:
                    yield lineno, DataError(f"{path} row {lineno}: not valid JSON ({exc.msg})")
    else:
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{path}: not a valid UTF-8 JSON file ({exc})") from exc
        if not isinstance(rows, list):
            raise DataError(f"{path}: a .json dataset must be an array of rows")
        yield from enumerate(rows, 1)


def check_row(path, lineno: int, row: object) -> dict:
    """Validate one alpaca row; return it cleaned, or raise DataError naming row and field."""
    if isinstance(row, DataError):
        raise row
    if not isinstance(row, dict):
        raise DataError(f"{path} row {lineno}: expected an object, got {type(row).__name__}")
    clean = {}
    for field in ALPACA_FIELDS:
        value = row.get(field, "" if field == "input" else None)
        if value is None:
            raise DataError(f"{path} row {lineno}: field '{field}' is missing")
        if not isinstance(value, str):
            raise DataError(
                f"{path} row {lineno}: field '{field}' must be a string, got {type(value).__name__}"
            )
        clean[field] = normalise(value)
        if field != "input" and not clean[field]:
            raise DataError(f"{path} row {lineno}: field '{field}' is empty")
    if "task" in row and isinstance(row["task"], str):
        clean["task"] = row["task"]
    return clean


def _length_counter(tokenizer_dir: str | Path, template_name: str):
    """Token count of prompt + answer exactly as LLaMA-Factory's template will encode the row."""
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    template = get_template_and_fix_tokenizer(tokenizer, DataArguments(template=template_name))

    def count(row: dict) -> int:
        prompt = row["instruction"] + ("\n" + row["input"] if row["input"] else "")
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": row["output"]},
        ]
        prompt_ids, answer_ids = template.encode_oneturn(tokenizer, messages)
        return len(prompt_ids) + len(answer_ids)

    return count


def _histogram(lengths: list[int], cutoff: int, bins: int = 16) -> dict:
    width = max(1, -(-max(cutoff, max(lengths, default=1)) // bins))
    counts = Counter(min(n // width, bins - 1) for n in lengths)
    return {
        "bin_width": width,
        "edges": [i * width for i in range(bins + 1)],
        "counts": [counts.get(i, 0) for i in range(bins)],
    }


def prepare(
    sources: list[dict],
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    template: str,
    cutoff_len: int,
    heldout_fraction: float,
    split_salt: str,
    invalid_rows: str = "fail",
) -> dict:
    """Run the whole preparation; write train/heldout JSONL, dataset_info.json and stats.json."""
    out_dir = Path(out_dir)
    count_tokens = _length_counter(tokenizer_dir, template)
    seen: set[str] = set()
    train: list[dict] = []
    heldout: list[dict] = []
    stats = {
        "sources": [],
        "rows_read": 0,
        "invalid": 0,
        "invalid_examples": [],
        "duplicates": 0,
        "too_long": 0,
    }
    lengths: list[int] = []
    for src in sources:
        path, weight = src["path"], float(src.get("weight", 1.0))
        src_stats = {"path": str(path), "weight": weight, "rows": 0, "kept": 0}
        src_train: list[dict] = []
        for lineno, raw in iter_alpaca(path):
            src_stats["rows"] += 1
            try:
                row = check_row(path, lineno, raw)
            except DataError as exc:
                if invalid_rows == "fail":
                    raise
                stats["invalid"] += 1
                if len(stats["invalid_examples"]) < 20:
                    stats["invalid_examples"].append(str(exc))
                continue
            key = content_key(row)
            if key in seen:
                stats["duplicates"] += 1
                continue
            seen.add(key)
            n_tokens = count_tokens(row)
            lengths.append(n_tokens)
            if n_tokens > cutoff_len:
                stats["too_long"] += 1
                continue
            src_stats["kept"] += 1
            if is_heldout(key, heldout_fraction, split_salt):
                heldout.append(row)
            else:
                src_train.append(row)
        train.extend(_weighted(src_train, weight, split_salt))
        stats["rows_read"] += src_stats["rows"]
        stats["sources"].append(src_stats)
    if not train:
        raise DataError("no training rows left after validation, dedup and length filter")
    if not heldout:
        raise DataError(
            f"no held-out rows: raise data.heldout_fraction or add rows ({len(train)} train rows kept)"
        )
    stats.update(
        {
            "train_rows": len(train),
            "heldout_rows": len(heldout),
            "cutoff_len": cutoff_len,
            "heldout_fraction": heldout_fraction,
            "length_histogram": _histogram(lengths, cutoff_len),
            "max_tokens": max(lengths),
            "mean_tokens": round(sum(lengths) / len(lengths), 2),
            "tasks_heldout": dict(Counter(r.get("task", "") for r in heldout)),
            "fingerprint": fingerprint(train, heldout),
        }
    )
    write_jsonl(out_dir / "train.jsonl", train)
    write_jsonl(out_dir / "heldout.jsonl", heldout)
    write_json(out_dir / "dataset_info.json", dataset_info())
    write_json(out_dir / "stats.json", stats)
    log.info(
        "prepared %d train / %d held-out rows (%d invalid, %d duplicates, %d over %d tokens)",
        len(train),
        len(heldout),
        stats["invalid"],
        stats["duplicates"],
        stats["too_long"],
        cutoff_len,
    )
    return stats


def _weighted(rows: list[dict], weight: float, salt: str) -> list[dict]:
    """Repeat rows int(weight) times, plus a hash-chosen share for the fractional part."""
    whole, frac = int(weight), weight - int(weight)
    out = [r for r in rows for _ in range(whole)]
    out += [r for r in rows if frac and is_heldout(content_key(r), frac, salt + ":mix")]
    return out


def fingerprint(train: list[dict], heldout: list[dict]) -> str:
    h = hashlib.sha256()
    for side, rows in (("train", train), ("heldout", heldout)):
        h.update(side.encode())
        for row in rows:
            h.update(content_key(row).encode())
    return h.hexdigest()[:16]


def dataset_info() -> dict:
    columns = {"prompt": "instruction", "query": "input", "response": "output"}
    return {
        TRAIN_NAME: {"file_name": "train.jsonl", "columns": columns},
        HELDOUT_NAME: {"file_name": "heldout.jsonl", "columns": columns},
    }
