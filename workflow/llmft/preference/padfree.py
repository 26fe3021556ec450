"""Padding-free DPO: a pair batch's sequences as one row, log-probabilities without full logits.

LLaMA-Factory's DPO forward (`CustomDPOTrainer.concatenated_forward`) runs the 2 x B sequences of a
micro-batch (every chosen, then every rejected answer) padded to the longest of them, asks the model
for the logits of every position, upcasts all of them to fp32 and takes a log-softmax over the whole
vocabulary. The padding costs as much compute as real tokens (a quarter of a batch of pairs of
random length), and the fp32 logits of a 128 k vocabulary are 8 GiB per 16 k tokens, twice over with
the log-softmax, for the policy and again for the reference model.

`install()` replaces that method with one that computes the same quantities:
- the real tokens of every sequence are laid end to end in one row, each sequence keeping its own
  position ids, and run through llmft's varlen attention (llmft.core.varlen: torch's FlashAttention
  varlen kernel on a GPU, per-sequence causal SDPA on a CPU), so no padding is computed and no
  sequence sees another;
- the model is asked for the logits of one position only (`logits_to_keep=1`); the decoder's last
  hidden states are taken from a forward hook, and each token's log-probability of its label is
  computed in chunks of CHUNK_TOKENS through the model's own output layer, logits upcast to fp32 as
  LLaMA-Factory does, each chunk recomputed in the backward pass rather than kept (checkpointed);
- the sums per sequence, the answer lengths and everything LLaMA-Factory's loss reads are returned as
  its method returns them. `chosen_logits` / `rejected_logits` feed only its `logits/*` metrics:
  here they are each real token's mean logit (LLaMA-Factory averages padding positions too).

LD-DPO (`ld_alpha`) keeps LLaMA-Factory's method. tests/unit/preference/test_padfree.py compares both
methods' outputs and gradients on a tiny model.
"""

from __future__ import annotations

import logging

import torch
from llmft.core.objective import PADFREE_CHUNK as CHUNK_TOKENS
from llmft.core.varlen import IGNORE_INDEX, PAD_MULTIPLE

log = logging.getLogger("llmft.preference.padfree")


def flatten_pairs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor, pad_id: int = 0
):
    """A padded (rows, seq) batch -> the packed row's inputs and each packed token's label.

    Returns (input_ids (1, n), position_ids (1, n), cu_seqlens (k + 1,), longest, targets (n,),
    sequence index (n,)): the real tokens of every row in row order, then padding to a multiple of
    PAD_MULTIPLE (a sequence of its own, no targets, index -1). A token's target is the label of the
    token after it in the same row, as LLaMA-Factory's get_batch_logps shifts them."""
    rows, seq = input_ids.shape
    keep = attention_mask.bool()
    lengths = keep.sum(1)
    nxt = torch.full_like(labels, IGNORE_INDEX)
    nxt[:, :-1] = labels[:, 1:]
    nxt = nxt.masked_fill(~torch.roll(keep, -1, 1) | ~keep, IGNORE_INDEX)
    nxt[:, -1] = IGNORE_INDEX
    positions = (keep.long().cumsum(1) - 1).clamp(min=0)
    seq_index = torch.arange(rows, device=input_ids.device).unsqueeze(1).expand(rows, seq)
    n = int(lengths.sum())
    tail = -n % PAD_MULTIPLE
    flat_ids = torch.cat([input_ids[keep], input_ids.new_full((tail,), pad_id)])
    flat_pos = torch.cat([positions[keep], torch.arange(tail, device=input_ids.device)])
    targets = torch.cat([nxt[keep], labels.new_full((tail,), IGNORE_INDEX)])
    index = torch.cat([seq_index[keep], seq_index.new_full((tail,), -1)])
    seqlens = torch.cat([lengths, lengths.new_tensor([tail])]) if tail else lengths
    seqlens = seqlens[seqlens > 0]
    cu = torch.zeros(seqlens.numel() + 1, dtype=torch.int32, device=input_ids.device)
    cu[1:] = torch.cumsum(seqlens, 0)
    return flat_ids.unsqueeze(0), flat_pos.unsqueeze(0), cu, int(seqlens.max()), targets, index


def _chunk(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(2, n): each token's log-probability of its target (0 where ignored) and its mean logit."""
    logits = head(hidden).float()
    picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logps = (picked - torch.logsumexp(logits, -1)) * (targets != IGNORE_INDEX)
    return torch.stack([logps, logits.mean(-1).detach()])


def token_logps(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk: int = CHUNK_TOKENS
):
    """Per-token (log-probability of the target, mean logit) over (n, hidden) states, a chunk at a
    time; with gradients each chunk's logits are recomputed in the backward pass (checkpointed)."""
    from torch.utils.checkpoint import checkpoint

    grad = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        parts.append(checkpoint(_chunk, head, h, t, use_reentrant=False) if grad else _chunk(head, h, t))
    out = torch.cat(parts, 1)
    return out[0], out[1]


def _causal_lm(model):
    """The transformers causal LM inside the trainer's wrappers (DeepSpeed, DDP, PEFT)."""
    inner = model
    for _ in range(4):
        if hasattr(inner, "get_base_model"):  # a PEFT model
            inner = inner.get_base_model()
        elif hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
            inner = inner.module
        else:
            break
    return inner


def packed_logps(model, batch: dict, pad_id: int = 0) -> dict:
    """Per-sequence sums of label log-probabilities of a padded pair batch, computed padding-free:
    {"logps", "lengths", "mean_logits" (per sequence, over its real tokens)}."""
    from llmft.core import varlen

    lm = _causal_lm(model)
    if lm.config._attn_implementation != varlen.NAME:
        lm.set_attn_implementation(varlen.NAME)
    ids, pos, cu, longest, targets, index = flatten_pairs(
        batch["input_ids"], batch["attention_mask"], batch["labels"], pad_id
    )
    captured = {}

    def grab(_module, _args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    hook = lm.get_decoder().register_forward_hook(grab)
    try:
        model(
            input_ids=ids,
            position_ids=pos,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=longest,
            max_length_k=longest,
            logits_to_keep=1,
            use_cache=False,
            return_dict=True,
        )
    finally:
        hook.remove()
    logps, mean_logits = token_logps(lm.get_output_embeddings(), captured.pop("hidden")[0], targets)
    rows = batch["input_ids"].shape[0]
    real = index >= 0
    seq_of = index.clamp(min=0)

    def per_sequence(values: torch.Tensor) -> torch.Tensor:
        """Each sequence's sum of a per-token value (the row's padding tail counts for none)."""
        values = (values if values.is_floating_point() else values.long()) * real
        return torch.zeros(rows, dtype=values.dtype, device=values.device).index_add(0, seq_of, values)

    tokens = per_sequence(real)
    return {
        "logps": per_sequence(logps),
        "lengths": per_sequence(targets != IGNORE_INDEX),
        "mean_logits": per_sequence(mean_logits) / tokens.clamp(min=1),
    }


def concatenated_forward(self, model, batch: dict, is_ref_model: bool = False) -> dict:
    """CustomDPOTrainer.concatenated_forward, padding-free (same outputs; see the module docstring)."""
    if getattr(self, "ld_alpha", None) is not None and not is_ref_model:
        return self._llmft_padded_forward(model, batch, is_ref_model)
    pad_id = getattr(getattr(self, "processing_class", None), "pad_token_id", None) or 0
    out = packed_logps(model, batch, pad_id)
    all_logps, valid_length = out["logps"], out["lengths"]
    averaged = self.loss_type in ("ipo", "orpo", "simpo")  # these losses take the mean per token
    if averaged:
        all_logps = all_logps / valid_length
    half = batch["input_ids"].size(0) // 2
    chosen_logps, rejected_logps = all_logps.split(half, dim=0)
    chosen_logits, rejected_logits = out["mean_logits"].split(half, dim=0)
    chosen_length, _ = valid_length.split(half, dim=0)
    chosen_avg = chosen_logps if averaged else chosen_logps / chosen_length
    return {
        "chosen_logps": chosen_logps,
        "rejected_logps": rejected_logps,
        "chosen_logits": chosen_logits,
        "rejected_logits": rejected_logits,
        "chosen_logps_avg": chosen_avg,
    }


def install() -> None:
    """Give LLaMA-Factory's DPO trainer the padding-free forward (before run_exp)."""
    from llamafactory.train.dpo.trainer import CustomDPOTrainer
    from llmft.core import varlen

    varlen.register()
    if getattr(CustomDPOTrainer, "_llmft_padfree", False):
        return
    CustomDPOTrainer._llmft_padded_forward = CustomDPOTrainer.concatenated_forward
    CustomDPOTrainer.concatenated_forward = concatenated_forward
    CustomDPOTrainer._llmft_padfree = True
    log.info("dpo: padding-free pairs (varlen attention, chunked log-probabilities)")
