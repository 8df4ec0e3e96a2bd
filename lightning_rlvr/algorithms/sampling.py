"""DAPO's rollout-side rules (arXiv 2503.14476): dynamic sampling and overlong reward shaping.

- **Dynamic sampling** keeps only groups whose rewards are not all equal (a zero-std group has zero
  GRPO advantage everywhere and only dilutes the batch); the DataModule regenerates until enough
  groups are kept or a limit of generation rounds is reached.
- **Overlong reward shaping** adds a soft length penalty: with maximum length ``L_max`` and buffer
  ``L_cache``, ``R_len(y) = min(−(|y| − (L_max − L_cache)) / L_cache · penalty, 0)``, so 0 up to
  ``L_max − L_cache`` tokens and falling linearly to ``−penalty`` at ``L_max``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["informative_groups", "overlong_penalty"]


def informative_groups(rewards: Tensor, group_ids: Tensor, keep_singletons: bool = True) -> Tensor:
    """Boolean ``(N,)`` mask of completions whose group's rewards are not all equal.

    Args:
        rewards: ``(N,)`` rewards.
        group_ids: ``(N,)`` group id per completion.
        keep_singletons: keep groups of size 1 (verl's rule: they cannot be judged).
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n = counts.numel()
    r = rewards.float()
    big = torch.finfo(torch.float32).max
    gmax = torch.full((n,), -big, dtype=r.dtype, device=r.device).scatter_reduce(0, inverse, r, reduce="amax")
    gmin = torch.full((n,), big, dtype=r.dtype, device=r.device).scatter_reduce(0, inverse, r, reduce="amin")
    keep = gmax > gmin
    if keep_singletons:
        keep = keep | (counts.to(r.device) == 1)
    return keep[inverse]


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, penalty_factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong penalty per completion (≤ 0), to be added to the verifier reward.

    Args:
        lengths: ``(N,)`` response lengths in tokens.
        max_length: ``L_max``, the generation limit.
        buffer: ``L_cache``, the length of the linear-penalty zone before ``L_max``; 0 disables shaping.
        penalty_factor: the penalty at ``L_max``.
    """
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    if buffer > max_length:
        raise ValueError(f"overlong buffer ({buffer}) must not exceed max_length ({max_length})")
    expected = max_length - buffer
    return torch.clamp(-(lengths.float() - expected) / buffer * penalty_factor, max=0.0)
