"""A continued run's train rows (model.continue_from): the rows new since the parent run, plus a
deterministic replay sample of the parent's rows still in the data, sized as a share of the run's own
train rows (so a night's cost follows its new rows, not the history), each row identified by its content
key (the one dedup and the split use). The held-out side never moves: the split is by content, and a
parent's train row found on the held-out side stops the stage.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from llmft.core.dedup import content_key
from llmft.core.io import atomic_path
from llmft.core.lineage import TRAIN_KEYS_FILE
from llmft.core.sources import DataError

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def write_keys(path: Path, keys: np.ndarray) -> None:
    """Sorted distinct uint64 keys, little-endian, written atomically."""
    with atomic_path(path) as tmp:
        np.unique(keys).astype("<u8").tofile(tmp)


def read_keys(path: Path) -> np.ndarray:
    data = Path(path).read_bytes()
    if len(data) % 8:
        raise DataError(f"{path}: not a train-keys file ({len(data)} bytes, not a multiple of 8)")
    return np.frombuffer(data, dtype="<u8").astype(np.uint64)


def keys_from_jsonl(path: Path) -> np.ndarray:
    """The content keys of a train.jsonl's rows: a run prepared before train_keys.u64 existed trained
    every train row, so its train.jsonl holds them all."""
    keys = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            keys.append(int.from_bytes(bytes.fromhex(content_key(json.loads(line)))[:8], "little"))
    return np.unique(np.array(keys, dtype=np.uint64))


def parent_keys(run_dir: Path) -> np.ndarray:
    """A parent run's train keys: its train_keys.u64, else (an older run) its train.jsonl's."""
    recorded = run_dir / "data" / TRAIN_KEYS_FILE
    return read_keys(recorded) if recorded.is_file() else keys_from_jsonl(run_dir / "data" / "train.jsonl")


def _mix(keys: np.ndarray, salt: str) -> np.ndarray:
    """splitmix64 of key ^ salt: a stable pseudo-random rank per key, independent of row order."""
    seed = np.uint64(int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "little"))
    with np.errstate(over="ignore"):
        z = (keys ^ seed) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & _MASK


def replay_count(new: int, present: int, fraction: float) -> int:
    """How many of the parent's rows still in the data replay: enough that they are `fraction` of the
    distinct rows this run trains (new + replayed), rounded, and never more than there are."""
    return min(present, int(round(new * fraction / (1.0 - fraction))))


def select(
    keys: np.ndarray,
    heldout: np.ndarray,
    final: np.ndarray,
    row_tokens: np.ndarray,
    parent: dict | None,
) -> tuple[np.ndarray, dict]:
    """The train repeats per row after the selection, and the counts.

    `final` is the repeats of every row (held-out ones included; 0 = dropped); `parent` is None (a run
    from the base model: every train row trains) or {run, keys, fraction, salt}. Counts are distinct
    rows; train_rows and tokens count each row as often as it trains (data.sources[].weight)."""
    train = ~heldout & (final > 0)
    full_tokens = int((final[train] * row_tokens[train]).sum())
    if parent is None:
        delta = {"new": int(train.sum()), "replayed": 0, "removed": 0}
        out = final
    else:
        moved = np.isin(parent["keys"], keys[heldout & (final > 0)])
        if moved.any():
            raise DataError(
                f"{int(moved.sum())} train rows of model.continue_from run {parent['run']!r} are held out "
                "here: the held-out split moved (data.heldout_fraction or data.split_salt changed?)"
            )
        seen = np.isin(keys, parent["keys"]) & train
        new = train & ~seen
        present = np.flatnonzero(seen)
        k = replay_count(int(new.sum()), len(present), parent["fraction"])
        chosen = present[np.argsort(_mix(keys[present], parent["salt"]), kind="stable")[:k]]
        keep = new.copy()
        keep[chosen] = True
        out = np.where(keep | heldout, final, 0)
        removed = len(parent["keys"]) - int(np.isin(parent["keys"], keys[train]).sum())
        delta = {"new": int(new.sum()), "replayed": int(k), "removed": removed}
    trained = ~heldout & (out > 0)
    delta["train_rows"] = int(out[trained].sum())
    delta["full_train_rows"] = int(final[train].sum())
    delta["tokens"] = {
        "trained": int((out[trained] * row_tokens[trained]).sum()),
        "full_retrain": full_tokens,
    }
    return out, delta
