"""Token covariance of log-probability and advantage, and the Clip-Cov / KL-Cov token selections.

Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"
(arXiv 2505.22617), Eq. 10: over the N valid tokens of a batch,

.. math::
    \\mathrm{Cov}_t = \\big(\\log\\pi(y_t) - \\tfrac1N\\textstyle\\sum_j \\log\\pi(y_j)\\big)
                     \\big(A_t - \\tfrac1N\\textstyle\\sum_j A_j\\big),

whose expectation is the covariance that drives entropy down (their Theorem 2). Tokens with a large
positive covariance (confident tokens with positive advantage, unlikely ones with negative) are the
ones whose update lowers entropy most. Semantics follow the reference code
(PRIME-RL/Entropy-Mechanism-of-RL, ``compute_policy_loss_clip_cov`` / ``compute_policy_loss_kl_cov``).
All inputs are 1-D vectors of the batch's valid tokens (see :mod:`lightning_rlvr.algorithms.selection`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_rlvr.algorithms.selection import random_subset_mask, top_k_mask

__all__ = ["clip_cov_selection", "kl_cov_selection", "token_covariance"]


def token_covariance(logprobs: Tensor, advantages: Tensor) -> Tensor:
    """Per-token centred product ``(logπ − mean logπ)(A − mean A)`` over 1-D valid-token vectors."""
    if logprobs.numel() == 0:
        return logprobs.new_zeros(0)
    return (logprobs - logprobs.mean()) * (advantages - advantages.mean())


def clip_cov_selection(
    covariance: Tensor,
    eligible: Tensor,
    ratio: float,
    lower: float,
    upper: float,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Clip-Cov: which tokens lose their policy-gradient term.

    ``n = max(⌊ratio · N⌋, 1)`` tokens are drawn uniformly at random (not the top-n) among the tokens with
    ``lower < Cov < upper`` (strict) that are ``eligible`` (the reference excludes tokens the PPO clip
    already cut off). Selected tokens keep their place in the loss denominator.

    Args:
        covariance: ``(N,)`` per-token covariance of the valid tokens.
        eligible: ``(N,)`` bool; ``False`` for tokens already clipped by PPO.
        ratio: fraction of valid tokens to detach (reference default 2e-4).
        lower: ω_low (reference 1.0).
        upper: ω_high (reference 5.0).
        generator: CPU generator of the random draw.
    """
    n_clip = max(int(ratio * covariance.numel()), 1)
    candidates = eligible & (covariance > lower) & (covariance < upper)
    return random_subset_mask(candidates, n_clip, generator)


def kl_cov_selection(covariance: Tensor, ratio: float) -> Tensor:
    """KL-Cov: the ``k = max(1, ⌊ratio · N⌋)`` tokens with the largest covariance (ties: earlier token)."""
    if covariance.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=covariance.device)
    return top_k_mask(covariance, max(1, int(covariance.numel() * ratio)))
