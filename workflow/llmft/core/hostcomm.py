"""Small collectives on the host: a CPU (gloo) process group beside the training's NCCL / RCCL one.

A per-step check that all-reduces a GPU tensor and reads it back (`.item()`) waits for every kernel
queued before it: the GPU's queue drains, and whatever the host does next (the trainer's Python
between steps, the next forward's launches) is GPU idle time. Integers the host already knows
(a stop request, a batch's token count) are summed or maxed here instead, on CPU tensors, without
touching the GPU. With no process group, or one process, each function returns its own value.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_GROUP = None


def _world() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def _reduce(value: int, op) -> int:
    global _GROUP
    if _GROUP is None:  # every rank reaches its first call at the same step: a collective
        _GROUP = dist.new_group(backend="gloo")
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=op, group=_GROUP)
    return int(t.item())


def total(value: int) -> int:
    """The sum of `value` over every rank."""
    return value if _world() == 1 else _reduce(value, dist.ReduceOp.SUM)


def any_rank(flag: bool) -> bool:
    """True where `flag` is true on any rank."""
    return flag if _world() == 1 else bool(_reduce(int(flag), dist.ReduceOp.MAX))
