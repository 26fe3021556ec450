"""Render a model folder's chat template on probe conversations, as transformers'
apply_chat_template does, inside a budget: run as its own process (chat_templates.render_probes)
that the caller kills past its time budget, with an address-space limit and an output cap, so that
a template with nested `range()` loops cannot hold the DAG build for minutes or fill the memory.

Reads {"template", "special", "probes": [[name, messages, add_generation_prompt], ...]} as JSON on
stdin and writes {"renders": {name: {"text", "always"} | {"error"}}} or {"budget": why} on stdout.
Imports jinja2 only (run with `python -I`, no llmft on the path).
"""

from __future__ import annotations

import json
import resource
import sys

# The most a render may write, and the address space the process may use: real chat templates write
# a few kB with a few MB.
MAX_CHARS = 1_000_000
MAX_BYTES = 1 << 30


class OverBudget(Exception):
    pass


def environment():
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # transformers' {% generation %} marks assistant text: render it
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise ValueError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: "26 Jul 2024" if "%d" in fmt else ""
    return env


def render(tpl, special: dict, messages: list, add_generation_prompt: bool) -> str:
    """One render, streamed so that the output cap stops it as soon as it is passed."""
    out, size = [], 0
    ctx = dict(messages=messages, add_generation_prompt=add_generation_prompt, tools=None, documents=None)
    for piece in tpl.generate(**ctx, **special):
        size += len(piece)
        if size > MAX_CHARS:
            raise OverBudget(f"it wrote more than {MAX_CHARS} characters for one conversation")
        out.append(piece)
    return "".join(out)


def render_all(request: dict) -> dict:
    tpl = environment().from_string(request["template"])
    special = request["special"]
    renders = {}
    for name, messages, generation in request["probes"]:
        try:
            text = render(tpl, special, messages, generation)
            # Some templates (Llama-3.0's first) append the next assistant header regardless.
            always = not generation and render(tpl, special, messages, True) == text
            renders[name] = {"text": text, "always": always}
        except (OverBudget, MemoryError, RecursionError):
            raise
        except Exception as exc:  # noqa: BLE001 - a template that refuses a probe (e.g. a system turn)
            renders[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return {"renders": renders}


def main() -> None:
    request = json.loads(sys.stdin.read())
    resource.setrlimit(resource.RLIMIT_AS, (MAX_BYTES, MAX_BYTES))
    try:
        reply = render_all(request)
    except OverBudget as exc:
        reply = {"budget": str(exc)}
    except MemoryError:
        reply = {"budget": f"it needed more than {MAX_BYTES >> 20} MiB of memory"}
    except RecursionError:
        reply = {"budget": "it recursed past Python's limit"}
    except Exception as exc:  # noqa: BLE001 - e.g. a syntax error: reported, the caller goes on without it
        reply = {"renders": {}, "error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(reply))


if __name__ == "__main__":
    main()
