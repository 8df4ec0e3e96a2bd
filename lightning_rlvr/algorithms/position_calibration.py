"""PAEC's pure pieces: the decision-sensitivity soft mask and the anchored entropy floor (arXiv 2606.08543).

Position-Aware Entropy Calibration (Yang, Liu, Zheng, Yang, Li; ALGORITHMS.md §9.1 with the corrections of
§13.4) keeps entropy from collapsing only at *decision-sensitive* positions — where the local nucleus is
spread out (high top-p entropy ``H^{top}``) and the two best candidates compete (small top-two log-prob gap
``Δ``) — by a one-sided quadratic penalty below a floor anchored to the early-training entropy:

.. math::
    g_t = σ\\Big(\\frac{H^{top}_t - τ_H}{T_H}\\Big)\\, σ\\Big(\\frac{τ_Δ - Δ_t}{T_Δ}\\Big), \\qquad
    \\bar H = \\frac{\\sum_t g_t H_t}{\\sum_t g_t}, \\qquad
    L = λ \\max(0,\\ ρ_{min} H_0 - \\bar H)^2 ,

with ``τ_H`` the batch ``ρ``-quantile of ``H^{top}`` and ``τ_Δ`` the batch ``(1 − ρ)``-quantile of ``Δ``
(``ρ = 0.8``: the top 20 % most uncertain positions, the paper's mask quantile), ``H_t`` the full-vocabulary
entropy (with gradient), ``H_0`` the mean of ``H̄`` over the first ``K = 4`` steps. The mask function
(product of two sigmoids) and its temperatures are ours: the paper's exact form was not found (§13.4).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["decision_sensitivity_mask", "entropy_floor_penalty"]


def decision_sensitivity_mask(nucleus_entropy: Tensor, top2_gap: Tensor, entropy_threshold: float | Tensor,
                              gap_threshold: float | Tensor, entropy_temperature: float = 0.1,
                              gap_temperature: float = 0.5) -> Tensor:
    """Soft mask ``g_t ∈ (0, 1)``: high where the nucleus entropy is above and the top-two gap below its threshold.

    Args:
        nucleus_entropy: ``H^{top}_t`` (nats).
        top2_gap: ``Δ_t = log p_(1) − log p_(2)`` (nats).
        entropy_threshold: ``τ_H``.
        gap_threshold: ``τ_Δ``.
        entropy_temperature: ``T_H > 0`` (nats); smaller = a harder mask.
        gap_temperature: ``T_Δ > 0`` (nats).
    """
    if entropy_temperature <= 0 or gap_temperature <= 0:
        raise ValueError("decision_sensitivity_mask: temperatures must be > 0")
    high_entropy = torch.sigmoid((nucleus_entropy - entropy_threshold) / entropy_temperature)
    competing = torch.sigmoid((gap_threshold - top2_gap) / gap_temperature)
    return high_entropy * competing


def entropy_floor_penalty(selected_entropy: Tensor, floor: float | Tensor) -> Tensor:
    """One-sided quadratic ``max(0, floor − H̄)²``: zero at and above the floor, differentiable in ``H̄``."""
    return torch.relu(floor - selected_entropy).square()
