"""The held-out split: which side a row is on (prepare_data's rows, the preference stage's pairs), the
rows an evaluation scores (evaluate's, the preference stage's) and their fingerprint, the nightly
gate's check that two scores were made on the same rows."""

from __future__ import annotations

import hashlib
import json

from llmft.core.io import read_jsonl


def is_heldout(key: str, fraction: float, salt: str) -> bool:
    """Deterministic side of the split for a content key (independent of every other row)."""
    digest = hashlib.sha256(f"{salt}\x1f{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def heldout_rows(heldout: str, configured: int, max_rows: int | str | None) -> list[dict]:
    """The held-out rows an evaluation scores: the first `max_rows`, every row ("all": the nightly
    gate's pass), or, with None, the first `configured` (eval.max_rows)."""
    rows = read_jsonl(heldout)
    limit = configured if max_rows is None else max_rows
    return rows if limit == "all" else rows[: int(limit)]


def heldout_fingerprint(rows: list[dict]) -> str:
    """The held-out rows a model was scored on, in order: two scores compare only when this matches."""
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]
