"""Chat formats as their authors publish them, written out by hand: the independent reference the
template tables (llmft.core.lf.chat_templates, llmft.core.lf.prompts) are checked against. Both tables are
generated from the installed LLaMA-Factory, so comparing a table with a fresh build of itself only
shows it is not stale; these strings show it renders what the model authors document.

- ChatML as Qwen2.5 documents it (its model card's chat template): `<|im_start|>{role}\\n{content}
  <|im_end|>\\n` per message, a default system message when none is given.
- Llama 3 as Meta documents it (the Llama 3 model card, "Prompt format"): `<|begin_of_text|>`, then
  `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>` per message.
- Alpaca as Stanford Alpaca's README gives its prompt without input.
"""

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
ALPACA_PREAMBLE = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request."
)


def chatml(turns: list[tuple[str, str]], system: str | None = None, generation: bool = False) -> str:
    """Qwen2.5's ChatML; without a system message, Qwen's default one."""
    turns = [("system", QWEN_SYSTEM if system is None else system), *turns]
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + ("<|im_start|>assistant\n" if generation else "")


def llama3(turns: list[tuple[str, str]], system: str | None = None, generation: bool = False) -> str:
    """Llama 3's format; without a system message, none."""
    turns = ([("system", system)] if system is not None else []) + turns
    head = "<|start_header_id|>{}<|end_header_id|>\n\n"
    text = "".join(head.format(role) + f"{content}<|eot_id|>" for role, content in turns)
    return "<|begin_of_text|>" + text + (head.format("assistant") if generation else "")


def alpaca(instruction: str, response: str) -> str:
    return f"{ALPACA_PREAMBLE}\n\n### Instruction:\n{instruction}\n\n### Response:\n{response}"


def flatten(elements: list, bos: str = "", eos: str = "") -> str:
    """A table's rendered elements as text: strings as they are, ["bos"]/["eos"] as the given tokens,
    ["token", name] as the token's text."""
    names = {"bos": bos, "eos": eos}
    return "".join(e if isinstance(e, str) else names.get(e[0], e[-1]) for e in elements)
