"""The training worker torchrun runs on every process (`llmft sft launch`): sft's worker
(llmft.sft.train) with the trainer patches each stage supplies for what the rendered YAML's `llmft:`
block asks; `padding_free` is the preference stage's padding-free DPO forward (llmft.preference.padfree)."""

from __future__ import annotations

import sys

from llmft.sft.train import main as train_main


def _padding_free() -> None:
    from llmft.preference import padfree

    padfree.install()


PATCHES = {"padding_free": _padding_free}


def main(argv: list[str] | None = None) -> int:
    return train_main(argv, patches=PATCHES)


if __name__ == "__main__":
    sys.exit(main())
