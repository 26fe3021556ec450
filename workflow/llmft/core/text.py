"""Text identity: what a row's texts become (clean_text) and how two texts compare (normalise)."""

from __future__ import annotations

import unicodedata


def clean_text(text: str) -> str:
    """What the model trains on: NFC, unified newlines, stripped ends; inner spacing is kept
    (indentation in code answers matters)."""
    if not text.isascii():
        text = unicodedata.normalize("NFC", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.strip()


def normalise(text: str) -> str:
    """Identity of a text for dedup and comparisons: clean_text plus inner runs of spaces collapsed."""
    text = clean_text(text)
    return "\n".join(" ".join(line.split()) for line in text.split("\n"))
