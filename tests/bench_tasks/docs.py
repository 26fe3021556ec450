"""Documents and the check of the two test tasks; the documents are JSON Lines files beside this one."""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _load(name: str) -> dict:
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}


def category(**_kwargs) -> dict:
    return _load("category.jsonl")


def first_words(**_kwargs) -> dict:
    return _load("first_word.jsonl")


def first_word(doc: dict, results: list[str]) -> dict:
    words = results[0].split()
    return {"first_word": float(bool(words) and words[0] == doc["first"])}
