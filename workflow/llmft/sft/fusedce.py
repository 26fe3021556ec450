"""The output head and cross-entropy in chunks of rows, without reading anything back to the host.

Liger's fused linear + cross-entropy (liger-kernel 0.8) never materialises the whole batch's logits:
it computes them a chunk of rows at a time and works the loss's gradient out in the forward. Before
its first chunk it counts the batch's non-ignored targets with `.item()`, a host read that waits for
the GPU to finish the whole forward. Nothing of the backward is queued while the host waits, so the
host's own launch work after it (about 4 ms of host time per decoder layer in a compiled LoRA 8 B
step) is no longer hidden behind GPU work: bench/README.md, "Why the GPU waits".

`fused_linear_cross_entropy` is the same computation with the count kept on the GPU: a "sum" loss
needs no count at all (the trainer divides by its own `num_items_in_batch`), a "mean" loss divides by
a GPU tensor. Per chunk: one GEMM for the logits, one compiled kernel for the row losses and the
logits' gradient (softmax minus the one-hot target, zero on ignored rows), one GEMM for the input's
gradient and, when the head trains, one for the weight's. `install()` routes Liger's functional entry
through it for the calls it covers (a frozen head; no label smoothing, z-loss, soft-capping, class
weights or extra outputs) and leaves every other call to Liger. LLMFT_LIGER_CROSS_ENTROPY=1 keeps
Liger's own.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os

import torch

log = logging.getLogger("llmft.sft.fusedce")

# "1": Liger's own fused loss everywhere (with its host read); "0": llmft's for a trainable head too
# (full fine-tuning, not yet measured on a GPU: the bench's fp8_full_fusedce_1b); unset: frozen heads
LIGER_ENV = "LLMFT_LIGER_CROSS_ENTROPY"


def chunk_rows(rows: int, hidden: int, vocab: int) -> int:
    """Rows per chunk: a chunk's logits hold about as many elements as the whole batch's hidden
    states (rows x hidden), rounded to a power of two and never more than the batch."""
    want = max(1, math.ceil(rows * hidden / vocab))
    return min(rows, 1 << (want - 1).bit_length())


def _rows_loss_and_grad(logits: torch.Tensor, target: torch.Tensor, ignore_index: int):
    """Per row: the cross-entropy (0 on ignored rows) and d(loss)/d(logits) in the logits' dtype."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 for bf16 logits
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(1, safe.unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse))
    onehot = torch.arange(z.shape[1], device=z.device).unsqueeze(0) == safe.unsqueeze(1)
    grad = (torch.exp(z - lse.unsqueeze(1)) - onehot.to(z.dtype)) * valid.unsqueeze(1).to(z.dtype)
    return loss, grad.to(logits.dtype)


@functools.cache
def _compiled():
    # One kernel for the row reduction and one for the gradient; dynamic in the chunk's row count
    return torch.compile(_rows_loss_and_grad, dynamic=True)


def _kernel(device: torch.device):
    return _compiled() if device.type in ("cuda", "xpu") else _rows_loss_and_grad


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, bias, ignore_index, reduction, accum_dtype, rows_per_chunk):
        rows = x.shape[0]
        x = x.contiguous()
        target = target.reshape(-1).to(x.device)
        step = rows_per_chunk or chunk_rows(rows, x.shape[1], weight.shape[0])
        kernel = _kernel(x.device)
        need_x, need_w, _, need_b = ctx.needs_input_grad[:4]
        grad_x = torch.empty_like(x) if need_x else None
        w_dtype = accum_dtype or weight.dtype
        grad_w = torch.zeros_like(weight, dtype=w_dtype) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=w_dtype) if need_b else None
        w_for_x = None  # the weight in the logits' dtype, cast once (a copy only under autocast)
        loss_rows = torch.empty(rows, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        for start in range(0, rows, step):
            end = min(rows, start + step)
            x_c = x[start:end]
            logits = x_c @ weight.t()
            if bias is not None:
                logits = logits + bias
            loss_rows[start:end], grad_logits = kernel(logits, target[start:end], ignore_index)
            del logits
            if grad_x is not None:
                if w_for_x is None:
                    w_for_x = weight.to(grad_logits.dtype)
                if grad_x.dtype == grad_logits.dtype:
                    torch.mm(grad_logits, w_for_x, out=grad_x[start:end])
                else:  # float32 inputs under bf16 autocast: bf16 logits, float32 gradient
                    grad_x[start:end] = grad_logits @ w_for_x
            if grad_w is not None:
                grad_w.addmm_(grad_logits.t().to(w_dtype), x_c.to(w_dtype))
            if grad_b is not None:
                grad_b.add_(grad_logits.sum(0).to(w_dtype))
        loss = loss_rows.sum()
        grads = [g for g in (grad_x, grad_w, grad_b) if g is not None]
        if reduction == "mean":
            count = (target != ignore_index).sum().clamp(min=1)  # stays on the GPU
            loss = loss / count
            for grad in grads:
                grad.div_(count)
        ctx.save_for_backward(*grads)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
        saved = iter(ctx.saved_tensors)
        out = []
        for need, dtype in zip(needs, ctx.dtypes, strict=True):
            if not need:
                out.append(None)
                continue
            # a multiply, not a test of grad_output == 1: comparing would read the GPU again
            grad = next(saved)
            out.append(grad.mul_(grad_output.to(grad.dtype)).to(dtype))
        return out[0], out[1], None, out[2], None, None, None, None


def fused_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    accum_dtype: torch.dtype | None = None,
    rows_per_chunk: int | None = None,
) -> torch.Tensor:
    """cross_entropy(x @ weight.T + bias, target) without the full logits and without a host read.

    x: (rows, hidden); weight: (vocab, hidden); target: (rows,) with ignore_index on rows that do
    not count. reduction "sum" or "mean" (over the counted rows; 0 when none counts)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    return _FusedLinearCrossEntropy.apply(
        x, weight, target, bias, ignore_index, reduction, accum_dtype, rows_per_chunk
    )


# Liger's arguments this module covers, at the value that means "off"
_OFF = {
    "ce_weight": None,
    "lse_square_scale": 0.0,
    "label_smoothing": 0.0,
    "softcap": None,
    "return_z_loss": False,
    "use_token_scaling": False,
    "return_token_accuracy": False,
    "return_predicted_tokens": False,
}


def covers(arguments: dict, trainable_head: bool = False) -> bool:
    """Whether a call with Liger's ARGUMENTS (bound, defaults applied) is one this module computes.

    A frozen output head (LoRA, freeze), where it was measured on a GPU; a trainable one (full
    fine-tuning) only with TRAINABLE_HEAD, until a benchmark has compared the two there."""
    if arguments.get("reduction") not in ("mean", "sum"):
        return False
    if getattr(arguments.get("weight"), "requires_grad", False) and not trainable_head:
        return False
    return all(arguments.get(name, off) == off for name, off in _OFF.items())


def route(liger_fn, trainable_head: bool = False):
    """LIGER_FN (Liger's `liger_fused_linear_cross_entropy`) with the calls `covers` accepts sent to
    `fused_linear_cross_entropy`; the signature is Liger's, which its callers inspect."""
    signature = inspect.signature(liger_fn)

    @functools.wraps(liger_fn)
    def routed(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if not covers(a, trainable_head):
            return liger_fn(*args, **kwargs)
        return fused_linear_cross_entropy(
            a["input"],
            a["weight"],
            a["target"],
            a.get("bias"),
            a["ignore_index"],
            a["reduction"],
            a.get("accum_dtype"),
        )

    routed._llmft_fusedce = True
    return routed


def install() -> bool:
    """Send Liger's fused loss through this module (before the first step); False when Liger is
    absent or LLMFT_LIGER_CROSS_ENTROPY=1 keeps its own."""
    if os.environ.get(LIGER_ENV) == "1":
        log.info("%s=1: Liger's own fused linear + cross-entropy (with its host read)", LIGER_ENV)
        return False
    try:
        import liger_kernel.transformers.functional as functional
    except ImportError:
        return False
    trainable = os.environ.get(LIGER_ENV) == "0"
    if not getattr(functional.liger_fused_linear_cross_entropy, "_llmft_fusedce", False):
        functional.liger_fused_linear_cross_entropy = route(
            functional.liger_fused_linear_cross_entropy, trainable
        )
    log.info(
        "fused linear + cross-entropy: llmft.sft.fusedce for a %s head (no host read of the target count)",
        "frozen or trainable" if trainable else "frozen",
    )
    return True
