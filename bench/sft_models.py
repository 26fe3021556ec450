"""Offline inputs of the GPU SFT benchmark: synthetic alpaca rows and random-init Llama models.

    python bench/sft_models.py data OUT.json [--rows 4000]     # here, on the CPU (deterministic)
    python bench/sft_models.py model {1b,4b5,8b,tiny} OUT_DIR TOKENIZER_DIR [--device cuda]

Rows are made-up words with a Zipf-like distribution and lognormal answer lengths (median ~220
words, long tail), so packing has real work to do; the models are Llama-3.2-1B-like (tied
embeddings) and Llama-3-8B-like, 128 256-token vocabulary, random init in bf16. Nothing is
downloaded; the tokenizer is the byte-level BPE kept in bench/work/sft/tok (git-ignored, carried).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import shutil
import time
from pathlib import Path

SEED = 1234
ONSETS = "_ b c d f g h j k l m n p qu r s t v w z br cr dr fl gr pl pr sh st th tr ch sp sk".split()
VOWELS = "a e i o u ai ea ou io y".split()
CODAS = "_ _ n r s t l m nd st ck ng x".split()
VERBS = "Summarize Explain Rewrite Continue Translate Describe Expand Classify Answer".split()

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, tie_word_embeddings=True),
    # 4.5 B (an 8 B cut to 16 layers): on one H200 (141 GB) and its 128 GiB host, every way to fit it
    # (no recompute, gradient checkpointing, ZeRO-3 + CPU offload) fits: bench/steptime_check.py.
    "4b5": dict(hidden_size=4096, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, tie_word_embeddings=False),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, tie_word_embeddings=False),
}  # fmt: skip


class Words:
    """A fixed made-up lexicon sampled with Zipf-like weights."""

    def __init__(self, rng: random.Random, n: int = 6000):
        words: set[str] = set()
        while len(words) < n:
            parts = rng.choice([1, 1, 2, 2, 2, 3, 3, 4])
            w = "".join(
                (rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)).replace("_", "")
                for _ in range(parts)
            )
            if 1 < len(w) < 16:
                words.add(w)
        self.words = sorted(words)
        rng.shuffle(self.words)
        total, self.cum = 0.0, []
        for i in range(len(self.words)):
            total += 1.0 / (i + 1) ** 1.05
            self.cum.append(total)
        self.rng = rng

    def text(self, n_words: int) -> str:
        out, count = [], 0
        while count < n_words:
            k = self.rng.randint(5, 18)
            ws = [
                self.words[bisect.bisect_left(self.cum, self.rng.random() * self.cum[-1])] for _ in range(k)
            ]
            if self.rng.random() < 0.15:
                ws.insert(self.rng.randint(0, k), str(self.rng.randint(0, 9999)))
            s = " ".join(ws)
            out.append(s[0].upper() + s[1:] + self.rng.choice(".....?!;"))
            count += len(ws)
        return " ".join(out)


def make_rows(n: int) -> list[dict]:
    words = Words(random.Random(SEED))
    rng = random.Random(SEED + 1)
    rows = []
    for _ in range(n):
        instruction = rng.choice(VERBS) + " the following. " + words.text(rng.randint(6, 30))
        inp = words.text(rng.randint(10, 120)) if rng.random() < 0.5 else ""
        answer_words = int(min(1400, max(15, rng.lognormvariate(math.log(220), 0.7))))
        rows.append({"instruction": instruction, "input": inp, "output": words.text(answer_words)})
    return rows


def llama_config(size: str, **overrides) -> dict:
    """The LlamaConfig arguments of the bench's model of this size (Llama-3-like: 128 k vocabulary)."""
    return {
        **SHAPES[size],
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "rope_theta": 500000.0,
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        **overrides,
    }


def make_model(size: str, out_dir: str, tokenizer_dir: str, device: str = "cuda") -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.time()
    cfg = LlamaConfig(**llama_config(size))
    cfg.dtype = "bfloat16"
    torch.manual_seed(SEED)
    dev = torch.device(device if device == "cpu" or torch.cuda.is_available() else "cpu")
    torch.set_default_dtype(torch.bfloat16)
    with dev:
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out_dir, max_shard_size="5GB")
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, Path(out_dir) / f.name)
    info = {"size": size, "params": n, "seconds": round(time.time() - t0, 1)}
    (Path(out_dir) / "param_count.json").write_text(json.dumps(info))
    return info


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("out")
    d.add_argument("--rows", type=int, default=4000)
    m = sub.add_parser("model")
    m.add_argument("size", choices=sorted(SHAPES))
    m.add_argument("out")
    m.add_argument("tokenizer")
    m.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.cmd == "data":
        rows = make_rows(args.rows)
        Path(args.out).write_text(json.dumps(rows))
        print(f"wrote {len(rows)} rows to {args.out}")
    else:
        print(json.dumps(make_model(args.size, args.out, args.tokenizer, args.device)))


if __name__ == "__main__":
    main()
