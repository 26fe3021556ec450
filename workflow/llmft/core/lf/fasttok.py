"""An exact shortcut through byte-level BPE tokenizers for plain ASCII text.

Profiling prepare_data showed the Rust tokenizer spending most of its time in its regex
pre-tokenizer, once per word of every row. For the GPT-2 / Llama-3 / Qwen2 family of tokenizers
(byte-level BPE behind a regex pre-tokenizer, no normalizer that changes ASCII) the same pieces can
be cut from ASCII text by Python's `re` with the tokenizer's own pattern, `\\p{L}` and `\\p{N}` read
as the ASCII letters and digits they are on ASCII text; each distinct piece then goes once through
the tokenizer's own BPE model and is remembered. Words repeat (Zipf), so most pieces cost one dict
lookup.

What the shortcut does not take goes to the Rust tokenizer unchanged: any text that is not
printable ASCII (tabs and newlines allowed), any text containing an added token (`</s>`,
`<|im_start|>`, ...), and every tokenizer whose configuration is not one of the supported shapes.
`FastPath.check` compares both ways on a probe set and the caller's own texts; a difference turns
the shortcut off for the run.
"""

from __future__ import annotations

import json
import logging
import re
from itertools import chain

import numpy as np

log = logging.getLogger("llmft.core.lf.fasttok")

# The pattern of tokenizers' ByteLevel pre-tokenizer when use_regex is true (GPT-2's).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Normalizers that leave ASCII text as it is.
ASCII_IDENTITY_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}
# Tabs, newlines, carriage returns and printable ASCII: the texts the shortcut takes.
_NOT_PLAIN = re.compile(r"[^\t\n\r\x20-\x7e]")
# Pieces remembered per process (~150 bytes each): frequent words come first and stay.
MAX_CACHED_PIECES = 300_000

PROBES = [
    "Hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n\n  \n",
    "it's they're we've I'm you'll he'd IT'S THEY'RE",
    "numbers 1 12 123 1234 12345 3.14159 -7 1e10 0x1F",
    "punctuation!!! ... ?!?! (paren) [bracket] {brace} <angle> @#$%^&*_+=~`|\\/",
    "mixed123abc ABC123 a1b2c3 snake_case camelCase kebab-case",
    "email@example.com https://example.org/path?q=1&r=2#frag",
    "def f(x):\n    return x  # comment\n\tpass\n",
    "    indented\n        more\n",
    "a  b   c    d     e",
    "'quoted' \"double\" `back` 's 't 're",
    "end with space ",
    " ",
    "\n",
    "x",
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table, as tokenizers' ByteLevel uses it."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def ascii_pattern(pattern: str) -> str | None:
    """The pattern with \\p{L} and \\p{N} as ASCII classes; None for any other Unicode property."""
    out, i, depth = [], 0, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            if pattern[i + 1] in "pP":
                m = re.match(r"\\p\{(L|N)\}", pattern[i:])
                if not m:
                    return None
                cls = "A-Za-z" if m.group(1) == "L" else "0-9"
                out.append(cls if depth else f"[{cls}]")
                i += m.end()
                continue
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if ch == "[":
            depth += 1
        elif ch == "]" and depth:
            depth -= 1
        out.append(ch)
        i += 1
    return "".join(out)


class FastPath:
    """Encode plain ASCII texts like `backend.encode(text, add_special_tokens=False).ids`."""

    def __init__(self, backend, pattern: re.Pattern, added: re.Pattern | None, added_ids: dict | None):
        self._model = backend.model
        self._pattern = pattern
        self._added = added
        # Token id of each added token, when texts holding them can be split here (else None).
        self._added_ids = added_ids
        self._bytes = str.maketrans({chr(b): c for b, c in bytes_to_unicode().items() if b < 128})
        self._cache: dict[str, tuple[int, ...]] = {}
        # findall returns whole matches only for patterns without capturing groups.
        self._findall = pattern.findall
        self._plain_findall = pattern.groups == 0

    @classmethod
    def for_tokenizer(cls, backend) -> tuple[FastPath | None, str]:
        """The shortcut for this Rust tokenizer, or None and why not."""
        spec = _spec(backend)
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("dropout"):
            return None, "the model is not a plain BPE"
        if not _identity_on_ascii(spec.get("normalizer")):
            return None, "the normalizer may change ASCII text"
        if backend.encode_special_tokens:
            return None, "special tokens are split (split_special_tokens)"
        raw = _pre_tokenizer_pattern(spec.get("pre_tokenizer"))
        if raw is None:
            return None, "the pre-tokenizer is not byte-level behind one regex"
        translated = ascii_pattern(raw)
        if translated is None:
            return None, "the pre-tokenizer regex uses Unicode properties other than L and N"
        try:
            pattern = re.compile(translated, re.ASCII)
        except re.error as exc:
            return None, f"the pre-tokenizer regex does not compile in Python ({exc})"
        tokens = spec.get("added_tokens") or []
        # Longest first: at each position the alternation then takes the longest token, which is
        # the tokenizer's leftmost-longest matching of added tokens.
        contents = sorted({t["content"] for t in tokens}, key=len, reverse=True)
        added = re.compile("|".join(map(re.escape, contents))) if contents else None
        # Added tokens that strip spaces around them or match whole words only are the tokenizer's
        # business: texts holding one go to it. Plain ones are split out here, as it does.
        plain = all(not (t.get("lstrip") or t.get("rstrip") or t.get("single_word")) for t in tokens)
        added_ids = {t["content"]: t["id"] for t in tokens} if plain else None
        return cls(backend, pattern, added, added_ids), "byte-level BPE with a regex pre-tokenizer"

    def takes(self, text: str) -> bool:
        return (
            text.isascii()
            and _NOT_PLAIN.search(text) is None
            and (self._added_ids is not None or self._added is None or self._added.search(text) is None)
        )

    def encode(self, text: str) -> list[int]:
        if self._added is None or self._added.search(text) is None:
            return self._encode_plain(text)
        ids: list[int] = []
        for added, part in self._segments(text):
            if added:
                ids.append(self._added_ids[part])
            else:
                ids += self._encode_plain(part)
        return ids

    def _segments(self, text: str):
        """Added tokens cut the text; the parts between them are tokenized on their own. Yields
        (True, added token) and (False, plain part) in order."""
        pos = 0
        for m in self._added.finditer(text):
            if m.start() > pos:
                yield False, text[pos : m.start()]
            yield True, m.group()
            pos = m.end()
        if pos < len(text):
            yield False, text[pos:]

    def _encode_plain(self, text: str) -> list[int]:
        # C-level loops only (findall, map, chain) on the usual path: this runs for every row.
        pieces = self._plain_keys(text)
        got = list(map(self._cache.get, pieces))
        if None in got:
            for i, piece in enumerate(pieces):
                if got[i] is None:
                    got[i] = self._miss(piece)
        return list(chain.from_iterable(got))

    def keys(self, text: str) -> list[str]:
        """The pieces `encode` cuts `text` into, in order; an added token as "\\x00" + its content (no
        piece of a text the shortcut takes starts with NUL). SpanTable turns keys into token ids."""
        if self._added is None or self._added.search(text) is None:
            return self._plain_keys(text)
        out: list[str] = []
        for added, part in self._segments(text):
            if added:
                out.append("\x00" + part)
            else:
                out += self._plain_keys(part)
        return out

    def _plain_keys(self, text: str) -> list[str]:
        pieces = self._findall(text) if self._plain_findall else None
        if pieces is None or sum(map(len, pieces)) != len(text):
            pieces = self._pieces(text)
        return pieces

    def key_ids(self, key: str) -> tuple[int, ...]:
        """Token ids of a key from `keys`."""
        if key[0] == "\x00":
            return (self._added_ids[key[1:]],)
        got = self._cache.get(key)
        return got if got is not None else self._bpe(key)  # the SpanTable keeps it, not _cache

    def _bpe(self, piece: str) -> tuple[int, ...]:
        return tuple([t.id for t in self._model.tokenize(piece.translate(self._bytes))])

    def _miss(self, piece: str) -> tuple[int, ...]:
        ids = self._bpe(piece)
        if len(self._cache) < MAX_CACHED_PIECES:
            self._cache[piece] = ids
        return ids

    def _pieces(self, text: str) -> list[str]:
        # tokenizers' Split(behavior=Isolated): the matches and, in between, what no match covers.
        pieces, pos = [], 0
        for m in self._pattern.finditer(text):
            if m.start() > pos:
                pieces.append(text[pos : m.start()])
            if m.end() > m.start():
                pieces.append(m.group())
            pos = m.end()
        if pos < len(text):
            pieces.append(text[pos:])
        return pieces

    def check(self, backend, texts: list[str]) -> list[str]:
        """Texts (from PROBES and `texts`) on which the shortcut and the tokenizer differ."""
        sample = [t for t in PROBES + texts if self.takes(t)]
        reference = [e.ids for e in backend.encode_batch(sample, add_special_tokens=False)]
        return [t for t, ref in zip(sample, reference, strict=True) if self.encode(t) != ref]


def _spec(backend) -> dict:
    """The parts of the tokenizer's JSON that decide the shortcut, without serialising (and parsing
    back) its whole vocabulary and merges: that took a quarter of a second per process."""

    def state(component):
        return None if component is None else json.loads(component.__getstate__())

    model = backend.model
    added = [
        {
            "id": i,
            "content": t.content,
            "lstrip": t.lstrip,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
        }
        for i, t in sorted(backend.get_added_tokens_decoder().items())
    ]
    return {
        "model": {"type": type(model).__name__, "dropout": getattr(model, "dropout", None)},
        "normalizer": state(backend.normalizer),
        "pre_tokenizer": state(backend.pre_tokenizer),
        "added_tokens": added,
    }


def _identity_on_ascii(normalizer: dict | None) -> bool:
    if normalizer is None:
        return True
    if normalizer.get("type") == "Sequence":
        return all(_identity_on_ascii(n) for n in normalizer.get("normalizers", []))
    return normalizer.get("type") in ASCII_IDENTITY_NORMALIZERS


def _pre_tokenizer_pattern(pre: dict | None) -> str | None:
    """The regex of a ByteLevel(use_regex) or Sequence[Split(regex, Isolated), ByteLevel] pre-tokenizer."""
    if not pre:
        return None
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return GPT2_PATTERN
    if pre.get("type") != "Sequence":
        return None
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert"):
        return None
    if byte_level.get("type") != "ByteLevel" or byte_level.get("add_prefix_space"):
        return None
    if byte_level.get("use_regex", True):
        return None
    pattern = split.get("pattern") or {}
    return pattern.get("Regex")


class SpanTable:
    """Token ids of keys (pieces, template constants, special tokens), each stored once in one flat
    array: a chunk of rows becomes one array of key indices, and its token ids one numpy gather
    instead of a Python list per text. At most `cap` keys are remembered; past that, a chunk's new
    keys are dropped again after the chunk (memory stays bounded)."""

    def __init__(self, resolve, cap: int = MAX_CACHED_PIECES):
        self._resolve = resolve  # key -> token ids, for keys not seen yet
        self._cap = cap
        self.index: dict = {}
        self.tokens = np.zeros(1 << 16, dtype=np.int32)
        self.start = np.zeros(1 << 12, dtype=np.int64)
        self.length = np.zeros(1 << 12, dtype=np.int64)
        self._n_tokens = 0
        self._n_keys = 0

    def lookup(self, keys: list) -> np.ndarray:
        """Indices of `keys`, adding the ones not seen yet."""
        try:  # the usual case once the table is warm: every key known, one C-level pass
            return np.fromiter(map(self.index.__getitem__, keys), dtype=np.int64, count=len(keys))
        except KeyError:
            pass
        found = list(map(self.index.get, keys))
        base = (self._n_keys, self._n_tokens, len(self.index))
        local: dict = {}
        for i, got in enumerate(found):
            if got is None:
                key = keys[i]
                got = local.get(key)
                if got is None:
                    got = local[key] = self._append(self._resolve(key))
                found[i] = got
        if base[2] + len(local) <= self._cap:
            self.index.update(local)
            out = np.array(found, dtype=np.int64)
        else:
            out = np.array(found, dtype=np.int64)
            # Over the cap: the spans serve this chunk only (callers gather before the next lookup).
            self._n_keys, self._n_tokens = base[0], base[1]
        return out

    def _append(self, ids) -> int:
        n = len(ids)
        if self._n_tokens + n > len(self.tokens):
            self.tokens = np.resize(self.tokens, max(2 * len(self.tokens), self._n_tokens + n))
        if self._n_keys == len(self.start):
            self.start = np.resize(self.start, 2 * len(self.start))
            self.length = np.resize(self.length, 2 * len(self.length))
        self.tokens[self._n_tokens : self._n_tokens + n] = ids
        self.start[self._n_keys] = self._n_tokens
        self.length[self._n_keys] = n
        self._n_tokens += n
        self._n_keys += 1
        return self._n_keys - 1


def gather(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """flat[starts[0]:starts[0]+lengths[0]] + flat[starts[1]:...] + ..., in one numpy call."""
    ends = np.cumsum(lengths)
    shift = np.repeat(starts - (ends - lengths), lengths)
    return flat[np.arange(int(ends[-1]) if len(ends) else 0) + shift]
