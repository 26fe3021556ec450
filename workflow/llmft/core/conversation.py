"""The conversation LLaMA-Factory builds from a canonical row: its messages, system prompt and tools,
and where the prompt ends and the answer begins. Tokenizing, packing and evaluation all read rows
through this module, so they agree with each other and with LLaMA-Factory's converters.

Two canonical row forms (core/sources.py makes them):

- plain rows, alpaca-with-history: `instruction`, `input`, `output`, optional `system` and
  `history` ([user, assistant] pairs). LLaMA-Factory's alpaca converter turns them into history
  turns, then one user turn "instruction\\ninput", then the answer.
- tool rows: `messages`, a list of {role, content} with LLaMA-Factory's role names (user,
  assistant, observation, function), optional `system` and `tools` (a JSON string, passed to the
  template's tool formatter as LLaMA-Factory passes its `tools` column). User or observation turns
  sit at prompt positions, assistant or function turns at answer positions, the last one is the
  answer. LLaMA-Factory's sharegpt converter reads them as they are.

A plain row written into a split that holds tool rows also carries `messages` (LLaMA-Factory reads
the whole split in one format); both spellings give the same conversation.
"""

from __future__ import annotations

USER = "user"
ASSISTANT = "assistant"
OBSERVATION = "observation"
FUNCTION = "function"
SYSTEM = "system"

# LLaMA-Factory's default sharegpt tag of each role: how llmft writes sharegpt rows of its own.
DEFAULT_SHAREGPT_TAG = {
    USER: "human",
    ASSISTANT: "gpt",
    OBSERVATION: "observation",
    FUNCTION: "function_call",
    SYSTEM: "system",
}
# Every role name llmft reads, in either spelling (the role's own name or its sharegpt tag) -> the role.
ROLE_OF = {tag: role for role, tag in DEFAULT_SHAREGPT_TAG.items()} | {r: r for r in DEFAULT_SHAREGPT_TAG}

# dataset_info.json tags for a sharegpt split written in these role names: LLaMA-Factory's tag
# mapping then maps every role to itself.
SHAREGPT_TAGS = {
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": USER,
    "assistant_tag": ASSISTANT,
    "observation_tag": OBSERVATION,
    "function_tag": FUNCTION,
    "system_tag": SYSTEM,
}


def is_tool_row(row: dict) -> bool:
    """A row in the messages form: it needs LLaMA-Factory's template run on it (tool turns, tools)."""
    return "messages" in row and "output" not in row


def prompt_text(row: dict) -> str:
    """The last prompt turn's text: for plain rows instruction and input joined as LLaMA-Factory's
    alpaca converter joins them."""
    if is_tool_row(row):
        return row["messages"][-2]["content"]
    return "\n".join(part for part in (row.get("instruction"), row.get("input")) if part)


def contents(row: dict) -> list[str]:
    """The message texts of a plain row, in order (history turns, prompt, answer)."""
    out = [c for pair in row.get("history") or () for c in pair]
    out.append(prompt_text(row))
    out.append(row["output"])
    return out


def messages(row: dict) -> list[dict]:
    """The messages LLaMA-Factory's converter builds from the row (prompt turns and the answer)."""
    if is_tool_row(row):
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    texts = contents(row)
    return [{"role": USER if i % 2 == 0 else ASSISTANT, "content": t} for i, t in enumerate(texts)]


def system(row: dict) -> str:
    return row.get("system") or ""


def tools(row: dict) -> str:
    """The tools JSON string as LLaMA-Factory's template receives it ("" = none; "[]" is not none:
    the template still writes a system block for it)."""
    return row.get("tools") or ""


def answer(row: dict) -> dict:
    """The last message: what evaluation compares a generation with."""
    if is_tool_row(row):
        return dict(row["messages"][-1])
    return {"role": ASSISTANT, "content": row["output"]}


def split(row: dict) -> tuple[list[dict], list[dict]]:
    """(prompt messages, [answer message]) as LLaMA-Factory's converters split a row."""
    msgs = messages(row)
    return msgs[:-1], msgs[-1:]


def sharegpt_line(row: dict) -> dict:
    """The row as a line of a split written in the sharegpt form: plain rows gain `messages`."""
    if "messages" in row:
        return row
    return {**row, "messages": messages(row)}
