"""Fixtures the unit tests share."""

import pytest


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The demo's byte-level BPE tokenizer, 512 entries, built offline once per module."""
    from llmft.core.assets import build_tokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d, 512)
    return d
