"""Does the tokenizer as transformers loads it encode like the folder's tokenizer.json?

transformers 5 builds some tokenizers from the class named in tokenizer_config.json rather than
from tokenizer.json as saved (with 5.6.0 real DeepSeek-V3 tokenizers lose spaces and SmolLM splits
digits differently): training would then see other ids than the model was trained on. prepare_data
encodes a few probe texts both ways, before tokenizing anything, and stops on the first difference.
"""

from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path

PROBES = (
    ("English", "The quick brown fox jumps over the lazy dog. It's 5 o'clock, isn't it?"),
    ("code", 'def area(r):\n    """Circle."""\n    return 3.14159 * r ** 2  # pi r^2\n\tif x != y: pass'),
    ("digits", "1234567890 42 3.14159 2026-12-01 1,000,000 007"),
    ("Chinese", "中文分词测试：你好，世界。机器学习很有趣。"),
    ("spaces and newlines", "  two leading,   three inside\n\n\nthree newlines \n trailing  "),
    ("emoji", "emoji 😀👍🏽 🇫🇷 ❤️ end"),
    ("accents", "naïve café über façade Ελληνικά"),
    # Pre-tokenizer seams, where a loader that drops tokenizer.json's pre-tokenizer (SmolLM's digit
    # split before the byte-level regex) cuts differently: '\n\n1' is `ĊĊ 1` as saved, `Ċ Ċ 1` rebuilt.
    ("digits after newlines", "Steps:\n\n1. Mix.\n2. Bake.\n\n\n10 minutes\r\n\r\n3"),
    ("digits after spaces and signs", "x  42\t7 (1) [2] -3 +4 $5 %6 #7 a1b22c333 1st 2nd"),
    ("punctuation runs", "Wait... what?! --- *** ''quoted'' \"\"x\"\" ::: ;; ```"),
)

log = logging.getLogger("llmft.data.tokcheck")


def versions() -> str:
    return f"transformers {metadata.version('transformers')}, tokenizers {metadata.version('tokenizers')}"


def check(tokenizer, folder: str | Path, fail: bool = True) -> dict:
    """Compare `tokenizer` (loaded as LLaMA-Factory loads it) with the folder's tokenizer.json on the
    probes. On a difference: raise DataError naming the folder, the probe and the library versions,
    or with `fail` false (config data.tokenizer_check: warn) log it and go on. Returns what
    stats.json records."""
    from llmft.core.sources import DataError
    from tokenizers import Tokenizer

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return {"checked": False, "why": f"no tokenizer.json in {folder} (a slow tokenizer)"}
    reference = Tokenizer.from_file(str(path))
    # The ids of the text alone: tokenizer.json may carry fixed padding or truncation (SmolLM's),
    # which transformers does not apply to encode() and LLaMA-Factory does not use.
    reference.no_padding()
    reference.no_truncation()
    for name, text in PROBES:
        loaded = list(tokenizer.encode(text, add_special_tokens=False))
        saved = reference.encode(text, add_special_tokens=False).ids
        if loaded != saved:
            at = next(
                (i for i, (a, b) in enumerate(zip(loaded, saved, strict=False)) if a != b),
                min(len(loaded), len(saved)),
            )
            message = (
                f"the tokenizer in {folder} as transformers loads it ({type(tokenizer).__name__}) encodes "
                f"the {name} probe {text!r} differently from its tokenizer.json: from token {at} "
                f"{tokenizer.convert_ids_to_tokens(loaded[at : at + 4])} instead of "
                f"{[reference.id_to_token(i) for i in saved[at : at + 4]]} ({versions()}); training "
                "would not see the ids the model was trained on. Fix the folder's tokenizer_config.json "
                "(tokenizer_class), use versions that load it as saved, or set data.tokenizer_check: "
                "warn to tokenize as it loads"
            )
            if fail:
                raise DataError(message)
            log.warning("%s", message)
            return {
                "checked": True,
                "matches": False,
                "probe": name,
                "message": message,
                "versions": versions(),
            }
    return {"checked": True, "matches": True, "probes": len(PROBES), "versions": versions()}
