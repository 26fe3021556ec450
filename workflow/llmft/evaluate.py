"""Held-out evaluation: eval loss / perplexity and greedy-generation metrics (exact match, ROUGE-L,
BLEU), per example and per task.

Prompts are encoded with LLaMA-Factory's own template, so the model sees exactly the format it was
trained on. Generation is batched with left padding and the KV cache, greedy, deterministic.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, defaultdict
from pathlib import Path

from .data import normalise
from .io import read_jsonl, write_json, write_jsonl

log = logging.getLogger("llmft.evaluate")


def lcs_len(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(pred: str, ref: str) -> float:
    """ROUGE-L F1 over whitespace tokens."""
    p, r = pred.split(), ref.split()
    if not p or not r:
        return float(p == r)
    lcs = lcs_len(p, r)
    if lcs == 0:
        return 0.0
    prec, rec = lcs / len(p), lcs / len(r)
    return 2 * prec * rec / (prec + rec)


def bleu(pred: str, ref: str, max_n: int = 4) -> float:
    """Sentence BLEU with add-one smoothing on n-gram precisions (orders up to the ref length)."""
    p, r = pred.split(), ref.split()
    if not p or not r:
        return float(p == r)
    n_max = min(max_n, len(r))
    log_prec = 0.0
    for n in range(1, n_max + 1):
        pc = Counter(tuple(p[i : i + n]) for i in range(len(p) - n + 1))
        rc = Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
        overlap = sum(min(c, rc[g]) for g, c in pc.items())
        total = max(1, len(p) - n + 1)
        log_prec += math.log((overlap + 1) / (total + 1)) if n > 1 else math.log(max(overlap, 1e-9) / total)
    bp = 1.0 if len(p) >= len(r) else math.exp(1 - len(r) / len(p))
    return bp * math.exp(log_prec / n_max)


def exact_match(pred: str, ref: str) -> float:
    return float(normalise(pred).casefold() == normalise(ref).casefold())


def _prompt(row: dict) -> str:
    return row["instruction"] + ("\n" + row["input"] if row.get("input") else "")


def evaluate(cfg: dict, model_dir: str, heldout: str, out_dir: str, label: str) -> dict:
    import torch
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ecfg = cfg["eval"]
    rows = read_jsonl(heldout)[: ecfg["max_rows"]]
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    template = get_template_and_fix_tokenizer(tokenizer, DataArguments(template=cfg["model"]["template"]))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    encoded = []
    for row in rows:
        msgs = [
            {"role": "user", "content": _prompt(row)},
            {"role": "assistant", "content": row["output"]},
        ]
        prompt_ids, answer_ids = template.encode_oneturn(tokenizer, msgs)
        encoded.append((prompt_ids, answer_ids))

    t0 = time.perf_counter()
    nll, n_tok = 0.0, 0
    bs = ecfg["batch_size"]
    with torch.inference_mode():
        for i in range(0, len(encoded), bs):
            batch = encoded[i : i + bs]
            width = max(len(p) + len(a) for p, a in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            attn = torch.zeros((len(batch), width), dtype=torch.long)
            for j, (p, a) in enumerate(batch):
                seq = p + a
                ids[j, : len(seq)] = torch.tensor(seq)
                labels[j, len(p) : len(seq)] = torch.tensor(a)
                attn[j, : len(seq)] = 1
            logits = model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits.float()
            shift_logits, shift_labels = logits[:, :-1], labels[:, 1:].to(device)
            loss = torch.nn.functional.cross_entropy(
                shift_logits.reshape(-1, shift_logits.size(-1)),
                shift_labels.reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
            nll += loss.item()
            n_tok += int((shift_labels != -100).sum())
    loss_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    preds: list[str] = []
    new_tokens = 0
    with torch.inference_mode():
        for i in range(0, len(encoded), bs):
            batch = [p for p, _ in encoded[i : i + bs]]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attn = torch.zeros((len(batch), width), dtype=torch.long)
            for j, p in enumerate(batch):  # left padding: every prompt ends at the same column
                ids[j, width - len(p) :] = torch.tensor(p)
                attn[j, width - len(p) :] = 1
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=attn.to(device),
                do_sample=False,
                max_new_tokens=ecfg["max_new_tokens"],
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=pad,
                use_cache=True,
            )
            gen = out[:, width:].cpu()
            for seq in gen.tolist():
                if tokenizer.eos_token_id in seq:
                    seq = seq[: seq.index(tokenizer.eos_token_id)]
                new_tokens += len(seq)
                preds.append(tokenizer.decode(seq, skip_special_tokens=True).strip())
    gen_s = time.perf_counter() - t0

    per_example = []
    by_task: dict[str, list[float]] = defaultdict(list)
    for row, pred in zip(rows, preds, strict=True):
        em = exact_match(pred, row["output"])
        rec = {
            "prompt": _prompt(row),
            "reference": row["output"],
            "prediction": pred,
            "task": row.get("task", ""),
            "exact_match": em,
            "rouge_l": round(rouge_l(pred, row["output"]), 4),
            "bleu": round(bleu(pred, row["output"]), 4),
        }
        per_example.append(rec)
        by_task[rec["task"]].append(em)
    n = max(1, len(per_example))
    loss = nll / max(1, n_tok)
    metrics = {
        "label": label,
        "model": str(model_dir),
        "rows": len(per_example),
        "eval_loss": round(loss, 4),
        "perplexity": round(math.exp(min(loss, 50)), 3),
        "exact_match": round(sum(r["exact_match"] for r in per_example) / n, 4),
        "rouge_l": round(sum(r["rouge_l"] for r in per_example) / n, 4),
        "bleu": round(sum(r["bleu"] for r in per_example) / n, 4),
        "exact_match_by_task": {t: round(sum(v) / len(v), 4) for t, v in sorted(by_task.items())},
        "device": device,
        "loss_seconds": round(loss_s, 3),
        "generate_seconds": round(gen_s, 3),
        "new_tokens_per_second": round(new_tokens / gen_s, 1) if gen_s else None,
    }
    out = Path(out_dir)
    write_jsonl(out / "predictions.jsonl", per_example)
    write_json(out / "metrics.json", metrics)
    log.info(
        "%s: eval_loss %.4f exact_match %.3f rouge_l %.3f",
        label,
        loss,
        metrics["exact_match"],
        metrics["rouge_l"],
    )
    return metrics
