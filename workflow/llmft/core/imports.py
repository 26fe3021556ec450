"""Packages a stage's libraries import whenever they are installed, though the stage never uses them.

Measured with `python -X importtime` on the CPU demo: transformers' generation module imports
scikit-learn for assisted decoding's confidence threshold (~1.5 s, scipy and pandas with it), nltk
imports it for its classifier wrappers and scipy.stats for a collocation test (~0.5 s), transformers'
quantizers import torchao (~0.8 s), and `save_pretrained` imports DeepSpeed (~1.5 s): each in every
process that loads a model. Only the standard benchmarks (lm-evaluation-harness) call scikit-learn;
torchao is llmft's FP8 (imported by llmft.core.fp8 itself, after these imports); DeepSpeed is
training's. `hidden(...)` makes such packages look not installed to the code it wraps:
`importlib.util.find_spec` reports them missing and an import fails at once, so the libraries take
their own "not installed" path (each import above is optional there).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

# No stage but the standard benchmarks calls scikit-learn.
UNUSED = ("sklearn",)
# Stages that load a model but never train or quantize it (the base model's creation, evaluation).
UNUSED_BY_INFERENCE = UNUSED + ("torchao", "scipy")


@contextmanager
def hidden(*names: str) -> Iterator[None]:
    """Within the block, `names` that are not imported yet look not installed; afterwards they
    are importable again (a module imported inside keeps what it saw)."""
    masked = [n for n in names if n not in sys.modules]
    for name in masked:
        sys.modules[name] = None  # find_spec -> None; `import name` -> ImportError
    try:
        yield
    finally:
        for name in masked:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
