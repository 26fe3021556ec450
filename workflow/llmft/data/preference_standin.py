"""TEMPORARY stand-in for prepare_preference (the preference data stage is another change): writes
results/{run}/preference/data/ in the agreed canonical form from a synthetic word task, so the
preference stage can be built and tested before that stage exists. Delete with its rule
(workflow/rules/preference_standin.smk) when prepare_preference is merged.

The task: a word's category or the number of words in a list, asked in words sft's data never uses;
the chosen answer is right, the rejected one another category or another count.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from llmft.core.io import write_json, write_jsonl, write_text
from llmft.data.assets import CATEGORIES, NUMBER_WORDS, WORDS

TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"}


def _question(rng: random.Random) -> tuple[str, str, str, str]:
    """(task, prompt, right answer, wrong answer)."""
    task = rng.choice(["category", "count"])
    if task == "category":
        word = rng.choice(WORDS)
        right = next(c for c, ws in CATEGORIES.items() if word in ws)
        wrong = rng.choice([c for c in CATEGORIES if c != right])
        return task, f"Name the category of {word}.", right, wrong
    words = rng.sample(WORDS, rng.randint(2, 5))
    wrong = rng.choice([w for k, w in NUMBER_WORDS.items() if k != len(words)])
    return task, f"Count the words.\n{' '.join(words)}", NUMBER_WORDS[len(words)], wrong


def rows(n: int, method: str, seed: int = 0) -> list[dict]:
    """n canonical rows: DPO pairs, or for KTO each question twice (desirable, undesirable)."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        task, prompt, right, wrong = _question(rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        msgs = [{"from": "human", "value": prompt}]
        if method == "dpo":
            out.append(
                {
                    "messages": msgs,
                    "chosen": {"from": "gpt", "value": right},
                    "rejected": {"from": "gpt", "value": wrong},
                    "task": task,
                }
            )
        else:
            for answer, tag in ((right, True), (wrong, False)):
                out.append(
                    {"messages": [*msgs, {"from": "gpt", "value": answer}], "kto_tag": tag, "task": task}
                )
    return out


def entry(file: str, method: str) -> dict:
    if method == "dpo":
        columns = {"messages": "messages", "chosen": "chosen", "rejected": "rejected"}
        return {
            "file_name": file,
            "formatting": "sharegpt",
            "ranking": True,
            "columns": columns,
            "tags": TAGS,
        }
    columns = {"messages": "messages", "kto_tag": "kto_tag"}
    return {"file_name": file, "formatting": "sharegpt", "columns": columns, "tags": TAGS}


def write(out_dir: str, n: int, method: str, heldout_share: float = 0.2) -> None:
    out = Path(out_dir)
    data = rows(n, method)
    # KTO's two rows of a question stay on one side of the split.
    step = 1 if method == "dpo" else 2
    cut = int(len(data) * (1 - heldout_share)) // step * step
    write_jsonl(out / "train.jsonl", data[:cut])
    write_jsonl(out / "heldout.jsonl", data[cut:])
    write_text(out / "rejected.jsonl", "")
    write_json(
        out / "dataset_info.json",
        {
            "llmft_pref_train": entry("train.jsonl", method),
            "llmft_pref_heldout": entry("heldout.jsonl", method),
        },
    )
    write_json(
        out / "stats.json", {"method": method, "train": cut, "heldout": len(data) - cut, "stand_in": True}
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="TEMPORARY: synthetic preference data (stand-in for prepare_preference)"
    )
    p.add_argument("--out-dir", required=True, help="results/<run>/preference/data")
    p.add_argument("--rows", type=int, required=True, help="rows to write (pairs, or KTO rows)")
    p.add_argument("--method", choices=("dpo", "kto"), required=True, help="preference.method")
    a = p.parse_args(argv)
    write(a.out_dir, a.rows, a.method)
    return 0


if __name__ == "__main__":
    sys.exit(main())
