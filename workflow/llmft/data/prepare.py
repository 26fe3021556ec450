"""Dataset preparation: read, validate, dedup (exact and near), decontaminate, length-filter by real
token count, split stably, and tokenize once for LLaMA-Factory.

Rows stream through in chunks: memory holds a few chunks plus ~30 bytes of bookkeeping a row, never
the dataset. Worker processes (forked, one per core) tokenize chunks and compute their MinHash while
the main process reads, validates and writes. Processes, not the tokenizer's own thread pool: its
threads wait for each other and lose their speed-up on a busy machine; separate processes do not.

A row's side of the split is decided by a hash of its normalised content, so appending rows for the
next nightly retrain never moves an existing row between train and held-out. Near-duplicate and
decontamination decisions keep the earlier row and only look backwards in stream order, so rows
appended later do not change what happens to earlier ones (a train row can still be dropped when a
new held-out row is its near-duplicate: it leaves train, it never moves to held-out).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from llmft.core.conversation import SHAREGPT_TAGS, sharegpt_line
from llmft.core.dedup import NearDupIndex, SeenKeys, content_key, payload
from llmft.core.heldout import is_heldout
from llmft.core.io import write_json
from llmft.core.lf import lfdataset
from llmft.core.lf.pretokenize import TOKENIZED_DIR
from llmft.core.lineage import TRAIN_KEYS_FILE
from llmft.core.sources import (
    FORMATS,
    DataError,
    FileError,
    RowError,
    check_with_template,
    iter_raw,
    validate,
)
from llmft.core.text import normalise
from llmft.data.delta import select, write_keys

log = logging.getLogger("llmft.data.prepare")

TRAIN_NAME = "llmft_train"
HELDOUT_NAME = "llmft_heldout"
CHUNK_ROWS = 2048
EXAMPLES_KEPT = 20
# Under `invalid_rows: drop` the log names this many bad rows; rejected.jsonl names all of them.
LOGGED_DROPS = 200

# What forked worker processes use, set before the pool starts: (SFTEncoder, MinHasher or None).
_WORKER: tuple | None = None

__all__ = ["DataError", "content_key", "is_heldout", "normalise", "prepare", "FORMATS"]


def _repeats(key: str, weight: float, salt: str) -> int:
    """Copies of a train row in the mix: int(weight), plus one for a hash-chosen share of rows
    for the fractional part (stable: the same rows every run)."""
    whole, frac = int(weight), weight - int(weight)
    return whole + (1 if frac and is_heldout(key, frac, salt + ":mix") else 0)


@dataclass
class _SourceStats:
    path: str
    format: str
    weight: float
    rows: int = 0
    invalid: int = 0
    duplicates: int = 0
    too_long: int = 0
    near_duplicates: int = 0
    decontaminated: int = 0
    kept: int = 0  # distinct rows that passed every check, before weights repeat them
    train_rows: int = 0
    heldout_rows: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Side:
    """Spooled output of one side of the split: tokenized rows and their JSONL, in the same order."""

    tokenized: object
    jsonl: object
    columns: set = field(default_factory=set)


class _Preparer:
    def __init__(
        self, out_dir: Path, encoder, cutoff_len, heldout_fraction, split_salt, invalid_rows, dedup, workers
    ):
        from llmft.core.lf.pretokenize import SplitWriter

        self.out_dir = out_dir
        self.tmp = out_dir / ".prepare_data.tmp"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.encoder = encoder
        self.cutoff_len = cutoff_len
        self.fraction = heldout_fraction
        self.salt = split_salt
        self.policy = invalid_rows
        self.near_dedup = bool(dedup["near"])
        self.decontaminate = bool(dedup["decontaminate"])
        self.near = None
        if self.near_dedup or self.decontaminate:
            self.near = NearDupIndex(self.tmp / "minhash", dedup["threshold"], dedup["num_perm"])
        self.seen = SeenKeys()
        self.sides = {
            False: _Side(SplitWriter(self.tmp / TOKENIZED_DIR / "train"), self._open("train.jsonl")),
            True: _Side(SplitWriter(self.tmp / TOKENIZED_DIR / "validation"), self._open("heldout.jsonl")),
        }
        self.rejected = self._open("rejected.jsonl")
        self.sources: list[_SourceStats] = []
        # Per kept row, in stream order (the near-duplicate index uses the same order).
        self.meta: dict[str, list[np.ndarray]] = {
            k: [] for k in ("heldout", "source", "row", "repeats", "key", "length")
        }
        self.length_counts = np.zeros(1, dtype=np.int64)
        self.invalid_by_reason: Counter = Counter()
        self.invalid_examples: list[dict] = []
        self.invalid_total = 0
        global _WORKER
        _WORKER = (encoder, self.near.hasher if self.near else None)
        self.workers = max(1, workers)
        self.pool = multiprocessing.get_context("fork").Pool(self.workers, initializer=_init_worker)
        self.pending: deque = deque()
        self.started = time.perf_counter()
        self.rows_read = 0
        self.clean_text = True  # config data.clean_text
        self.max_row_bytes = None  # config data.max_row_bytes (None: the schema's default)
        self.parent = None  # model.continue_from: data.delta.select's `parent`

    def _open(self, name: str):
        return open(self.tmp / name, "w", encoding="utf-8")

    # -- streaming

    def run_source(self, index: int, src: dict) -> None:
        path, fmt = str(src["path"]), src.get("format", "alpaca")
        attr = src.get("attr")  # a dataset_info.json entry's columns and tags (lfdataset.resolve)
        stats = _SourceStats(path, fmt, float(src.get("weight", 1.0)))
        self.sources.append(stats)
        chunk: list[tuple[int, dict]] = []
        try:
            for number, raw in iter_raw(path, src.get("split", "train"), self.max_row_bytes):
                stats.rows += 1
                self.rows_read += 1
                if attr is not None:
                    raw = lfdataset.view(raw, attr)
                row = validate(path, number, raw, fmt, self.clean_text)
                if not isinstance(row, RowError) and "messages" in row:
                    row = check_with_template(path, number, raw, row, self.encoder.template) or row
                if isinstance(row, RowError):
                    if attr is not None:
                        row = dataclasses.replace(row, field=lfdataset.field_name(row.field, attr))
                    self._invalid(row, stats)
                    continue
                if self.invalid_total and self.policy == "fail":
                    continue  # the run will fail: only validate the rest, to report every bad row
                chunk.append((number, row))
                if len(chunk) >= CHUNK_ROWS:
                    self._submit(index, stats, chunk)
                    chunk = []
                if self.rows_read % 200_000 == 0:
                    rate = self.rows_read / (time.perf_counter() - self.started)
                    log.info("%d rows read (%.0f rows/s)", self.rows_read, rate)
        except FileError as exc:
            raise DataError(str(exc)) from None
        if chunk and not (self.invalid_total and self.policy == "fail"):
            self._submit(index, stats, chunk)

    def _invalid(self, err: RowError, stats: _SourceStats) -> None:
        stats.invalid += 1
        self.invalid_total += 1
        self.invalid_by_reason[err.reason] += 1
        record = err.as_dict()
        if len(self.invalid_examples) < EXAMPLES_KEPT:
            self.invalid_examples.append(record)
        if self.policy == "fail" or self.invalid_total <= LOGGED_DROPS:
            log.warning("bad row: %s", record["message"])
        self.rejected.write(json.dumps(record, ensure_ascii=False) + "\n")

    def _reject(self, source: str, row: int, reason: str, message: str) -> None:
        record = {"source": source, "row": row, "field": None, "reason": reason, "message": message}
        self.rejected.write(json.dumps(record, ensure_ascii=False) + "\n")

    def _submit(self, index: int, stats: _SourceStats, chunk: list[tuple[int, dict]]) -> None:
        numbers = np.array([number for number, _ in chunk], dtype=np.int64)
        args = ([row for _, row in chunk], stats.weight, self.fraction, self.salt)
        self.pending.append((index, stats, numbers, self.pool.apply_async(_work_chunk, args)))
        # Two chunks in flight per worker: no worker waits for the reader, memory stays bounded.
        while len(self.pending) > 2 * self.workers:
            self._finish(*self.pending.popleft())

    def _finish(self, index: int, stats: _SourceStats, numbers: np.ndarray, future) -> None:
        from llmft.core.lf.pretokenize import record_batch

        done: _Chunk = future.get()
        # Chunks finish in reading order, so the first of a set of duplicates is the one kept.
        new = self.seen.add(done.keys)
        for i in np.flatnonzero(~new):
            stats.duplicates += 1
            self._reject(
                stats.path, int(numbers[i]), "duplicate", f"{stats.path} row {numbers[i]}: exact duplicate"
            )
        lengths = done.enc.lengths
        top = int(lengths.max()) + 1
        if top > len(self.length_counts):
            self.length_counts = np.concatenate(
                (self.length_counts, np.zeros(top - len(self.length_counts), np.int64))
            )
        self.length_counts[:top] += np.bincount(lengths[new], minlength=top)
        fits = lengths <= self.cutoff_len
        for i in np.flatnonzero(new & ~fits):
            stats.too_long += 1
            self._reject(
                stats.path,
                int(numbers[i]),
                "too_long",
                f"{stats.path} row {numbers[i]}: {lengths[i]} tokens > cutoff_len {self.cutoff_len}",
            )
        keep = new & fits
        if not keep.any():
            return
        enc = done.enc.select(keep) if not keep.all() else done.enc
        heldout, flags = done.heldout[keep], done.flags[keep]
        lines = [line for line, k in zip(done.lines, keep, strict=True) if k]
        for side_value, side in self.sides.items():
            mask = heldout == side_value
            if not mask.any():
                continue
            side.tokenized.write(record_batch(enc.select(mask)))
            side.jsonl.write("\n".join(line for line, m in zip(lines, mask, strict=True) if m) + "\n")
            side_flags = np.bitwise_or.reduce(flags[mask])
            side.columns.update(name for bit, name in _COLUMN_FLAGS if side_flags & bit)
        n = int(keep.sum())
        self.meta["heldout"].append(heldout)
        self.meta["source"].append(np.full(n, index, dtype=np.int32))
        self.meta["row"].append(numbers[keep])
        self.meta["repeats"].append(done.repeats[keep])
        self.meta["key"].append(done.keys[keep])
        self.meta["length"].append(lengths[keep].astype(np.int64))
        if self.near is not None:
            self.near.add(done.sig[keep])

    def drain(self) -> None:
        while self.pending:
            self._finish(*self.pending.popleft())
        self.pool.close()
        self.pool.join()

    def close(self) -> None:
        """Stop the worker and remove the spool, on success and on error alike."""
        global _WORKER
        self.pool.terminate()
        self.pool.join()
        _WORKER = None
        for side in self.sides.values():
            side.jsonl.close()
        self.rejected.close()
        if self.near is not None:
            self.near.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- decisions that need every row: near duplicates and decontamination

    def near_duplicate_drops(self, heldout: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dropped as a near-duplicate of an earlier row, dropped as near-duplicate of a held-out row).

        For a similar pair (earlier a, later z): with near-dedup on, z goes (whatever its side, so
        a pair never survives across the split either); otherwise, if they sit on different sides,
        the train one goes."""
        n = len(heldout)
        near = np.zeros(n, dtype=bool)
        contaminated = np.zeros(n, dtype=bool)
        if self.near is None:
            return near, contaminated
        for a, z in self.near.pairs():
            if self.near_dedup:
                near[z] = True
                continue
            cross = heldout[a] != heldout[z]
            a, z = a[cross], z[cross]
            contaminated[np.where(heldout[a], z, a)] = True
        return near, contaminated & ~near


def _init_worker() -> None:
    # One worker process is one thread of tokenizing: the pool provides the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


# Optional columns a row may carry, as bits (LLaMA-Factory's dataset_info declares only those present).
# A side with a `messages` row (a tool row) is written in the sharegpt form.
_COLUMN_FLAGS = ((1, "system"), (2, "history"), (4, "messages"), (8, "tools"))


@dataclass
class _Chunk:
    """A chunk as a worker returns it: one entry per row, in order."""

    keys: np.ndarray  # uint64 content keys (exact dedup)
    heldout: np.ndarray  # bool, the row's side of the split
    repeats: np.ndarray  # int32, copies in the train mix (weights)
    flags: np.ndarray  # uint8, _COLUMN_FLAGS the row has
    lines: list[str]  # the row as a JSONL line
    enc: object  # pretokenize.Encoded
    sig: np.ndarray | None  # MinHash signatures


def _work_chunk(rows: list[dict], weight: float, fraction: float, salt: str) -> _Chunk:
    """Everything per row that needs no other row: identity, side, tokens, signature, JSON."""
    encoder, hasher = _WORKER
    payloads = [payload(row) for row in rows]
    digests = [hashlib.sha256(p.encode("utf-8")).digest() for p in payloads]
    keys = np.frombuffer(b"".join(d[:8] for d in digests), dtype="<u8").astype(np.uint64)
    hexes = [d.hex() for d in digests]
    heldout = np.array([is_heldout(h, fraction, salt) for h in hexes], dtype=bool)
    repeats = np.array(
        [1 if side else _repeats(h, weight, salt) for h, side in zip(hexes, heldout, strict=True)],
        dtype=np.int32,
    )
    flags = np.array([sum(bit for bit, name in _COLUMN_FLAGS if name in row) for row in rows], dtype=np.uint8)
    return _Chunk(
        keys=keys,
        heldout=heldout,
        repeats=repeats,
        flags=flags,
        lines=[json.dumps(row, ensure_ascii=False) for row in rows],
        enc=encoder.encode(rows),
        sig=hasher.signatures(payloads, keys) if hasher is not None else None,
    )


def _concat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _as_sharegpt(line: str, tools: bool) -> str:
    """A JSONL line of a side written in the sharegpt form: plain rows gain their `messages`, and
    with a tools column every row has one (one JSON schema for the whole file)."""
    row = sharegpt_line(json.loads(line))
    if tools and "tools" not in row:
        row = {**row, "tools": ""}
    return json.dumps(row, ensure_ascii=False) + "\n"


def _rewrite_side(
    side_dir: Path,
    jsonl: Path,
    keep_repeats: np.ndarray,
    out_tok: Path,
    out_jsonl: Path,
    columns: set = frozenset(),
) -> None:
    """Copy a spooled side with each row written `keep_repeats[i]` times (0 = dropped); a side
    with tool rows (`messages` in `columns`) is written in the sharegpt form."""
    import pyarrow as pa
    from llmft.core.lf.pretokenize import SplitWriter

    sharegpt = "messages" in columns
    if (keep_repeats == 1).all() and not sharegpt:
        shutil.move(str(jsonl), out_jsonl)
        shutil.move(str(side_dir), out_tok)
        return
    if (keep_repeats == 1).all():
        shutil.move(str(side_dir), out_tok)
        with open(jsonl, encoding="utf-8") as src, open(out_jsonl, "w", encoding="utf-8") as dst:
            for line in src:
                dst.write(_as_sharegpt(line, "tools" in columns))
        return
    writer = SplitWriter(out_tok)
    start = 0
    source = side_dir / SplitWriter.FILE
    # Plain reads, not a memory map: mapped pages would count as resident and grow with the data.
    with pa.OSFile(str(source)) as fh:
        reader = pa.ipc.open_stream(fh)
        for batch in reader:
            reps = keep_repeats[start : start + batch.num_rows]
            start += batch.num_rows
            idx = np.repeat(np.arange(batch.num_rows), reps)
            if len(idx):
                writer.write(batch.take(pa.array(idx)))
    writer.close()
    with open(jsonl, encoding="utf-8") as src, open(out_jsonl, "w", encoding="utf-8") as dst:
        for line, reps in zip(src, keep_repeats, strict=True):
            if reps:
                if sharegpt:
                    line = _as_sharegpt(line, "tools" in columns)
                dst.write(line * int(reps))
    shutil.rmtree(side_dir)


def _histogram(length_counts: np.ndarray, cutoff: int, bins: int = 16) -> dict:
    lengths = np.flatnonzero(length_counts)
    top = int(lengths.max()) if len(lengths) else 1
    width = max(1, -(-max(cutoff, top) // bins))
    counts = np.zeros(bins, dtype=np.int64)
    np.add.at(counts, np.minimum(np.arange(len(length_counts)) // width, bins - 1), length_counts)
    return {
        "bin_width": width,
        "edges": [i * width for i in range(bins + 1)],
        "counts": counts.tolist(),
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
    dedup: dict | None = None,
    workers: int = 0,
    max_dropped: float = 1.0,
    clean_text: bool = True,
    tokenizer_check: str = "fail",
    max_row_bytes: int | None = None,
    parent: dict | None = None,
) -> dict:
    """Run the whole preparation; write train/heldout JSONL, the tokenized dataset, rejected.jsonl,
    dataset_info.json and stats.json into `out_dir`.

    `max_dropped`: the largest share of the rows read that the length filter, or invalid rows
    dropped under invalid_rows: drop, may take before the stage fails (config data.max_dropped_fraction).

    `dedup`: {near: bool, decontaminate: bool, threshold: float, num_perm: int} (config data.dedup).
    `workers`: tokenizing processes; 0 = one per core this process may use.
    `clean_text` (config data.clean_text): clean row texts (core.text.clean_text) or keep them as
    LLaMA-Factory reads them.
    `tokenizer_check` (config data.tokenizer_check): fail or warn when the loaded tokenizer encodes
    the probes differently from its tokenizer.json.
    `max_row_bytes` (config data.max_row_bytes; None = its schema default): a longer JSON row is a
    bad row, never read whole.
    `parent` (model.continue_from): {run, keys, fraction, salt}: train only the rows new since that
    run plus a replay share of its rows (data.delta.select); None: every train row.

    On failure nothing is written into `out_dir`, and an empty `out_dir` is removed.
    """
    from llmft.core.lf.chat_templates import resolved as resolved_template
    from llmft.core.lf.pretokenize import SFTEncoder
    from llmft.data import tokcheck

    out_dir = Path(out_dir)
    dedup = {"near": False, "decontaminate": True, "threshold": 0.8, "num_perm": 64, **(dedup or {})}
    # Before any row is read: `auto` resolved (the stage gets the name Snakemake resolved; the
    # stage also checked that the template fits), and the tokenizer loading as its tokenizer.json
    # encodes.
    template, why = resolved_template(template, tokenizer_dir)
    log.info("template %s: %s", template, why)
    encoder = SFTEncoder(tokenizer_dir, template)
    tokenizer_check = tokcheck.check(encoder.tokenizer, tokenizer_dir, fail=tokenizer_check == "fail")
    workers = workers or len(os.sched_getaffinity(0))
    run = _Preparer(out_dir, encoder, cutoff_len, heldout_fraction, split_salt, invalid_rows, dedup, workers)
    run.template_info = (template, why)
    run.tokenizer_check = tokenizer_check
    run.clean_text = bool(clean_text)
    run.max_row_bytes = max_row_bytes
    run.parent = parent
    stats = None
    try:
        for index, src in enumerate(sources):
            run.run_source(index, src)
        run.drain()
        _check_losses(run, cutoff_len, max_dropped)
        stats = _conclude(run, out_dir, cutoff_len, heldout_fraction)
        return stats
    finally:
        run.close()
        if stats is None:
            # An empty data folder (Snakemake makes it before the job starts) reads as a started
            # run; rmdir removes it only when empty: other files are not this stage's to clear.
            with contextlib.suppress(OSError):
                out_dir.rmdir()


def _check_losses(run: _Preparer, cutoff_len: int, max_dropped: float) -> None:
    """Loud data loss: an empty source, or more rows dropped than allowed, stops the stage, naming the
    cause and the key that fixes it."""
    for i, stats in enumerate(run.sources):
        if stats.rows == 0:
            raise DataError(f"config key data.sources[{i}].path: {stats.path} holds no rows")
    read = max(1, run.rows_read)
    too_long = sum(s.too_long for s in run.sources)
    if too_long / read > max_dropped:
        # length_counts counts every distinct row, the dropped ones too: its top is the longest row.
        longest = int(np.flatnonzero(run.length_counts).max()) if run.length_counts.any() else 0
        raise DataError(
            f"{too_long} of {run.rows_read} rows exceed data.cutoff_len {cutoff_len} (tokens with the "
            f"template; the longest row has {longest}): raise data.cutoff_len, or allow the loss "
            f"with data.max_dropped_fraction (now {max_dropped:g})"
        )
    if run.policy == "drop" and run.invalid_total / read > max_dropped:
        by_reason = ", ".join(f"{k} {v}" for k, v in sorted(run.invalid_by_reason.items()))
        raise DataError(
            f"{run.invalid_total} of {run.rows_read} rows are invalid ({by_reason}; every one is in the "
            "log): fix the data, or allow the loss with data.max_dropped_fraction "
            f"(now {max_dropped:g})"
        )


def _conclude(run: _Preparer, out_dir: Path, cutoff_len: int, heldout_fraction: float) -> dict:
    _fail_on_invalid(run)
    kept = _kept_rows(run)
    _write_final(run, kept)
    fingerprint = _fingerprint(kept)
    tasks = Counter()
    with open(run.tmp / "final" / "heldout.jsonl", encoding="utf-8") as fh:
        for line in fh:
            if task := json.loads(line).get("task"):  # rows that name no task are not a task
                tasks[str(task)] += 1
    elapsed = time.perf_counter() - run.started
    stats = _stats(run, kept, cutoff_len, heldout_fraction, tasks, fingerprint, elapsed)
    info = dataset_info(run.sides[False].columns, run.sides[True].columns)
    write_json(run.tmp / "final" / "dataset_info.json", info)
    _publish(run.tmp, out_dir)
    write_json(out_dir / "stats.json", stats)
    log.info(
        "prepared %d train / %d held-out rows from %d read (%d invalid, %d duplicates, %d near-duplicates, "
        "%d decontaminated, %d over %d tokens) in %.1f s",
        kept.n_train,
        kept.n_held,
        run.rows_read,
        stats["invalid"],
        stats["duplicates"],
        stats["near_duplicates"],
        stats["decontaminated"],
        stats["too_long"],
        cutoff_len,
        elapsed,
    )
    return stats


def _fail_on_invalid(run: _Preparer) -> None:
    """Under data.invalid_rows: fail, any invalid row stops the stage, showing the first few."""
    if run.invalid_total and run.policy == "fail":
        shown = "\n  ".join(e["message"] for e in run.invalid_examples[:EXAMPLES_KEPT])
        by_reason = ", ".join(f"{k} {v}" for k, v in sorted(run.invalid_by_reason.items()))
        more = run.invalid_total - min(run.invalid_total, EXAMPLES_KEPT)
        raise DataError(
            f"{run.invalid_total} bad row(s) ({by_reason}); data.invalid_rows is 'fail':\n  {shown}"
            + (f"\n  ... and {more} more (every one is in the log)" if more else "")
        )


@dataclass
class _Kept:
    """Per row (in read order) what survives near-dedup and decontamination, and how often."""

    heldout: np.ndarray
    keys: np.ndarray
    row_tokens: np.ndarray
    near: np.ndarray
    contaminated: np.ndarray
    final: np.ndarray  # repeats per row, 0 where dropped
    train_idx: np.ndarray
    held_idx: np.ndarray
    n_train: int
    n_held: int


def _kept_rows(run: _Preparer) -> _Kept:
    """Close the side files, drop near-duplicates and contaminating rows (rejected.jsonl names each),
    count what each source keeps, and stop if a side is empty."""
    for side in run.sides.values():
        side.jsonl.close()
        side.tokenized.close()
    heldout = _concat(run.meta["heldout"], bool)
    source = _concat(run.meta["source"], np.int32)
    row_no = _concat(run.meta["row"], np.int64)
    repeats = _concat(run.meta["repeats"], np.int32)
    keys = _concat(run.meta["key"], np.uint64)
    row_tokens = _concat(run.meta["length"], np.int64)
    near, contaminated = run.near_duplicate_drops(heldout)
    for mask, reason, counter, what in (
        (near, "near_duplicate", "near_duplicates", "near-duplicate of an earlier row"),
        (contaminated, "contaminates_heldout", "decontaminated", "near-duplicate of a held-out row"),
    ):
        for i in np.flatnonzero(mask):
            stats = run.sources[source[i]]
            setattr(stats, counter, getattr(stats, counter) + 1)
            run._reject(stats.path, int(row_no[i]), reason, f"{stats.path} row {row_no[i]}: {what}")
    run.rejected.close()
    final = np.where(near | contaminated, 0, repeats)
    # every train row of the split, recorded for a later run that continues from this one
    run.train_keys = keys[~heldout & (final > 0)]
    final, run.delta = select(keys, heldout, final, row_tokens, run.parent)
    train_idx, held_idx = np.flatnonzero(~heldout), np.flatnonzero(heldout)
    survived = ~(near | contaminated)
    for s, stats in enumerate(run.sources):
        stats.kept = int((survived & (source == s)).sum())
        stats.train_rows = int(final[train_idx][source[train_idx] == s].sum())
        stats.heldout_rows = int(final[held_idx][source[held_idx] == s].sum())
    n_train, n_held = int(final[train_idx].sum()), int(final[held_idx].sum())
    if not n_train and run.parent:
        raise DataError(
            f"no training rows: nothing is new since model.continue_from run {run.parent['run']!r}, and "
            "nightly.replay_fraction is a share of a continued run's rows, so none of its rows replay "
            "either (run without model.continue_from, or add rows)"
        )
    if not n_train:
        raise DataError("no training rows left after validation, dedup and length filter")
    if not n_held:
        raise DataError(
            f"no held-out rows: raise data.heldout_fraction or add rows ({n_train} train rows kept)"
        )
    return _Kept(heldout, keys, row_tokens, near, contaminated, final, train_idx, held_idx, n_train, n_held)


def _write_final(run: _Preparer, kept: _Kept) -> None:
    """The kept rows, repeated as counted, into tmp/final: both JSONL files and the tokenized dataset."""
    from llmft.core.lf.pretokenize import write_dataset_dict

    tmp = run.tmp
    final_tok = tmp / "final" / TOKENIZED_DIR
    final_tok.mkdir(parents=True)
    for idx, split, name, side in (
        (kept.train_idx, "train", "train.jsonl", run.sides[False]),
        (kept.held_idx, "validation", "heldout.jsonl", run.sides[True]),
    ):
        _rewrite_side(
            tmp / TOKENIZED_DIR / split,
            tmp / name,
            kept.final[idx],
            final_tok / split,
            tmp / "final" / name,
            side.columns,
        )
    write_dataset_dict(final_tok, ["train", "validation"])
    write_keys(tmp / "final" / TRAIN_KEYS_FILE, run.train_keys)


def _fingerprint(kept: _Kept) -> str:
    """The content keys of both sides, each repeated as kept: same rows, same fingerprint."""
    fingerprint = hashlib.sha256()
    for side_name, idx in (("train", kept.train_idx), ("heldout", kept.held_idx)):
        fingerprint.update(side_name.encode())
        fingerprint.update(np.repeat(kept.keys[idx], kept.final[idx]).astype("<u8").tobytes())
    return fingerprint.hexdigest()[:16]


def _stats(
    run: _Preparer,
    kept: _Kept,
    cutoff_len: int,
    heldout_fraction: float,
    tasks: Counter,
    fingerprint: str,
    elapsed: float,
) -> dict:
    """stats.json."""
    lengths = run.length_counts
    total_rows = int(lengths.sum())
    final, train_idx, row_tokens = kept.final, kept.train_idx, kept.row_tokens
    return {
        "template": run.template_info[0],
        "template_reason": run.template_info[1],
        "tokenizer_check": run.tokenizer_check,
        "sources": [s.as_dict() for s in run.sources],
        "rows_read": run.rows_read,
        "invalid": run.invalid_total,
        "invalid_by_reason": dict(sorted(run.invalid_by_reason.items())),
        "invalid_examples": run.invalid_examples,
        "duplicates": sum(s.duplicates for s in run.sources),
        "near_duplicates": int(kept.near.sum()),
        "decontaminated": int(kept.contaminated.sum()),
        "too_long": sum(s.too_long for s in run.sources),
        "train_rows": kept.n_train,
        "heldout_rows": kept.n_held,
        "cutoff_len": cutoff_len,
        "heldout_fraction": heldout_fraction,
        "split_salt": run.salt,
        # what trains against all train rows: new since model.continue_from's run, replayed, removed
        "continue": {"parent": run.parent["run"] if run.parent else None, **run.delta},
        "clean_text": run.clean_text,
        "dedup": {
            "near": run.near_dedup,
            "decontaminate": run.decontaminate,
            "threshold": run.near.threshold if run.near else None,
            "num_perm": run.near.num_perm if run.near else None,
            "lsh_bands": run.near.bands if run.near else None,
            "lsh_rows_per_band": run.near.rows_per_band if run.near else None,
        },
        "length_histogram": _histogram(lengths, cutoff_len),
        "max_tokens": int(np.flatnonzero(lengths).max()) if total_rows else 0,
        "mean_tokens": round(float((np.arange(len(lengths)) * lengths).sum() / max(total_rows, 1)), 2),
        # the span a token's causal attention covers when rows train on their own (flops.py)
        "attention_span_tokens": round(
            float((final[train_idx] * row_tokens[train_idx] ** 2).sum())
            / max(float((final[train_idx] * row_tokens[train_idx]).sum()), 1.0),
            2,
        ),
        "tasks_heldout": dict(tasks),
        "tokenized": {"path": TOKENIZED_DIR, "splits": {"train": kept.n_train, "validation": kept.n_held}},
        "fingerprint": fingerprint,
        "seconds": round(elapsed, 2),
        "rows_per_second": round(run.rows_read / elapsed, 1) if elapsed else None,
    }


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move finished outputs into place; the tokenized folder is replaced whole."""
    final = tmp / "final"
    shutil.move(str(tmp / "rejected.jsonl"), final / "rejected.jsonl")
    for name in ("train.jsonl", "heldout.jsonl", "rejected.jsonl", "dataset_info.json", TRAIN_KEYS_FILE):
        os.replace(final / name, out_dir / name)
    target = out_dir / TOKENIZED_DIR
    if target.exists():
        shutil.rmtree(target)
    os.replace(final / TOKENIZED_DIR, target)


def dataset_info(train_columns: set = frozenset(), heldout_columns: set = frozenset()) -> dict:
    """LLaMA-Factory's dataset_info.json; system and history columns only where rows have them
    (a declared column that no row has would fail LLaMA-Factory's loader). A file with tool rows
    is read in the sharegpt form (messages in LLaMA-Factory's own role names, a tools column)."""

    def entry(file_name: str, extra: set) -> dict:
        if "messages" in extra:
            cols = {"messages": "messages"}
            cols.update({k: k for k in ("system", "tools") if k in extra})
            return {"file_name": file_name, "formatting": "sharegpt", "columns": cols, "tags": SHAREGPT_TAGS}
        cols = {"prompt": "instruction", "query": "input", "response": "output"}
        cols.update({k: k for k in ("system", "history") if k in extra})
        return {"file_name": file_name, "columns": cols}

    return {
        TRAIN_NAME: entry("train.jsonl", train_columns),
        HELDOUT_NAME: entry("heldout.jsonl", heldout_columns),
    }
