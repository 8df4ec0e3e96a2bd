"""GTPO: token-level reward shaping with policy entropy (Tan et al., arXiv 2508.04349, "Dynamic Entropy Weighting").

Within a group, O⁺ are the responses with reward ``r_i > threshold`` and O⁻ the others. At position
``t`` let ``d_t`` (``h_t``) count the O⁺ (O⁻) responses still active (``mask[i, t] = 1``). With the old
policy's token entropy ``H_{i,t}`` (detached):

.. math::
    \\tilde r^+_{i,t} = α_1 r_i + α_2 \\frac{H_{i,t}}{\\sum_{k∈O^+_t} H_{k,t}}\\, d_t, \\qquad
    \\tilde r^-_{j,t} = -α_1 - α_2 \\frac{1/H_{j,t}}{\\sum_{k∈O^-_t} 1/H_{k,t}}\\, h_t .

Correct responses are rewarded more at their high-entropy ("forking") tokens; wrong responses are
penalised hardest at their *confident* tokens. Entropies get ``+eps`` so that shares stay defined when
every entropy at a position is 0 (they become equal shares). With ``α_1 + α_2 = 1`` the shaped rewards
at each position sum to ``d_t`` over O⁺ and ``−h_t`` over O⁻ (the paper's reward conservation).

The equations are reconstructed from two third-party reimplementations (no official code; see
ALGORITHMS.md §8). They normalise O⁺ and O⁻ tokens *separately* (``normalization="polarity"``), which
removes the sign that tells correct from wrong; the default here, ``"group"``, normalises all of a
group's tokens together (GRPO's baseline, applied to the shaped token rewards) and keeps that sign.
Groups without both an O⁺ and an O⁻ response get zero advantage, as in GRPO (our choice).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["GTPONormalization", "gtpo_advantages", "gtpo_token_rewards"]

GTPONormalization = Literal["group", "polarity"]


def _per_group_sum(values: Tensor, group: Tensor, n_groups: int) -> Tensor:
    """``out[g, t] = Σ_{i: group[i] = g} values[i, t]``."""
    return values.new_zeros((n_groups,) + values.shape[1:]).index_add_(0, group, values)


def gtpo_token_rewards(
    rewards: Tensor,
    entropy: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    alpha_outcome: float = 1.0,
    alpha_entropy: float = 0.1,
    threshold: float = 0.5,
    eps: float = 1e-6,
) -> Tensor:
    """Shaped per-token rewards ``(N, T)`` (0 on padding).

    Args:
        rewards: ``(N,)`` outcome rewards.
        entropy: ``(N, T)`` old-policy token entropy.
        mask: ``(N, T)`` valid response tokens.
        group_ids: ``(N,)`` prompt group of each response.
        alpha_outcome: α₁.
        alpha_entropy: α₂.
        threshold: a response is in O⁺ when its reward is above this.
        eps: added to entropies before shares and inverses.
    """
    mask = mask.float()
    group = torch.unique(group_ids, return_inverse=True)[1]
    n_groups = int(group.max().item()) + 1 if group.numel() else 0
    positive = (rewards > threshold).float().unsqueeze(-1)
    h = entropy.float() + eps

    pos_mask = mask * positive
    pos_weight = pos_mask * h
    pos_share = pos_weight / _per_group_sum(pos_weight, group, n_groups)[group].clamp_min(1e-30)
    pos_count = _per_group_sum(pos_mask, group, n_groups)[group]
    shaped_pos = alpha_outcome * rewards.float().unsqueeze(-1) + alpha_entropy * pos_share * pos_count

    neg_mask = mask * (1.0 - positive)
    neg_weight = neg_mask / h
    neg_share = neg_weight / _per_group_sum(neg_weight, group, n_groups)[group].clamp_min(1e-30)
    neg_count = _per_group_sum(neg_mask, group, n_groups)[group]
    shaped_neg = -alpha_outcome - alpha_entropy * neg_share * neg_count

    return torch.where(positive.bool(), shaped_pos, shaped_neg) * mask


def gtpo_advantages(
    shaped: Tensor,
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    threshold: float = 0.5,
    normalization: GTPONormalization = "group",
    eps: float = 1e-6,
) -> Tensor:
    """Token advantages ``(N, T)`` from shaped rewards: ``(r̃ − mean) / (std + eps)`` per normalisation set.

    The mean and (population) std are over the valid tokens of the set: the whole group
    (``"group"``) or the group's O⁺ / O⁻ tokens separately (``"polarity"``).
    """
    if normalization not in ("group", "polarity"):
        raise ValueError(f"GTPO normalization must be 'group' or 'polarity', got {normalization!r}")
    mask = mask.float()
    group = torch.unique(group_ids, return_inverse=True)[1]
    positive = (rewards > threshold).long()
    n_groups = int(group.max().item()) + 1 if group.numel() else 0
    key = group * 2 + positive if normalization == "polarity" else group
    n_sets = 2 * n_groups if normalization == "polarity" else n_groups

    def per_set(values: Tensor) -> Tensor:  # Σ over the set's valid tokens, broadcast back to tokens
        return _per_group_sum((values * mask).sum(-1), key, n_sets)[key].unsqueeze(-1)

    count = per_set(torch.ones_like(shaped)).clamp_min(1.0)
    mean = per_set(shaped) / count
    std = (per_set((shaped - mean) ** 2) / count).sqrt()
    advantages = (shaped - mean) / (std + eps) * mask

    n_pos = _per_group_sum(positive.float(), group, n_groups)
    n_all = _per_group_sum(torch.ones_like(rewards, dtype=torch.float32), group, n_groups)
    contrast = ((n_pos > 0) & (n_pos < n_all))[group].unsqueeze(-1)
    return advantages * contrast
