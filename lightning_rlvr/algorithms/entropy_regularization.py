"""Adaptive entropy-coefficient controllers and difficulty weights (pure; the callback owns the state).

- Skywork-OR1 (He et al., arXiv 2505.22312; code ``EntController``): a sign controller,
  ``c ← clip(c + δ, c_min, c_max)`` when the measured entropy is below target, ``c − δ`` otherwise.
- AER (arXiv 2510.10959; formulas derived from the abstract, ALGORITHMS.md §7.2): a proportional
  controller ``α ← clip(α + η (H* − H), α_min, α_max)`` toward an initial-anchored target
  ``H* = ρ · H_0``, and per-prompt difficulty weights ``f_q = (1 − acc_q) / mean_{q'}(1 − acc_{q'})``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["difficulty_weights", "group_failure_rates", "proportional_controller_step", "sign_controller_step"]


def sign_controller_step(coef: float, measured: float, target: float, delta: float, low: float, high: float) -> float:
    """Skywork-OR1's update: ``clip(coef ± delta, low, high)``, up while ``measured < target``."""
    coef = coef + delta if measured < target else coef - delta
    return min(max(coef, low), high)


def proportional_controller_step(
    coef: float, measured: float, target: float, rate: float, low: float, high: float
) -> float:
    """AER-style update: ``clip(coef + rate · (target − measured), low, high)``."""
    return min(max(coef + rate * (target - measured), low), high)


def group_failure_rates(correct: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(1 − acc_q)`` per prompt group ``(G,)`` and each response's group index ``(N,)``."""
    group = torch.unique(group_ids, return_inverse=True)[1]
    n_groups = int(group.max().item()) + 1 if group.numel() else 0
    successes = torch.zeros(n_groups, dtype=torch.float32, device=correct.device).index_add_(0, group, correct.float())
    sizes = torch.bincount(group, minlength=n_groups).float()
    return 1.0 - successes / sizes.clamp_min(1.0), group


def difficulty_weights(correct: Tensor, group_ids: Tensor, mean_failure: float | None = None) -> Tensor:
    """Per-response weight ``f_q = (1 − acc_q) / mean_q(1 − acc_q)`` of its prompt ``q`` (``(N,)``).

    ``acc_q`` is the group's success rate. ``mean_failure`` is the mean of ``1 − acc_q`` over prompts
    (pass the all-rank value under DDP; default: over this batch's prompts). All-solved batches give 0.
    """
    failure, group = group_failure_rates(correct, group_ids)
    if mean_failure is None:
        mean_failure = failure.mean().item() if failure.numel() else 0.0
    if mean_failure <= 0:
        return torch.zeros_like(correct, dtype=torch.float32)
    return failure[group] / mean_failure
