"""The names LLaMA-Factory accepts, checked when the config is validated: chat templates and
training arguments (so an unknown `model.template` or a typo in `sft.extra` stops the run before
any job, naming the key).

Importing LLaMA-Factory takes ~8 s, too slow for every `snakemake -n`: the names are read once from
the installed version into lf_names.json (`python -m llmft.core.lf.lfnames`), and a test checks that file
against the LLaMA-Factory installed with llmft.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
from functools import cache
from pathlib import Path

TABLE = Path(__file__).with_name("lf_names.json")


def from_llamafactory() -> dict:
    import llamafactory
    from llamafactory.data.template import TEMPLATES
    from llamafactory.hparams.parser import _TRAIN_ARGS

    arguments = sorted({f.name for cls in _TRAIN_ARGS for f in dataclasses.fields(cls)})
    return {"llamafactory": llamafactory.__version__, "templates": sorted(TEMPLATES), "arguments": arguments}


@cache
def names() -> dict:
    return json.loads(TABLE.read_text())


def closest(word: str, choices: list[str]) -> str:
    near = difflib.get_close_matches(word, choices, n=3)
    return f" (did you mean {', '.join(near)}?)" if near else ""


def main() -> int:
    TABLE.write_text(json.dumps(from_llamafactory(), indent=1) + "\n")
    print(f"wrote {TABLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
