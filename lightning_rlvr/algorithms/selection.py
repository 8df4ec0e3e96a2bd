"""Deterministic token selection over a flat vector of valid tokens: top-k with stable ties, random subsets.

Interventions flatten the valid tokens of a (micro-)batch in row-major order (the order of
``torch.nonzero`` on the ``(B, T)`` mask) and select among them. Ties in top-k go to the token that
comes first in that order, so a selection is reproducible and the same on every rank.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["lower_quantile", "random_subset_mask", "top_fraction_mask", "top_k_mask"]


def top_k_mask(values: Tensor, k: int) -> Tensor:
    """Boolean mask of the ``k`` largest entries of a 1-D ``values``; ties broken by lower index.

    ``k`` is clipped to ``[0, len(values)]``.
    """
    if values.dim() != 1:
        raise ValueError(f"top_k_mask expects a 1-D tensor, got shape {tuple(values.shape)}")
    k = max(0, min(int(k), values.numel()))
    selected = torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    if k:
        order = torch.sort(values, descending=True, stable=True).indices
        selected[order[:k]] = True
    return selected


def top_fraction_mask(values: Tensor, fraction: float) -> Tensor:
    """The top ``k = max(1, ⌈fraction · N⌉)`` entries of a 1-D ``values`` (none when ``N = 0``).

    This is the 80/20 rule's selection (Wang et al., arXiv 2506.01939, ``get_global_entropy_top_mask``).
    """
    if values.numel() == 0:
        return torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    return top_k_mask(values, max(1, math.ceil(fraction * values.numel())))


def random_subset_mask(candidates: Tensor, n: int, generator: torch.Generator | None = None) -> Tensor:
    """Boolean mask of ``min(n, #candidates)`` entries drawn uniformly without replacement among ``candidates``.

    The draw is ``torch.randperm(#candidates)[:n]`` indexing the candidates in order, which is the
    procedure of the Clip-Cov reference code (``torch.nonzero`` then ``randperm``). ``generator`` is a
    CPU generator (the permutation is drawn on CPU, as in the reference, and moved to the data's device).
    """
    if candidates.dim() != 1:
        raise ValueError(f"random_subset_mask expects a 1-D tensor, got shape {tuple(candidates.shape)}")
    positions = torch.nonzero(candidates).squeeze(-1)
    selected = torch.zeros(candidates.shape, dtype=torch.bool, device=candidates.device)
    if positions.numel() and n > 0:
        perm = torch.randperm(positions.numel(), generator=generator).to(positions.device)
        selected[positions[perm[: min(int(n), positions.numel())]]] = True
    return selected


def lower_quantile(values: Tensor, q: float) -> Tensor:
    """The lower order statistic at ``q`` of a non-empty 1-D ``values``: its ``⌊q (N − 1)⌋ + 1``-th smallest.

    ``torch.quantile(..., interpolation="lower")`` computed with ``kthvalue``: ``torch.quantile`` refuses
    inputs over 16M elements (all valid tokens of a long-response batch).
    """
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"lower_quantile expects a non-empty 1-D tensor, got shape {tuple(values.shape)}")
    if not 0 <= q <= 1:
        raise ValueError(f"lower_quantile: q must be in [0, 1], got {q}")
    return torch.kthvalue(values, int(q * (values.numel() - 1)) + 1).values
