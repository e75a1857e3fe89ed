"""Data parallelism over processes (``torchrun``, gloo on CPU, NCCL on GPUs): which micro-batches are this
rank's, and the sums that make a sharded training step the one-process step.

Every rank holds the step's whole batch of rollouts and computes the step's normalisers from it (the token
count, the margin weights, the number of rollouts, the size of the anchor), so the loss terms a rank computes
for its own micro-batches are exactly the one-process loss's terms for them. Summing the gradients over the
ranks (:func:`all_reduce_grads`) then gives every rank the one-process gradient, and the same optimizer step
keeps the replicas identical; β is updated from all-reduced statistics, so it is one β everywhere. Scalar
metrics that are sums are summed (:func:`all_sum`); per-rollout values are gathered in batch order
(:func:`gather_by_index`). The gradient all-reduce is written by hand rather than through the DDP wrapper:
the student and the teacher are views of one base model switched by adapters, which DDP's parameter
registration does not follow.

Without an initialised process group every function here is the identity: one process is world size 1.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch


def active() -> bool:
    """Whether a process group with more than one process is running."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without a process group."""
    if not active():
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def init_from_env(backend: str = "") -> bool:
    """Join the process group ``torchrun`` describes (``WORLD_SIZE`` > 1 in the environment); returns whether
    this is a multi-process run. gloo on CPU, NCCL with CUDA, unless ``backend`` says otherwise."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    return True


def barrier() -> None:
    """Wait for every process (a no-op in one)."""
    if active():
        import torch.distributed as dist

        dist.barrier()


def mine(n: int) -> list[int]:
    """The indices of ``n`` micro-batches this rank computes (round robin)."""
    rank, size = world()
    return list(range(rank, n, size))


def all_sum(value: float) -> float:
    """``value`` summed over the ranks (float64 on the wire)."""
    if not active():
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def all_reduce_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Sum every parameter's gradient over the ranks, in one flat buffer. A parameter no rank has a gradient
    for keeps none (so the optimizer skips it, as it would in one process); one that only some ranks have a
    gradient for gets zeros on the others first."""
    if not active():
        return
    import torch.distributed as dist

    params = [p for p in params if p.requires_grad]
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    live = [p for p, h in zip(params, has.tolist(), strict=True) if h]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not live:
        return
    flat = torch.cat([p.grad.reshape(-1).to(torch.float32) for p in live])
    dist.all_reduce(flat)
    offset = 0
    for p in live:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad).to(p.grad.dtype))
        offset += n


def gather_by_index(local: dict[int, Any]) -> dict[int, Any]:
    """Every rank's ``{index: value}`` merged (values are pickled: keep them small, e.g. CPU tensors)."""
    if not active():
        return dict(local)
    import torch.distributed as dist

    parts: list[dict[int, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dict(local))
    merged: dict[int, Any] = {}
    for part in parts:
        merged.update(part or {})
    return merged


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (one process: ``[obj]``)."""
    if not active():
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
