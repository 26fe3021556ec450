"""Held-out answer metrics: exact match, and LLaMA-Factory's own predict metrics reproduced exactly
(its `predict_rouge-1/2/l` and `predict_bleu-4`), so the numbers compare with a LLaMA-Factory
`do_predict` run on the same pairs:

- ROUGE-1/2/L: both texts segmented by jieba (words for Chinese, whitespace-separated tokens
  elsewhere), F-measure from rouge-chinese, x 100; 0 when either side has no token;
- BLEU-4: NLTK's sentence BLEU over characters with smoothing method 3, x 100;
- each metric is the mean of the per-row scores.

Character BLEU and jieba segmentation make both right on Chinese and Japanese text, where a split on
whitespace would see one token per sentence.
"""

from __future__ import annotations

import logging
import warnings

from llmft.core.text import normalise

METRICS = ("rouge_1", "rouge_2", "rouge_l", "bleu_4")
SOURCE = (
    "LLaMA-Factory's predict metrics: jieba + rouge-chinese ROUGE F x 100, "
    "NLTK character BLEU-4 (smoothing method 3) x 100, means over rows"
)


def exact_match(pred: str, ref: str) -> float:
    """1.0 when the answer equals the reference after Unicode normalisation, case folded."""
    return float(normalise(pred).casefold() == normalise(ref).casefold())


_LIBS: dict = {}


def _libs():
    if not _LIBS:
        import jieba
        from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
        from rouge_chinese import Rouge

        jieba.setLogLevel(logging.WARNING)  # its dictionary load prints to stderr otherwise
        _LIBS.update(cut=jieba.cut, bleu=sentence_bleu, smooth=SmoothingFunction().method3, rouge=Rouge)
    return _LIBS


def similarity(pred: str, ref: str) -> dict[str, float]:
    """One row's ROUGE-1/2/L and BLEU-4, as LLaMA-Factory's ComputeSimilarity scores it."""
    lib = _libs()
    hyp, hyp_ref = list(lib["cut"](pred)), list(lib["cut"](ref))
    out = {}
    if not " ".join(hyp).split() or not " ".join(hyp_ref).split():
        out.update({"rouge_1": 0.0, "rouge_2": 0.0, "rouge_l": 0.0})
    else:
        scores = lib["rouge"]().get_scores(" ".join(hyp), " ".join(hyp_ref))[0]
        for name in ("1", "2", "l"):
            out[f"rouge_{name}"] = round(scores[f"rouge-{name}"]["f"] * 100, 4)
    with warnings.catch_warnings():  # NLTK warns for every zero n-gram overlap
        warnings.simplefilter("ignore")
        bleu = lib["bleu"]([list(ref)], list(pred), smoothing_function=lib["smooth"])
    out["bleu_4"] = round(bleu * 100, 4)
    return out


def mean_scores(rows: list[dict]) -> dict[str, float]:
    """The mean of each metric over per-row score dicts."""
    n = max(len(rows), 1)
    return {m: round(sum(r[m] for r in rows) / n, 4) for m in METRICS}
