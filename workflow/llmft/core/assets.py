"""Offline assets for the embedded default: a synthetic instruction dataset that a tiny model can
visibly learn in minutes, a byte-level BPE tokenizer trained on it, and a random-init tiny Llama.

Nothing here touches a model or dataset hub.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from llmft.core.io import atomic_path, write_jsonl
from llmft.core.words import CATEGORIES, NUMBER_WORDS, WORDS

CATEGORY_TEMPLATES = [
    "What kind of thing is {w}?",
    "Which category does the word {w} belong to?",
    "Classify this word: {w}",
]


def _word_list(rng: random.Random, lo: int = 2, hi: int = 5) -> list[str]:
    return rng.sample(WORDS, rng.randint(lo, hi))


def synthetic_rows(n: int, seed: int = 0) -> list[dict]:
    """Alpaca rows over five tasks: category lookup, first/last word, repeat, count.

    Each task is solvable from the prompt (or from facts seen in other phrasings), so held-out
    exact match measures learning, not memorisation of the row itself.
    """
    rng = random.Random(seed)
    category_of = {w: c for c, ws in CATEGORIES.items() for w in ws}
    rows = []
    tasks = ["category", "first", "last", "repeat", "count"]
    while len(rows) < n:
        task = tasks[len(rows) % len(tasks)]
        if task == "category":
            w = rng.choice(WORDS)
            row = {
                "instruction": rng.choice(CATEGORY_TEMPLATES).format(w=w),
                "input": "",
                "output": category_of[w],
            }
        else:
            words = _word_list(rng)
            text = " ".join(words)
            if task == "first":
                row = {"instruction": "What is the first word?", "input": text, "output": words[0]}
            elif task == "last":
                row = {"instruction": "What is the last word?", "input": text, "output": words[-1]}
            elif task == "repeat":
                row = {"instruction": "Repeat the words.", "input": text, "output": text}
            else:
                row = {
                    "instruction": "How many words are there?",
                    "input": text,
                    "output": NUMBER_WORDS[len(words)],
                }
        row["task"] = task
        rows.append(row)
    return rows


def write_synthetic(path: str | Path, n: int, seed: int = 0) -> int:
    return write_jsonl(path, synthetic_rows(n, seed))


def _tokenizer_corpus() -> list[str]:
    lines = [" ".join(WORDS), " ".join(CATEGORIES), " ".join(NUMBER_WORDS.values())]
    lines += [t.format(w=w) for t in CATEGORY_TEMPLATES for w in WORDS]
    lines += [
        "What is the first word?",
        "What is the last word?",
        "Repeat the words.",
        "How many words are there?",
        "Human: Assistant: System: ### Instruction: ### Input: ### Response:",
    ]
    rng = random.Random(1)
    lines += [" ".join(_word_list(rng)) for _ in range(2000)]
    return lines


def build_tokenizer(out_dir: str | Path, vocab_size: int = 2048, corpus=None):
    """Train a byte-level BPE tokenizer offline (on `corpus`, default the demo's words) and save it in
    HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus() if corpus is None else corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(
    out_dir: str | Path,
    hidden_size=128,
    num_layers=2,
    num_heads=4,
    vocab_size=2048,
    seed: int = 0,
    tied: bool = True,
) -> dict:
    """Random-init Llama-architecture model + tokenizer, written atomically to `out_dir`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with atomic_path(out_dir, directory=True) as tmp:
        tok = build_tokenizer(tmp, vocab_size)
        config = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=hidden_size,
            intermediate_size=hidden_size * 4,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            max_position_embeddings=1024,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            tie_word_embeddings=tied,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        model.save_pretrained(str(tmp))
        n_params = sum(p.numel() for p in model.parameters())
        info = {"n_params": n_params, "vocab_size": len(tok), "builtin": "tiny"}
        (Path(tmp) / "llmft_model.json").write_text(json.dumps(info, indent=2))
    return info


CITIES = (
    "Paris Berlin Madrid Rome Vienna Prague Oslo Lisbon Dublin Warsaw Athens Tokyo Seoul Lima Cairo "
    "Nairobi Austin Denver Boston Chicago Toronto Sydney Perth Delhi"
).split()
SKIES = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")
TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "city name"}},
            "required": ["city"],
        },
    },
    {
        "name": "get_time",
        "description": "Local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "city name"}},
            "required": ["city"],
        },
    },
]
WEATHER_ASKS = ("What is the weather in {c}?", "How is the weather in {c} today?", "Weather for {c}, please.")
TIME_ASKS = ("What time is it in {c}?", "Tell me the local time in {c}.", "Current time in {c}?")


def synthetic_tool_rows(n: int, seed: int = 0) -> list[dict]:
    """sharegpt rows with a `tools` column, as LLaMA-Factory reads tool-calling data: half end with
    the function call (the answer is the call), half go on with the tool's result and an answer
    built from it. A model learns them by copying the city and the result, so held-out exact match
    measures learning of the format, not memorised rows."""
    rng = random.Random(seed)
    tools = json.dumps(TOOLS)
    rows = []
    while len(rows) < n:
        city = rng.choice(CITIES)
        weather = len(rows) % 2 == 0
        name = "get_weather" if weather else "get_time"
        ask = rng.choice(WEATHER_ASKS if weather else TIME_ASKS).format(c=city)
        call = json.dumps({"name": name, "arguments": {"city": city}})
        conv = [{"from": "human", "value": ask}, {"from": "function_call", "value": call}]
        task = "call"
        if len(rows) % 4 >= 2:
            if weather:
                degrees, sky = rng.randint(-5, 35), rng.choice(SKIES)
                result = {"city": city, "temperature": degrees, "sky": sky}
                answer = f"It is {degrees} degrees and {sky} in {city}."
            else:
                hour, minute = rng.randint(0, 23), rng.randint(0, 59)
                result = {"city": city, "time": f"{hour:02d}:{minute:02d}"}
                answer = f"It is {hour:02d}:{minute:02d} in {city}."
            conv += [{"from": "observation", "value": json.dumps(result)}, {"from": "gpt", "value": answer}]
            task = "answer"
        rows.append({"conversations": conv, "tools": tools, "task": task})
    return rows
