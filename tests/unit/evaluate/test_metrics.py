"""The held-out metrics against LLaMA-Factory's own ComputeSimilarity (its predict_rouge-* and
predict_bleu-4), on English and Chinese pairs."""

import numpy as np
import pytest
from llmft.evaluate.metrics import METRICS, mean_scores, similarity

PAIRS = [
    ("The cat sat on the mat.", "The cat sat on the mat."),
    ("A cat sat on a mat", "The cat sat on the mat."),
    ("completely different words here", "The cat sat on the mat."),
    ("blue", "The answer is blue"),
    ("", "empty prediction"),
    ("今天天气很好，我们去公园散步吧。", "今天天气很好，我们去公园散步。"),
    ("我喜欢吃苹果", "他不喜欢吃香蕉和苹果"),
    ("北京是中国的首都", "东京是日本的首都"),
    ("東京は日本の首都です", "東京は日本の首都である"),
    ("mixed 中文 and English 文本", "mixed 中文 and English text"),
]


class Texts:
    """Hands LLaMA-Factory's metric the texts themselves: a row of ids [i] decodes to text i."""

    pad_token_id = -1

    def __init__(self, texts):
        self.texts = texts

    def batch_decode(self, ids, skip_special_tokens=True):
        return [self.texts[int(row[0])] for row in ids]


def llamafactory_scores(pairs):
    from llamafactory.train.sft.metric import ComputeSimilarity
    from transformers import EvalPrediction

    n = len(pairs)
    texts = [p for p, _ in pairs] + [r for _, r in pairs]  # predictions 0..n-1, references n..2n-1
    metric = ComputeSimilarity(Texts(texts))
    ids = np.arange(n).reshape(-1, 1)
    return metric(EvalPrediction(predictions=ids, label_ids=ids + n))


@pytest.mark.parametrize("lang", ["english", "cjk"])
def test_scores_equal_llamafactorys_predict_metrics(lang):
    pairs = PAIRS[:5] if lang == "english" else PAIRS[5:]
    theirs = llamafactory_scores(pairs)
    ours = mean_scores([similarity(p, r) for p, r in pairs])
    for ours_name, their_name in zip(METRICS, ("rouge-1", "rouge-2", "rouge-l", "bleu-4"), strict=True):
        assert ours[ours_name] == pytest.approx(theirs[their_name], abs=1e-3), (ours_name, ours, theirs)


def test_chinese_answers_score_between_zero_and_a_hundred():
    """A whitespace split sees one token per Chinese sentence (all or nothing); segmentation does not."""
    close = similarity("今天天气很好，我们去公园散步吧。", "今天天气很好，我们去公园散步。")
    assert 50 < close["rouge_l"] < 100 and 50 < close["bleu_4"] < 100
    assert similarity("同样", "同样")["rouge_1"] == 100.0
    assert similarity("", "空")["rouge_l"] == 0.0
