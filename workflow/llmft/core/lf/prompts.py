"""LLaMA-Factory's chat templates as data, so that evaluation encodes prompts without importing
LLaMA-Factory (whose `llamafactory.data` pulls in peft, datasets and the collators: ~3 of the ~5 CPU
seconds the demo's whole evaluation command took).

`templates.json` holds, for each plain template of the LLaMA-Factory version it was made from (a
`Template` whose formatters only substitute text, no media plugin: 54 of 0.9.5's 121), the output of
the template's own `encode_oneturn` run once per conversation shape (one or two turns, with or
without a system prompt) on marker texts, with a tokenizer that records instead of encoding: text
pieces with markers where a row's texts go, and named special tokens. `python -m llmft.core.lf.prompts
--write` regenerates it from the installed LLaMA-Factory; the tests check that it still equals what
LLaMA-Factory produces and that the prompt and answer ids equal `encode_oneturn`'s.

`PromptEncoder.load` returns None, and the caller uses LLaMA-Factory itself, whenever this could
differ from it: another LLaMA-Factory version, a template not in the table, a tokenizer that
LLaMA-Factory's `fix_special_tokens` would change (EOS to replace, stop words to set), a
conversation of another shape, a tool row (function calls, observations, tools), or a text holding
a marker or a `{{...}}` placeholder.
"""

from __future__ import annotations

import json
import logging
from importlib import metadata
from pathlib import Path

from llmft.core import conversation

log = logging.getLogger("llmft.core.lf.prompts")

TABLE = Path(__file__).with_name("templates.json")
# (messages, system prompt given): single-turn rows, and rows with one earlier turn of history.
SHAPES = ((2, False), (2, True), (4, False), (4, True))


def _marker(i: int) -> str:
    return f"\x00{i}\x00"


def row_contents(row: dict) -> tuple[list[str], str]:
    """The message texts LLaMA-Factory's alpaca converter builds (history turns, the prompt joined
    from instruction and input, the answer) and the system prompt, of a plain row."""
    return conversation.contents(row), conversation.system(row)


class Recorder:
    """Stands in for the tokenizer inside a template: texts come back as themselves, special
    tokens as symbols (["token", name], ["bos"], ["eos"]) resolved later against the real one."""

    bos_token_id = ["bos"]
    eos_token_id = ["eos"]

    def encode(self, text: str, add_special_tokens: bool = False, **_) -> list:
        if add_special_tokens:
            raise AssertionError("LLaMA-Factory templates encode without special tokens")
        return [text]

    def convert_tokens_to_ids(self, token: str) -> list:
        return [["token", token]]


def _flat(elements: list) -> list:
    """Recorded elements as JSON values: text pieces, and symbol lists."""
    out = []
    for e in elements:
        if isinstance(e, list) and e and isinstance(e[0], list):  # convert_tokens_to_ids' [[...]]
            out.extend(e)
        else:
            out.append(e)
    return out


def build_table() -> dict:
    """The table from the installed LLaMA-Factory (imports it)."""
    from llamafactory.data.formatter import EmptyFormatter, StringFormatter
    from llamafactory.data.mm_plugin import BasePlugin
    from llamafactory.data.template import TEMPLATES, Template

    templates = {}
    for name, tpl in sorted(TEMPLATES.items()):
        formatters = (tpl.format_user, tpl.format_assistant, tpl.format_system, tpl.format_prefix)
        if not (
            type(tpl) is Template
            and type(tpl.mm_plugin) is BasePlugin
            and all(type(f) in (StringFormatter, EmptyFormatter) for f in formatters)
        ):
            continue
        plans = {}
        for n, has_system in SHAPES:
            msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": _marker(i)} for i in range(n)]
            prompt, answer = tpl.encode_oneturn(Recorder(), msgs, _marker(n) if has_system else None)
            plans[f"{n}{'s' if has_system else ''}"] = [_flat(prompt), _flat(answer)]
        templates[name] = {
            "efficient_eos": tpl.efficient_eos,
            "replace_eos": tpl.replace_eos,
            "stop_words": list(tpl.stop_words),
            "plans": plans,
        }
    return {"llamafactory": metadata.version("llamafactory"), "templates": templates}


def _special_names(tokenizer) -> list[str]:
    """Names of the tokenizer's additional special tokens (transformers 4 and 5 spell them apart)."""
    names = getattr(tokenizer, "additional_special_tokens", None)
    if not isinstance(names, list):
        names = getattr(tokenizer, "_extra_special_tokens", None) or []
    return [str(t) for t in names]


class PromptEncoder:
    """(prompt ids, answer ids) of alpaca rows, equal to LLaMA-Factory's `encode_oneturn` (plus EOS
    on the answer for efficient-EOS templates, as its SFT processor adds)."""

    def __init__(self, tokenizer, spec: dict):
        self.tokenizer = tokenizer
        self.spec = spec

    @classmethod
    def load(cls, tokenizer, template: str) -> tuple[PromptEncoder | None, str]:
        """The encoder, or None and why LLaMA-Factory's own template has to be used."""
        try:
            installed = metadata.version("llamafactory")
        except metadata.PackageNotFoundError:
            installed = None
        table = json.loads(TABLE.read_text(encoding="utf-8"))
        if installed != table["llamafactory"]:
            return None, f"the table is from LLaMA-Factory {table['llamafactory']}, {installed} is installed"
        spec = table["templates"].get(template)
        if spec is None:
            return None, f"template {template!r} is not a plain one in the table"
        if tokenizer.eos_token_id is None:
            return None, "the tokenizer has no EOS token (LLaMA-Factory would add one)"
        stops = spec["stop_words"]
        if spec["replace_eos"]:
            if tokenizer.eos_token != stops[0]:
                return None, f"LLaMA-Factory would replace EOS {tokenizer.eos_token!r} with {stops[0]!r}"
            stops = stops[1:]
        if stops and _special_names(tokenizer) != stops:
            # It adds them with add_special_tokens(..., replace_additional_special_tokens=False);
            # transformers 5 names that flag replace_extra_special_tokens, so LLaMA-Factory retries
            # without it and the stop words replace the tokenizer's extra special tokens (and with
            # them its stop ids). Only a tokenizer whose extras are already exactly these is unchanged.
            return None, f"LLaMA-Factory would set the extra special tokens to the stop words {stops}"
        return cls(tokenizer, spec), "template table"

    def encode(self, rows: list[dict]) -> list[tuple[list[int], list[int]]] | None:
        """Every row's ids, or None if one row needs LLaMA-Factory's template."""
        plans = self.spec["plans"]
        filled = []
        texts: dict[str, int] = {}
        for row in rows:
            if conversation.is_tool_row(row):  # tool turns and tools: LLaMA-Factory's formatters
                return None
            contents, system = row_contents(row)
            values = contents + [system]
            plan = plans.get(f"{len(contents)}{'s' if system else ''}")
            if plan is None or any("\x00" in v or "{{" in v for v in values):
                return None
            parts = []
            for part in plan:
                out = []
                for elem in part:
                    if isinstance(elem, str):
                        for i, value in enumerate(values):
                            elem = elem.replace(_marker(i), value)
                        if not elem:  # LLaMA-Factory skips empty strings
                            continue
                        texts.setdefault(elem, len(texts))
                    out.append(elem)
                parts.append(out)
            filled.append(parts)
        tok = self.tokenizer
        ids = tok(list(texts), add_special_tokens=False)["input_ids"] if texts else []
        symbols = {"bos": tok.bos_token_id, "eos": tok.eos_token_id}
        tokens: dict[str, int] = {}
        eos = [tok.eos_token_id] if self.spec["efficient_eos"] else []

        def expand(part: list) -> list[int]:
            out: list[int] = []
            for elem in part:
                if isinstance(elem, str):
                    out += ids[texts[elem]]
                elif elem[0] == "token":
                    if elem[1] not in tokens:
                        tokens[elem[1]] = tok.convert_tokens_to_ids(elem[1])
                    out.append(tokens[elem[1]])
                elif symbols[elem[0]] is not None:  # as LLaMA-Factory: no BOS id, no BOS
                    out.append(symbols[elem[0]])
            return out

        return [(expand(prompt), expand(answer) + eos) for prompt, answer in filled]


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="(Re)generate templates.json from the installed LLaMA-Factory")
    ap.add_argument("--write", action="store_true", help=f"write {TABLE.name} (else print a summary)")
    args = ap.parse_args()
    table = build_table()
    if args.write:
        TABLE.write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"LLaMA-Factory {table['llamafactory']}: {len(table['templates'])} plain templates")


if __name__ == "__main__":
    main()
