"""Collectives for batch statistics that a method defines over the whole (multi-rank) batch.

Interventions such as Clip-Cov, KL-Cov and the top-entropy mask take means, top-k or random subsets
over "the batch's valid tokens". Under DDP / FSDP / DeepSpeed each rank holds only its shard, so these
helpers reduce over every rank; with a single process (or no process group) they are the identity.
Every rank must call them the same number of times, in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_max", "all_sum", "all_union", "gather_cat", "world_size"]


def world_size() -> int:
    """Number of ranks in the default process group (1 without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def all_union(names: set[str]) -> set[str]:
    """The union of every rank's set of names (the set itself without a process group)."""
    if world_size() == 1:
        return set(names)
    gathered: list[set[str] | None] = [None] * world_size()
    dist.all_gather_object(gathered, set(names))
    return set().union(*gathered)


def all_sum(value: Tensor) -> Tensor:
    """Sum of ``value`` over ranks (a new tensor; the input is not modified)."""
    if world_size() == 1:
        return value.clone()
    out = value.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_max(value: Tensor) -> Tensor:
    """Element-wise maximum of ``value`` over ranks (a new tensor); ``-all_max(-x)`` is the minimum."""
    out = value.clone()
    if world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def gather_cat(values: Tensor) -> tuple[Tensor, int]:
    """Concatenate a 1-D tensor of any length from every rank, in rank order.

    Returns:
        ``(all_values, offset)``: the concatenation and the position of this rank's first value in it,
        so that ``all_values[offset : offset + len(values)]`` is ``values``.
    """
    if values.dim() != 1:
        raise ValueError(f"gather_cat expects a 1-D tensor, got shape {tuple(values.shape)}")
    n_ranks = world_size()
    if n_ranks == 1:
        return values, 0
    length = torch.tensor([values.numel()], device=values.device, dtype=torch.long)
    lengths = [torch.zeros_like(length) for _ in range(n_ranks)]
    dist.all_gather(lengths, length)
    sizes = [int(n.item()) for n in lengths]
    # all_gather needs equal shapes: pad every shard to the longest, then trim.
    padded = values.new_zeros(max(sizes))
    padded[: values.numel()] = values
    shards = [torch.zeros_like(padded) for _ in range(n_ranks)]
    dist.all_gather(shards, padded)
    rank = dist.get_rank()
    return torch.cat([shard[:size] for shard, size in zip(shards, sizes)]), sum(sizes[:rank])
