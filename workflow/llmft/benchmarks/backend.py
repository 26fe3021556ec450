"""llmft's lm-eval backend (`--model llmft`): lm-eval's `hf` model with its two hot paths replaced.

Everything lm-eval decides (tokenization, truncation, request order, chat templates, stop strings,
post-processing) stays HFLM's, so the requests are exactly the reference backend's; only the model
calls change: log-likelihoods come from one batched forward per batch of requests (left-padded,
logits kept for the continuations only), greedy generation from llmft's decoder (core.decode:
static KV cache, the step captured as a CUDA/HIP graph on a GPU). Sampling goes to `hf`'s path.
"""

from __future__ import annotations

from llmft.core.decode import greedy_graphs, left_pad
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM


def continuation_logprobs(model, seqs: list[tuple[list[int], list[int]]], pad_id: int, device):
    """(sum of log-probabilities, all greedy) of each continuation after its context tokens.

    Each row is context + continuation without its last token (what predicts the continuation).
    Rows that are the same tokens (a multiple-choice question's one-token choices all are) run once.
    Rows are left-padded so every continuation ends in the last column, and only the last
    (longest continuation) columns of logits are computed.
    """
    import torch

    inputs = [tuple((ctx + cont)[:-1]) for ctx, cont in seqs]
    row_of = {row: i for i, row in enumerate(dict.fromkeys(inputs))}
    keep = max(len(cont) for _, cont in seqs)
    ids, mask = left_pad([list(row) for row in row_of], pad_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        logits_to_keep=keep,
    ).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for row, (_, cont) in zip(inputs, seqs, strict=True):
        rows = logprobs[row_of[row], keep - len(cont) :]
        target = torch.tensor(cont, device=rows.device)
        picked = rows.gather(-1, target[:, None])[:, 0]
        out.append((float(picked.sum()), bool((rows.argmax(-1) == target).all())))
    return out


@register_model("llmft")
class LlmftLM(HFLM):
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        import torch

        size = override_bs or (self.batch_size if isinstance(self.batch_size, int) else 64)
        # Each request's model input, after HFLM's left truncation; requests with the same input (the
        # choices of a multiple-choice question) share one row, and a batch holds `size` rows.
        seqs: dict[tuple, list[int]] = {}
        split = []
        for i, (_, ctx, cont) in enumerate(requests):
            whole = (ctx + cont)[-(self.max_length + 1) :]
            split.append((whole[: len(whole) - len(cont)], cont))
            seqs.setdefault(tuple(whole[:-1]), []).append(i)
        # longest first, so each batch holds rows of similar length (little padding)
        rows = sorted(seqs, key=len, reverse=True)
        out: list = [None] * len(requests)
        pad = self.tokenizer.pad_token_id or 0
        with torch.inference_mode():
            for k in range(0, len(rows), size):
                idx = [i for row in rows[k : k + size] for i in seqs[row]]
                got = continuation_logprobs(self.model, [split[i] for i in idx], pad, self.device)
                for i, result in zip(idx, got, strict=True):
                    out[i] = result
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], result)
        return out

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """Greedy requests through llmft's decoder; the result is laid out as `generate` returns it
        (prompt columns, then each row's tokens up to its end-of-sequence, then padding)."""
        import torch

        greedy = not generation_kwargs.get("do_sample") and not generation_kwargs.get("temperature")
        if not greedy:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        mask = generation_kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(context)
        prompts = [row[m.bool()].tolist() for row, m in zip(context.cpu(), mask.cpu(), strict=True)]
        eos = self.model.generation_config.eos_token_id
        stops = (
            list(eos) if isinstance(eos, (list, tuple)) else [eos if eos is not None else self.eot_token_id]
        )
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else stops[0]
        new = max_length - context.shape[1]
        with torch.inference_mode():
            rows = greedy_graphs(self.model, prompts, new, stops, pad, self.device)
        width = max(len(r) for r in rows)
        tail = torch.full((len(rows), width), pad, dtype=context.dtype)
        for j, r in enumerate(rows):
            end = next((c + 1 for c, t in enumerate(r) if t in stops), len(r))
            tail[j, :end] = torch.tensor(r[:end])
        return torch.cat([context.cpu(), tail], 1).to(context.device)
