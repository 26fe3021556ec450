"""llmft's greedy decoder, shared by evaluate (held-out generation) and benchmarks (lm-eval's
generate_until): left-padded prompts, a static KV cache, the one-token step captured once per batch
as a CUDA/HIP graph on a GPU (eager elsewhere)."""

from __future__ import annotations

import inspect


def left_pad(prompts: list[list[int]], pad_id: int, tail: int = 0):
    """(ids, attention mask) of left-padded prompts: every prompt ends at the same column. The mask
    has `tail` more columns, closed, for the tokens still to come."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width + tail), dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, width - len(p) :] = torch.tensor(p)
        mask[j, width - len(p) : width] = 1
    return ids, mask


# generation_config.json settings (with their neutral values) that change greedy tokens in
# `generate`: the graphs loop applies none of them, so a model that sets one decodes with `generate`.
GREEDY_CHANGERS = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "sequence_bias": None,
    "bad_words_ids": None,
    "min_length": 0,
    "min_new_tokens": 0,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "exponential_decay_length_penalty": None,
}


def greedy_changers(generation_config) -> list[str]:
    """The GREEDY_CHANGERS a model's generation config sets to other than neutral."""
    return [
        k
        for k, neutral in GREEDY_CHANGERS.items()
        if getattr(generation_config, k, None) not in (None, neutral)
    ]


def greedy_graphs(
    model,
    prompts: list[list[int]],
    max_new: int,
    stop_ids: list[int],
    pad_id: int,
    device,
    capture: bool = True,
) -> list[list[int]]:
    """Greedy tokens (as `generate` gives them) from llmft's own loop over a static KV cache.

    Column c of the cache holds the token at column c of the left-padded batch; the attention mask
    opens each column as its token is fed, so unfilled cache slots are never attended to. On a GPU
    the one-token step runs once eagerly (the warm-up CUDA graphs need), then is captured and
    replayed with its inputs updated in place. Rows stop at a stop id like `generate` does; the loop
    ends once every row has stopped (checked every few steps, one host sync each).
    """
    import torch
    from transformers import StaticCache

    changers = greedy_changers(getattr(model, "generation_config", None))
    if changers:
        raise ValueError(
            f"the model's generation_config sets {', '.join(changers)}, which only generate applies"
        )
    new = max_new
    ids, mask = left_pad(prompts, pad_id, tail=new)
    n, width = ids.shape
    # Position ids as if every column were filled: each row counts from its first real token.
    positions = (
        torch.cat([mask[:, :width], torch.ones((n, new), dtype=torch.long)], 1).cumsum(-1) - 1
    ).clamp(min=0)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    stops = torch.tensor(stop_ids, device=device)
    cache = StaticCache(config=model.config, max_cache_len=width + new)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def step(tokens, pos, cache_pos):
        logits = model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            cache_position=cache_pos,
            use_cache=True,
            **keep,
        ).logits
        return logits[:, -1].argmax(-1)

    out = torch.empty((n, new), dtype=torch.long, device=device)
    out[:, 0] = step(ids, positions[:, :width], torch.arange(width, device=device))
    # The one-token step's inputs live in fixed tensors, filled before each run (a graph reads them).
    # transformers 5 ignores cache_position (its StaticCache counts filled columns on the device,
    # which a replayed graph advances too); 4.x needs it.
    tok = torch.empty((n, 1), dtype=torch.long, device=device)
    pos = torch.empty((n, 1), dtype=torch.long, device=device)
    cache_pos = torch.empty((1,), dtype=torch.long, device=device)
    use_graph = capture and torch.device(device).type == "cuda"  # a graph is captured on one GPU
    graph = nxt = None
    done = 1
    for t in range(1, new):
        col = width + t - 1  # the column of the token fed in this step
        tok.copy_(out[:, t - 1 : t])
        pos.copy_(positions[:, col : col + 1])
        cache_pos.fill_(col)
        mask[:, col] = 1
        if graph is not None:
            graph.replay()
        elif use_graph and t > 1:  # step 1 ran eagerly on this batch's shapes: capture step 2 on
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                nxt = step(tok, pos, cache_pos)
            graph.replay()
        else:
            nxt = step(tok, pos, cache_pos)
        out[:, t] = nxt
        done = t + 1
        if t % 8 == 0 and bool(torch.isin(out[:, : t + 1], stops).any(-1).all()):
            break
    return out[:, :done].tolist()
