"""Padding-free DPO (llmft.preference.padfree) against LLaMA-Factory's own
CustomDPOTrainer.concatenated_forward: the same log-probabilities, lengths and gradients on a tiny
Llama, for right and left padding."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("llamafactory")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation("sdpa")
    return model


def _batch(left: bool):
    """4 sequences (2 chosen, 2 rejected) of different lengths; prompts carry no labels."""
    torch.manual_seed(1)
    lengths, prompts = [11, 7, 16, 5], [4, 3, 6, 2]
    seq = 18
    ids = torch.zeros(4, seq, dtype=torch.long)
    mask = torch.zeros(4, seq, dtype=torch.long)
    labels = torch.full((4, seq), -100)
    for r, (n, p) in enumerate(zip(lengths, prompts, strict=True)):
        span = slice(seq - n, seq) if left else slice(0, n)
        tokens = torch.randint(3, 97, (n,))
        ids[r, span], mask[r, span] = tokens, 1
        lab = tokens.clone()
        lab[:p] = -100
        labels[r, span] = lab
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _trainer(loss_type: str):
    return SimpleNamespace(
        finetuning_args=SimpleNamespace(use_ref_model=True),
        ld_alpha=None,
        loss_type=loss_type,
        processing_class=SimpleNamespace(pad_token_id=0),
    )


@pytest.mark.parametrize("left", [False, True], ids=["right_padding", "left_padding"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_same_logps_and_gradients_as_llamafactory(left, loss_type):
    from llamafactory.train.dpo.trainer import CustomDPOTrainer
    from llmft.preference import padfree

    theirs_model = _model()
    ours_model = copy.deepcopy(theirs_model)
    batch = _batch(left)
    trainer = _trainer(loss_type)
    original = getattr(CustomDPOTrainer, "_llmft_padded_forward", CustomDPOTrainer.concatenated_forward)
    theirs = original(trainer, theirs_model, {k: v.clone() for k, v in batch.items()})
    from llmft.core import varlen

    varlen.register()
    ours = padfree.concatenated_forward(trainer, ours_model, {k: v.clone() for k, v in batch.items()})
    for key in ("chosen_logps", "rejected_logps", "chosen_logps_avg"):
        assert torch.allclose(ours[key], theirs[key], atol=1e-4, rtol=1e-5), (key, ours[key], theirs[key])
    # the DPO loss's input: a margin of both sides; both models' parameters get the same gradient
    (theirs["chosen_logps"] - 2 * theirs["rejected_logps"]).sum().backward()
    (ours["chosen_logps"] - 2 * ours["rejected_logps"]).sum().backward()
    for (name, a), (_, b) in zip(theirs_model.named_parameters(), ours_model.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name
    assert ours_model.config._attn_implementation == varlen.NAME


def test_flatten_pairs_targets_and_sequences():
    from llmft.preference import padfree

    batch = _batch(left=False)
    ids, pos, cu, longest, targets, index = padfree.flatten_pairs(**batch)
    assert ids.shape == (1, 48) and longest == 16  # 39 real tokens + 9 of padding to a multiple of 16
    assert cu.tolist() == [0, 11, 18, 34, 39, 48]
    assert pos[0, 11:18].tolist() == list(range(7))
    assert index[:11].eq(0).all() and index[39:].eq(-1).all() and targets[39:].eq(-100).all()
    # a sequence's last token has no target; the token before the first answer token targets it
    assert targets[10] == -100 and targets[3] == batch["labels"][0, 4]
    assert targets[:3].eq(-100).all()


def test_chunks_change_nothing():
    """Chunked log-probabilities (checkpointed, recomputed in backward) equal one chunk's."""
    from llmft.preference import padfree

    torch.manual_seed(2)
    head = torch.nn.Linear(8, 31, bias=False)
    hidden = torch.randn(20, 8, requires_grad=True)
    targets = torch.randint(0, 31, (20,))
    targets[[0, 7]] = -100
    whole, _ = padfree.token_logps(head, hidden, targets, chunk=1000)
    (g_whole,) = torch.autograd.grad(whole.sum(), hidden)
    chunked, _ = padfree.token_logps(head, hidden, targets, chunk=3)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), hidden)
    ref = torch.log_softmax(head(hidden), -1).gather(1, targets.clamp(min=0)[:, None])[:, 0]
    assert torch.allclose(whole, ref * (targets != -100), atol=1e-6)
    assert torch.allclose(chunked, whole, atol=1e-6) and torch.allclose(g_chunked, g_whole, atol=1e-6)
    assert whole[[0, 7]].eq(0).all()
