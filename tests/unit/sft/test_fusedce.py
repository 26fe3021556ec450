"""llmft.sft.fusedce against torch's cross-entropy on the materialised logits: the same loss and the
same gradients (input, weight, bias) in chunks, for "mean" and "sum", with ignored rows; no host read;
Liger's calls routed only where the module covers them."""

from __future__ import annotations

import inspect

import pytest
import torch
from llmft.sft import fusedce


def _case(rows=37, hidden=16, vocab=53, seed=0, ignored=(0, 5, 6, 30)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    b = torch.randn(vocab, generator=g, dtype=torch.float64)
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[list(ignored)] = -100
    return x, w, b, t


def _grads(fn, x, w, b, t, with_bias, train_head):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(train_head)
    b = b.clone().requires_grad_(train_head) if with_bias else None
    loss = fn(x, w, t, b)
    (loss * 0.37).backward()  # an upstream gradient that is not 1
    return loss.detach(), x.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("with_bias,train_head", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("rows_per_chunk", [None, 8, 37, 64])
def test_matches_torch_cross_entropy(reduction, with_bias, train_head, rows_per_chunk):
    x, w, b, t = _case()

    def ours(x, w, t, b):
        return fusedce.fused_linear_cross_entropy(
            x, w, t, b, reduction=reduction, rows_per_chunk=rows_per_chunk
        )

    def reference(x, w, t, b):
        logits = x @ w.t() + (b if b is not None else 0)
        return torch.nn.functional.cross_entropy(logits, t, ignore_index=-100, reduction=reduction)

    got = _grads(ours, x, w, b, t, with_bias, train_head)
    want = _grads(reference, x, w, b, t, with_bias, train_head)
    for g, r in zip(got, want, strict=True):
        if r is None:
            assert g is None
        else:
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    assert got[1][[0, 5, 6, 30]].abs().max() == 0  # ignored rows get no gradient


def test_bf16_close_to_float64():
    x, w, _, t = _case(rows=64, hidden=32, vocab=300)
    got = fusedce.fused_linear_cross_entropy(x.bfloat16(), w.bfloat16(), t, rows_per_chunk=16)
    want = torch.nn.functional.cross_entropy(x @ w.t(), t)
    assert got.dtype == torch.float32
    assert abs(got.item() - want.item()) / want.item() < 1e-2


def test_float32_inputs_under_bf16_autocast():
    """A float32 model under bf16 autocast: bf16 logits, gradients back in float32."""
    x, w, _, t = _case(rows=48, hidden=32, vocab=300)
    x, w = x.float().requires_grad_(True), w.float().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fusedce.fused_linear_cross_entropy(x, w, t, rows_per_chunk=16)
    loss.backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    torch.nn.functional.cross_entropy(xr @ wr.t(), t).backward()
    assert abs(loss.item() - torch.nn.functional.cross_entropy(xr @ wr.t(), t).item()) < 2e-2
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad)):
        assert ((got.double() - want).norm() / want.norm()).item() < 3e-2


def test_all_rows_ignored_gives_zero_not_nan():
    x, w, _, t = _case(rows=6, ignored=range(6))
    x.requires_grad_(True)
    loss = fusedce.fused_linear_cross_entropy(x, w, t)
    loss.backward()
    assert loss.item() == 0.0 and x.grad.abs().max() == 0


def test_no_host_read(monkeypatch):
    """The forward and backward never call .item(), .tolist() or bool() on a tensor."""
    calls = []
    for name in ("item", "tolist", "__bool__"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    x, w, b, t = _case()
    x.requires_grad_(True)
    w.requires_grad_(True)
    for reduction in ("mean", "sum"):
        fusedce.fused_linear_cross_entropy(x, w, t, b, reduction=reduction, rows_per_chunk=8).backward()
    assert calls == []


def test_chunk_rows():
    # 8 B Llama: 8 192 rows, hidden 4 096, vocab 128 256 -> logits of 512 rows at a time
    assert fusedce.chunk_rows(8192, 4096, 128256) == 512
    assert fusedce.chunk_rows(8192, 2048, 128256) == 256
    assert fusedce.chunk_rows(3, 4096, 128256) == 1
    assert fusedce.chunk_rows(10, 64, 53) == 10  # never more than the batch


def test_bad_reduction():
    x, w, _, t = _case()
    with pytest.raises(ValueError, match="reduction"):
        fusedce.fused_linear_cross_entropy(x, w, t, reduction="none")


# Liger's functional entry (liger-kernel 0.8.5) has this signature; Liger itself needs a GPU build
def _liger_like(
    input, weight, target, bias=None, ce_weight=None, ignore_index: int = -100,
    lse_square_scale: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean",
    softcap=None, return_z_loss: bool = False, accum_dtype=None, use_token_scaling: bool = False,
    return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
    chunk_mem_const: int = 1,
):  # fmt: skip
    return "liger"


def test_route_keeps_signature_and_covers_only_plain_calls():
    routed = fusedce.route(_liger_like)
    assert inspect.signature(routed) == inspect.signature(_liger_like)  # Liger's callers filter on it
    x, w, _, t = _case()
    loss = routed(x, w, t, reduction="sum", ignore_index=-100)
    want = torch.nn.functional.cross_entropy(x @ w.t(), t, reduction="sum")
    torch.testing.assert_close(loss, want)
    assert routed(x, w, t, label_smoothing=0.1) == "liger"
    assert routed(x, w, t, softcap=30.0) == "liger"
    assert routed(x, w, t, reduction="none") == "liger"
    assert routed(x, w, t, return_token_accuracy=True) == "liger"
    assert routed(x, w.clone().requires_grad_(True), t) == "liger"  # a trainable head: not measured
    trainable = fusedce.route(_liger_like, trainable_head=True)  # LLMFT_LIGER_CROSS_ENTROPY=0
    assert torch.is_tensor(trainable(x, w.clone().requires_grad_(True), t))


def test_install_honours_switch(monkeypatch):
    monkeypatch.setenv(fusedce.LIGER_ENV, "1")
    assert fusedce.install() is False
