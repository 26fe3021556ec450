"""Neat packing without the flash-attn package: torch's own FlashAttention varlen kernel.

LLaMA-Factory's `neat_packing` keeps packed samples from attending to each other. With
flash-attn installed it unpads to one sequence of bsz 1; without it (the usual case on our GPU
images) it expands a (batch, 1, seq, seq) mask for SDPA, which rules out SDPA's flash kernel,
computes the full square instead of each sample's triangle and builds the mask on the CPU.

torch >= 2.10 ships the FlashAttention varlen kernel itself (`torch.nn.attention.varlen`). The
collator below keeps LLaMA-Factory's packing, drops the padding and hands the model one row with
per-sample position ids and cumulative sequence lengths (transformers forwards these
`cu_seq_lens_*` keyword arguments down to the attention function); the attention function runs
the varlen kernel over that row.
On a CPU (tests) the same function loops over the samples with causal SDPA, so the wiring is
tested end to end there and the kernel on the GPU bench.
"""

from __future__ import annotations

import inspect
import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger("llmft.core.varlen")

NAME = "llmft_varlen"
IGNORE_INDEX = -100  # transformers' and LLaMA-Factory's ignored label
# The collator's count of a batch's real tokens, a host integer: the trainer's token count reads it
# instead of the GPU (count_tokens_on_host); the model never sees it.
TOKENS_KEY = "llmft_real_tokens"
# Set to 1: keep transformers' own count (a GPU read after every backward), so a benchmark can
# measure what counting on the host is worth in one call (bench/sft_bench.py fp8_lora_devcount_8b).
DEVICE_COUNT_ENV = "LLMFT_DEVICE_TOKEN_COUNT"
# A flattened row's length is padded to a multiple of this. Triton (Liger's kernels) specialises an
# integer argument divisible by 16: rows whose length is sometimes a multiple of 16 compiled each
# kernel again mid-run (pauses at a few steps of a job's first run; bench/README.md, SFT).
PAD_MULTIPLE = 16
# Set to a token count: every flattened row is padded to exactly that many tokens (rows holding more
# keep PAD_MULTIPLE), so compiled layers see one shape (bench/sft_bench.py's *_static_* variants).
PAD_TO_ENV = "LLMFT_VARLEN_PAD_TO"


def segments_to_varlen(segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(batch, seq) sample indices (1, 1, 2, 2, 2, 0 = padding) -> position ids, cu_seqlens, max length.

    Every run of equal indices, and every row start, begins a new sequence of the flattened batch;
    padding becomes a sequence of its own (its labels are ignored).
    """
    batch, seq = segments.shape
    flat = segments.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::seq] = True
    start_idx = torch.nonzero(starts).flatten()
    lengths = torch.diff(start_idx, append=torch.tensor([flat.numel()]))
    positions = torch.arange(flat.numel()) - torch.repeat_interleave(start_idx, lengths)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return positions.view(batch, seq), cu, int(lengths.max())


def flatten_packed(batch: dict, pad_id: int = 0, multiple: int = PAD_MULTIPLE) -> dict:
    """A collated neat-packing batch -> one row of its real tokens, for the varlen kernel.

    `batch["attention_mask"]` holds sample indices (0 = padding). Padding would cost as much compute
    as real tokens (~1-2 % of a packed micro-batch), so it is dropped: the rows are concatenated
    without it, each sample keeping its own position ids and sequence. The loss stays the same:
    a row's first token was never a target (the causal shift drops it); flattened it would become
    the target of the previous row's last token, so its label is set to be ignored. The row is then
    padded to a multiple of `multiple` tokens (`pad_id`, no targets, a sequence of their own).
    `attention_mask` becomes 1 on the real tokens and 0 on that padding: the trainer's
    `non_padding` token count sums it; the attention itself reads only the sequence boundaries.
    """
    segments = batch.pop("attention_mask")
    positions, cu, _ = segments_to_varlen(segments)
    rows, seq = segments.shape
    keep = segments.reshape(-1) != 0
    starts = cu[:-1].long()
    real = segments.reshape(-1)[starts] != 0  # a sequence is a run of one index: all padding or none
    lengths = torch.diff(cu.long())[real]
    real_tokens = int(keep.sum())
    pad_to = int(os.environ.get(PAD_TO_ENV) or 0)
    tail = pad_to - real_tokens if pad_to >= real_tokens else -real_tokens % max(1, multiple)
    if tail:
        lengths = torch.cat([lengths, torch.tensor([tail])])
    new_cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    new_cu[1:] = torch.cumsum(lengths, 0)
    labels = batch["labels"].clone()
    labels[torch.arange(rows), keep.view(rows, seq).int().argmax(1)] = IGNORE_INDEX
    batch["labels"] = labels
    fill = {"input_ids": pad_id, "labels": IGNORE_INDEX}
    for key, value in list(batch.items()):
        if isinstance(value, torch.Tensor) and value.shape == (rows, seq):
            flat = value.reshape(-1)[keep]
            pad = torch.full((tail,), fill.get(key, 0), dtype=value.dtype)
            batch[key] = torch.cat([flat, pad]).unsqueeze(0)
    batch["attention_mask"] = torch.cat([torch.ones(int(keep.sum()), dtype=torch.long),
                                         torch.zeros(tail, dtype=torch.long)]).unsqueeze(0)  # fmt: skip
    batch["position_ids"] = torch.cat([positions.reshape(-1)[keep], torch.arange(tail)]).unsqueeze(0)
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = new_cu
    batch["max_length_q"] = batch["max_length_k"] = int(lengths.max()) if lengths.numel() else 0
    return batch


def _varlen_kernel():
    """torch's public varlen attention and how to ask it for causal masking, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, params


def available() -> bool:
    """Whether the GPU kernel can run here (CUDA or ROCm build with the varlen op)."""
    return torch.cuda.is_available() and _varlen_kernel() is not None


def _reference(q, k, v, cu, scale):
    """Per-sequence causal SDPA: the same function as the kernel, for CPUs."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
    return out


def _kernel(q, k, v, cu, max_len, scale):
    varlen_attn, causal, params = _varlen_kernel()
    kwargs = dict(causal)
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-6:
        raise RuntimeError("this torch's varlen_attn has no scale argument and the model needs one")
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def kernel_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernel takes only fp16/bf16, and unlike SDPA it is not an autocast op: under autocast (plain
    DDP keeps fp32 weights) transformers' rotary embedding hands it fp32 q/k, so cast to the autocast
    dtype as SDPA would. A 16-bit model's tensors pass unchanged."""
    device = tensors[0].device.type
    if tensors[0].dtype in (torch.float16, torch.bfloat16) or not torch.is_autocast_enabled(device):
        return tensors
    half = torch.get_autocast_dtype(device)
    return tuple(t.to(half) for t in tensors)


def trainer_batch(batch: dict, pad_id: int = 0) -> dict:
    """flatten_packed, plus its real tokens as a host integer (TOKENS_KEY) for the trainer's count."""
    batch = flatten_packed(batch, pad_id=pad_id)
    batch[TOKENS_KEY] = int(batch["attention_mask"].sum())
    return batch


def _max_len(value):
    """The longest sample: an int from the collator (a SymInt under torch.compile, which int()
    would specialise, recompiling for every new length), or a tensor."""
    return int(value) if isinstance(value, torch.Tensor) else value


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention interface: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:  # not a packed batch (e.g. generation): plain SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    batch, heads, seq, dim = query.shape
    q = query.transpose(1, 2).reshape(batch * seq, heads, dim)
    k = key.transpose(1, 2).reshape(batch * seq, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(batch * seq, value.shape[1], dim)
    cu = cu.to(device=q.device, dtype=torch.int32)
    if q.is_cuda:
        q, k, v = kernel_dtype(q, k, v)
        out = _kernel(q, k, v, cu, _max_len(kwargs["max_length_q"]), scaling)
    else:
        out = _reference(q, k, v, cu, scaling)
    return out.view(batch, seq, heads, dim), None


def _no_mask(*args, **kwargs):
    """Sequence boundaries travel as cu_seq_lens; no mask tensor is built."""
    return None


def collator_class(base):
    """A subclass of LLaMA-Factory's SFT collator that emits varlen inputs for neat packing."""
    from llamafactory.data.collator import MultiModalDataCollatorForSeq2Seq

    class VarlenNeatPackingCollator(base):
        def __post_init__(self):
            super().__post_init__()
            self.varlen = bool(self.neat_packing and self.model is not None)
            if self.varlen:
                # The model is still unwrapped here: switching its attention reaches every layer.
                self.model.set_attn_implementation(NAME)
                self.block_diag_attn = False
                log.info("neat packing runs through %s (per-sample varlen attention)", NAME)

        def __call__(self, features):
            if not self.varlen:
                return super().__call__(features)
            batch = MultiModalDataCollatorForSeq2Seq.__call__(self, features)
            batch.pop("has_dummy_image", None)
            return trainer_batch(batch, pad_id=getattr(self.tokenizer, "pad_token_id", None) or 0)

    return VarlenNeatPackingCollator


def register() -> None:
    """Make NAME an attention implementation transformers models can switch to."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, _no_mask)


def count_tokens_on_host() -> None:
    """The trainer counts a batch's tokens from TOKENS_KEY, on the host, and drops the key before the
    model runs.

    transformers' own count (`Trainer._track_num_input_tokens`) sums the batch's mask on the GPU and
    reads it back with `.item()` after every backward pass. That waits for the GPU to finish, so
    nothing of the next step is queued meanwhile and the host's work between steps leaves the GPU
    idle (bench/README.md, FP8, 2026-12-04, 3895151: one of two such reads per step). Batches without the key
    (other collators) keep transformers' count."""
    from collections.abc import Mapping

    from llmft.core import hostcomm
    from transformers import Trainer

    if getattr(Trainer, "_llmft_host_tokens", False):
        return
    prepare, track = Trainer._prepare_inputs, Trainer._track_num_input_tokens

    def _prepare_inputs(self, inputs):
        if isinstance(inputs, Mapping) and TOKENS_KEY in inputs:
            inputs = {k: v for k, v in inputs.items() if k != TOKENS_KEY}
        return prepare(self, inputs)

    def _track_num_input_tokens(self, inputs):
        count = inputs.get(TOKENS_KEY) if isinstance(inputs, Mapping) else None
        if count is None or self.args.include_num_input_tokens_seen != "non_padding":
            return track(self, inputs)
        self.state.num_input_tokens_seen += hostcomm.total(int(count))

    Trainer._prepare_inputs = _prepare_inputs
    Trainer._track_num_input_tokens = _track_num_input_tokens
    Trainer._llmft_host_tokens = True


def install() -> None:
    """Register the attention function, swap LLaMA-Factory's SFT collator and count its tokens on
    the host (before run_exp)."""
    from llamafactory.train.sft import workflow

    register()
    if os.environ.get(DEVICE_COUNT_ENV) != "1":
        count_tokens_on_host()
    if not getattr(workflow.SFTDataCollatorWith4DAttentionMask, "_llmft_varlen", False):
        cls = collator_class(workflow.SFTDataCollatorWith4DAttentionMask)
        cls._llmft_varlen = True
        workflow.SFTDataCollatorWith4DAttentionMask = cls
