"""The training worker torchrun runs on every process (`llmft sft launch`): sft's worker
(llmft.sft.train) with the trainer patches each stage supplies for what the rendered YAML's `llmft:`
block asks; `padding_free` is the preference stage's padding-free DPO forward (llmft.preference.padfree),
`reference_logps` its trainers' cached reference log-probabilities (llmft.preference.refpatch)."""

from __future__ import annotations

import sys

from llmft.sft.train import main as train_main


def _padding_free(_value) -> None:
    from llmft.preference import padfree

    padfree.install()


def _reference_logps(record) -> None:
    from llmft.preference import refpatch
    from llmft.preference.reference import ReferenceError

    try:
        refpatch.install(str(record))
    except ReferenceError as exc:  # a stale or foreign cache: named, training does not start
        sys.exit(f"[llmft] reference error: {exc}")


PATCHES = {"padding_free": _padding_free, "reference_logps": _reference_logps}


def main(argv: list[str] | None = None) -> int:
    return train_main(argv, patches=PATCHES)


if __name__ == "__main__":
    sys.exit(main())
