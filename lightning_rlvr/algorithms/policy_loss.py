"""PPO clipped surrogate with decoupled clip range (clip-higher) and dual-clip, per token.

.. math::
    r_t = \\exp(\\log\\pi_\\theta - \\log\\pi_{old}), \\quad
    L_t = \\max\\big(-A_t r_t,\\; -A_t\\,\\mathrm{clip}(r_t, 1-ε_{low}, 1+ε_{high})\\big)

and, with dual-clip constant ``c > 1`` (Ye et al. 2020, arXiv 1912.09729), for ``A_t < 0``:
``L_t = min(L_t, −c·A_t)``. Clip-higher (``ε_high > ε_low``) is DAPO's (arXiv 2503.14476).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PolicyLossOutput", "ppo_clip_loss"]


@dataclass
class PolicyLossOutput:
    """Per-token loss and boolean indicators of which clip is active (all ``(B, T)``)."""

    loss: Tensor
    ratio: Tensor
    clipped_high: Tensor  # A > 0 and r > 1 + ε_high: the gradient is cut off
    clipped_low: Tensor  # A < 0 and r < 1 − ε_low
    dual_clipped: Tensor  # A < 0 and −c·A < the clipped loss (dual clip active)


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> PolicyLossOutput:
    """Per-token PPO clipped policy-gradient loss (to be aggregated with a mask).

    Args:
        logprobs: ``(B, T)`` current log-probs (with gradient).
        old_logprobs: ``(B, T)`` behaviour-policy log-probs (detached).
        advantages: ``(B, T)`` advantages (detached).
        clip_low: ε_low; the ratio is clipped below at ``1 − clip_low``.
        clip_high: ε_high; clipped above at ``1 + clip_high`` (0.28 in DAPO).
        dual_clip: constant ``c > 1`` bounding the loss of negative-advantage tokens, or ``None``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    # The log-ratio is clamped as in verl so a stale token cannot overflow exp().
    log_ratio = torch.clamp(logprobs - old_logprobs, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clipped_high = (advantages > 0) & (ratio > 1.0 + clip_high)
        clipped_low = (advantages < 0) & (ratio < 1.0 - clip_low)
    dual_clipped = torch.zeros_like(clipped_high)
    if dual_clip is not None:
        dual_bound = -advantages * dual_clip
        with torch.no_grad():
            dual_clipped = (advantages < 0) & (dual_bound < loss)
        loss = torch.where(advantages < 0, torch.minimum(loss, dual_bound), loss)
    return PolicyLossOutput(loss, ratio.detach(), clipped_high, clipped_low, dual_clipped)
