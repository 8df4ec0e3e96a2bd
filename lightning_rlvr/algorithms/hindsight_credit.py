"""HAPO's pure pieces: entropy as hindsight-credit capacity, four quadrants, sign-preserving reallocation.

Hindsight-Aware Policy Optimization (He, Wu, Liu, …, Zhang; arXiv 2604.11056) bounds the credit a token can
carry by its entropy, ``I(o_t; R | o_{<t}) ≤ H(o_t | o_{<t})``, and separates token updates by reward polarity ×
entropy ("Four Quadrant Decomposition": gains concentrate in the signed high-entropy quadrants). The paper's
reallocation formula was not found (ALGORITHMS.md §13.5); this design is ours (§9.3). Within each response
``i`` the advantage is redistributed over its tokens in proportion to capacity, keeping its sign and its total:

.. math::
    m_{i,t} = (1 - λ) + λ \\frac{H_{i,t}}{\\bar H_i}, \\qquad A'_{i,t} = A_{i,t}\\, m_{i,t},

with ``H̄_i`` the response's mean (behaviour-policy) entropy. ``m ≥ 1 − λ > 0`` for ``λ < 1``, so no sign
flips, and ``mean_t m_{i,t} = 1``, so ``Σ_t A'_{i,t} = |o_i| A_i`` for a sequence-level advantage. A cap
``m ≤ m_max`` is applied by shrinking ``m − 1`` toward 0 by one factor per response, which keeps both
properties (unlike clipping then renormalising, which can re-exceed the cap).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["QUADRANTS", "capacity_multipliers", "entropy_quadrants"]

#: Quadrant names in the order of the ids :func:`entropy_quadrants` returns (reward sign, entropy level).
QUADRANTS = ("pos_high", "pos_low", "neg_high", "neg_low")


def capacity_multipliers(entropy: Tensor, mask: Tensor, strength: float = 0.5, max_multiplier: float = 3.0,
                         eps: float = 1e-8) -> Tensor:
    """Per-token multipliers ``m`` (module docstring) with mean 1 over each row's valid tokens; 0 off the mask.

    Args:
        entropy: ``(N, T)`` detached token entropy (the capacity).
        mask: ``(N, T)`` response mask.
        strength: ``λ ∈ [0, 1)``; 0 = GRPO (``m = 1``).
        max_multiplier: cap ``m_max > 1`` (``inf`` = none).
        eps: guards rows of zero entropy (their multipliers are 1).
    """
    if not 0 <= strength < 1:
        raise ValueError(f"capacity_multipliers: strength must be in [0, 1), got {strength}")
    if max_multiplier <= 1:
        raise ValueError(f"capacity_multipliers: max_multiplier must be > 1, got {max_multiplier}")
    mask = mask.to(entropy.dtype)
    row_mean = (entropy * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)
    relative = torch.where(row_mean > eps, entropy / row_mean.clamp_min(eps), torch.ones_like(entropy))
    excess = strength * (relative - 1) * mask  # m − 1, mean 0 per row
    peak = excess.amax(-1, keepdim=True)
    shrink = torch.where(peak > max_multiplier - 1, (max_multiplier - 1) / peak.clamp_min(eps), torch.ones_like(peak))
    return (1 + excess * shrink) * mask


def entropy_quadrants(advantages: Tensor, entropy: Tensor, threshold: float | Tensor) -> Tensor:
    """Quadrant id per token (index into :data:`QUADRANTS`); ``-1`` where the advantage is 0.

    High entropy means ``H ≥ threshold``.
    """
    high = entropy >= threshold
    ids = torch.where(advantages > 0, torch.where(high, 0, 1), torch.where(high, 2, 3))
    return torch.where(advantages == 0, torch.full_like(ids, -1), ids)
