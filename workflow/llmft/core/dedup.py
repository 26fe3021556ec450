"""A row's identity (its content key) and exact and near-duplicate detection in numpy, with memory
that stays small as data grows.

Exact: 64-bit content keys in sorted numpy runs (8 bytes a row, no Python objects per row).

Near: MinHash signatures of each row's word 3-grams (normalised, case-folded text), computed for a
whole chunk at once with vectorised hashing. Signatures and LSH band keys are spooled to disk while
rows stream through; at the end each band is read back (8 bytes a row), rows sharing a band key become
candidate pairs, and a pair counts only when its signatures agree on at least `threshold` of their
positions (the MinHash estimate of Jaccard similarity). Bands are chosen so that a pair at the
threshold becomes a candidate with probability >= 0.99; the signature check then removes the
candidates below it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from llmft.core.text import normalise

_U64 = np.uint64
_C1 = _U64(0x9E3779B97F4A7C15)
_C2 = _U64(0xBF58476D1CE4E5B9)


def payload(row: dict) -> str:
    """Normalised, case-folded content: what identity (dedup, split) and similarity are about.

    Rows without system prompt or history hash exactly as before those fields existed, so existing
    alpaca datasets keep their split. Tool rows (the messages form) hash every turn with its role,
    the system prompt and the tools, so a changed call or tool list is another row."""
    if "messages" in row:
        return _tool_payload(row)
    text = "\x1f".join(normalise(row.get(f, "")).casefold() for f in ("instruction", "input", "output"))
    extra = []
    if row.get("system"):
        extra.append("system\x1f" + normalise(row["system"]).casefold())
    for user, assistant in row.get("history") or ():
        extra.append(normalise(user).casefold() + "\x1f" + normalise(assistant).casefold())
    return text + ("\x1e" + "\x1e".join(extra) if extra else "")


def _tool_payload(row: dict) -> str:
    parts = ["messages"]
    parts += [m["role"] + "\x1f" + normalise(m["content"]).casefold() for m in row["messages"]]
    if row.get("system"):
        parts.append("system\x1f" + normalise(row["system"]).casefold())
    if row.get("tools"):
        # The decoded JSON, compactly: tools that differ only in spacing are the same tools.
        tools = json.dumps(json.loads(row["tools"]), ensure_ascii=False, separators=(",", ":"))
        parts.append("tools\x1f" + normalise(tools).casefold())
    return "\x1e".join(parts)


def content_key(row: dict) -> str:
    """Hash of a row's normalised content: the identity used for dedup and the split."""
    return hashlib.sha256(payload(row).encode("utf-8")).hexdigest()


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: spreads every input bit over the whole word (uint64 in, uint64 out)."""
    x = x ^ (x >> _U64(33))
    x = x * _U64(0xFF51AFD7ED558CCD)
    x = x ^ (x >> _U64(33))
    x = x * _U64(0xC4CEB9FE1A85EC53)
    return x ^ (x >> _U64(33))


class SeenKeys:
    """A set of uint64 keys, as sorted runs merged like a log-structured merge tree."""

    def __init__(self):
        self._runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(len(r) for r in self._runs)

    def add(self, keys: np.ndarray) -> np.ndarray:
        """Add keys; True where a key is new (not seen before, and first of its kind in `keys`)."""
        keys = np.asarray(keys, dtype=np.uint64)
        new = np.zeros(len(keys), dtype=bool)
        if not len(keys):
            return new
        uniq, first = np.unique(keys, return_index=True)
        seen = np.zeros(len(uniq), dtype=bool)
        for run in self._runs:
            idx = np.minimum(np.searchsorted(run, uniq), len(run) - 1)
            seen |= run[idx] == uniq
        new[first[~seen]] = True
        if (~seen).any():  # an empty run would break the searchsorted lookups above
            self._runs.append(uniq[~seen])
        while len(self._runs) > 1 and len(self._runs[-2]) <= 2 * len(self._runs[-1]):
            top = self._runs.pop()
            self._runs[-1] = np.union1d(self._runs[-1], top)
        return new


def lsh_shape(threshold: float, num_perm: int, recall: float = 0.99) -> tuple[int, int]:
    """(bands, rows per band): the longest bands with which a pair at `threshold` still collides in
    some band with probability >= recall (long bands keep unrelated rows apart)."""
    best = (num_perm, 1)
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        if 1 - (1 - threshold**rows) ** bands >= recall:
            best = (bands, rows)
    return best


class MinHasher:
    """MinHash signatures (uint32, num_perm per row) of word 3-grams, a chunk at a time."""

    _P = np.uint32(16777619)  # FNV prime: odd, so it has an inverse modulo 2**32

    def __init__(self, num_perm: int = 64, seed: int = 20241130):
        rng = np.random.default_rng(seed)
        self.num_perm = num_perm
        self._a = rng.integers(1, 2**63, num_perm, dtype=np.uint64) | _U64(1)
        self._b = rng.integers(0, 2**63, num_perm, dtype=np.uint64)
        self._pow = np.ones(1, dtype=np.uint32)
        self._inv = np.ones(1, dtype=np.uint32)
        # Bytes that belong to words: letters, digits, and everything outside ASCII.
        self._is_word = np.array([c >= 128 or chr(c).isalnum() for c in range(256)], dtype=bool)

    def _powers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self._pow) < n:
            size = max(n, 2 * len(self._pow))
            base = np.full(size, self._P, dtype=np.uint32)
            base[0] = 1
            self._pow = np.cumprod(base, dtype=np.uint32)
            inv = np.full(size, pow(int(self._P), -1, 2**32), dtype=np.uint32)
            inv[0] = 1
            self._inv = np.cumprod(inv, dtype=np.uint32)
        return self._pow[:n], self._inv[:n]

    def shingles(self, texts: list[str], fallback: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shingle hashes, row of each), rows ascending. A row with fewer than three words has one
        shingle of all its words; a row with none gets `fallback` (its own key, matching nothing)."""
        n_rows = len(texts)
        joined = "\x00".join(texts)
        if joined.count("\x00") != n_rows - 1:  # NUL separates rows: keep it out of the texts
            joined = "\x00".join(t.replace("\x00", " ") for t in texts)
        buf = np.frombuffer(joined.encode("utf-8", "surrogatepass"), dtype=np.uint8)
        word = self._is_word[buf]
        edges = np.flatnonzero(np.diff(word.view(np.int8), prepend=0, append=0))
        starts, ends = edges[0::2], edges[1::2]
        power, inverse = self._powers(len(buf))
        # Polynomial hash of every word from one prefix sum: (S[end] - S[start]) / P**start.
        prefix = np.zeros(len(buf) + 1, dtype=np.uint32)
        np.cumsum(buf * power, out=prefix[1:])
        words = _mix(((prefix[ends] - prefix[starts]) * inverse[starts]).astype(np.uint64))
        word_row = np.cumsum(buf == 0)[starts]
        counts = np.bincount(word_row, minlength=n_rows)
        same = word_row[:-2] == word_row[2:]
        tri = _mix(words[:-2] * _C1 ^ words[1:-1] * _C2 ^ words[2:])[same]
        tri_row = word_row[:-2][same]
        short = np.flatnonzero(counts < 3)
        if not len(short):
            return tri, tri_row
        padded = np.concatenate((words, np.zeros(2, dtype=np.uint64)))
        first = (np.cumsum(counts) - counts)[short]
        one, two = padded[first], padded[first + 1]
        h = np.where(counts[short] == 2, _mix(one * _C1 ^ two), _mix(one))
        h = np.where(counts[short] == 0, np.asarray(fallback, dtype=np.uint64)[short], h)
        order = np.argsort(np.concatenate((tri_row, short)), kind="stable")
        return np.concatenate((tri, h))[order], np.concatenate((tri_row, short))[order]

    def signatures(self, texts: list[str], fallback: np.ndarray) -> np.ndarray:
        sh, row = self.shingles(texts, fallback)
        starts = np.searchsorted(row, np.arange(len(texts)))
        sig = np.empty((len(texts), self.num_perm), dtype=np.uint32)
        for k in range(self.num_perm):
            # Multiply-shift hashing: the high half of a*x + b is a good 32-bit permutation stand-in.
            h = ((sh * self._a[k] + self._b[k]) >> _U64(32)).astype(np.uint32)
            sig[:, k] = np.minimum.reduceat(h, starts)
        return sig


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(n, bands) uint64: one key per band of `rows` signature values."""
    keys = np.empty((len(sig), bands), dtype=np.uint64)
    for b in range(bands):
        acc = np.full(len(sig), b + 1, dtype=np.uint64)
        for j in range(b * rows, (b + 1) * rows):
            acc = _mix(acc * _U64(0x100000001B3) ^ sig[:, j].astype(np.uint64))
        keys[:, b] = acc
    return keys


class NearDupIndex:
    """Spools signatures and band keys of rows as they stream by; `pairs()` finds similar pairs."""

    def __init__(self, folder: Path, threshold: float, num_perm: int, max_group_look: int = 8):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.threshold = threshold
        self.num_perm = num_perm
        self.bands, self.rows_per_band = lsh_shape(threshold, num_perm)
        # Within a group of rows sharing a band key, each row is checked against this many earlier
        # members: enough for real groups (1-2 rows), bounded for degenerate ones.
        self.max_group_look = max_group_look
        self.hasher = MinHasher(num_perm)
        self.n = 0
        self._sig = open(folder / "signatures.u32", "wb")
        self._bands = [open(folder / f"band{b}.u64", "wb") for b in range(self.bands)]

    def add(self, sig: np.ndarray) -> None:
        keys = band_keys(sig, self.bands, self.rows_per_band)
        sig.tofile(self._sig)
        for b, fh in enumerate(self._bands):
            np.ascontiguousarray(keys[:, b]).tofile(fh)
        self.n += len(sig)

    def close(self) -> None:
        self._sig.close()
        for fh in self._bands:
            fh.close()

    def pairs(self, batch: int = 1 << 16) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Verified pairs (earlier row, later row), in batches; a pair may come more than once."""
        self.close()
        if self.n < 2:
            return
        sig = np.memmap(
            self.folder / "signatures.u32", dtype=np.uint32, mode="r", shape=(self.n, self.num_perm)
        )
        need = int(np.ceil(self.threshold * self.num_perm - 1e-9))
        for b in range(self.bands):
            keys = np.fromfile(self.folder / f"band{b}.u64", dtype=np.uint64)
            order = np.argsort(keys, kind="stable")  # stable: within a key, rows stay in stream order
            sorted_keys = keys[order]
            del keys
            for d in range(1, min(self.max_group_look, self.n - 1) + 1):
                same = np.flatnonzero(sorted_keys[d:] == sorted_keys[:-d])
                for i in range(0, len(same), batch):
                    part = same[i : i + batch]
                    a, z = order[part], order[part + d]
                    agree = (sig[a] == sig[z]).sum(axis=1)
                    ok = agree >= need
                    if ok.any():
                        yield a[ok], z[ok]
        del sig
