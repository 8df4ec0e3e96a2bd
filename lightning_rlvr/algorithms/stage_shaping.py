"""Perplexity- and position-based advantage shaping of arXiv 2508.02260 (Deng et al., "Decomposing the
Entropy-Performance Exchange"), with the rules of the authors' released code (RUCAIBox/Slow_Thinking_with_LLMs
``entropy2performance/verl/trainer/ppo/core_algos.py``; ALGORITHMS.md §13.1).

Perplexity (``calculate_ppl`` + ``compute_policy_loss``): per response ``lnPPL_i = -mean_t log π_old(a_t)``;
per prompt group, the mean ``μ`` and *population* std ``σ`` of the log-perplexities that lie inside
Tukey's fences ``[Q1 - 1.5 IQR, Q3 + 1.5 IQR]`` (``σ := 1`` when ``σ ≤ 1e-6``); ``z_i = (lnPPL_i - μ)/σ``
for every response, outliers included; ``w_i = clip(1 ∓ α z_i, 0.8, 1.2)`` (``-`` favours low-PPL
responses, the paper's finding; ``+`` the code's "high-PPL" variant) and ``A'_{i,t} = w_i A_{i,t}``.
In the released code the low-PPL branch computes ``w`` but never multiplies it in (a no-op bug); here it
is applied, as intended.

Position (``add_loaction_bonus``): ``u_{i,t} = (cumsum_t m_{i,t} - 1)/|o_i|``,
``b_{i,t} = α σ(k (u_{i,t} - 0.5))`` and ``A'_{i,t} = A_{i,t} + sign(A_{i,t}) min(b_{i,t}, ½|A_{i,t}|)``:
late tokens of both signs get a larger magnitude, and the cap keeps every sign.

Both rules change the total advantage mass; :func:`rescale_to_mass` optionally puts it back per segment
(our option, not the authors').
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "group_iqr_zscores",
    "perplexity_weights",
    "position_bonus",
    "relative_positions",
    "rescale_to_mass",
    "response_log_perplexity",
]


def response_log_perplexity(logprobs: Tensor, mask: Tensor) -> Tensor:
    """``(N,)`` log-perplexity ``-Σ_t m_t log π(a_t) / Σ_t m_t`` of each response (0 for an empty one)."""
    mask = mask.to(logprobs.dtype)
    return -(logprobs * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)


def group_iqr_zscores(values: Tensor, group_ids: Tensor, iqr_factor: float = 1.5,
                      min_std: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Per-group z-scores against the mean and population std of the group's non-outliers.

    Inliers of a group are its values in ``[Q1 - f·IQR, Q3 + f·IQR]`` (linear-interpolated quartiles, as
    ``torch.quantile``); if none remain, all values are used. ``σ ≤ min_std`` is replaced by 1.

    Returns:
        ``(z, inlier)``: ``(N,)`` z-scores of every value and the ``(N,)`` bool inlier mask.
    """
    values = values.float()
    z = torch.zeros_like(values)
    inlier = torch.zeros_like(values, dtype=torch.bool)
    for group in torch.unique(group_ids):
        rows = group_ids == group
        v = values[rows]
        q1, q3 = torch.quantile(v, 0.25), torch.quantile(v, 0.75)
        spread = iqr_factor * (q3 - q1)
        keep = (v >= q1 - spread) & (v <= q3 + spread)
        if not keep.any():
            keep = torch.ones_like(keep)
        clean = v[keep]
        std = clean.std(unbiased=False) if clean.numel() > 1 else clean.new_zeros(())
        std = torch.where(std <= min_std, torch.ones_like(std), std)
        z[rows] = (v - clean.mean()) / std
        inlier[rows] = keep
    return z, inlier


def perplexity_weights(z: Tensor, alpha: float = 0.01, low: float = 0.8, high: float = 1.2,
                       favour: str = "low") -> Tensor:
    """``clip(1 - α z, low, high)`` (``favour="low"``: low-PPL responses amplified) or ``clip(1 + α z, …)``."""
    if favour not in ("low", "high"):
        raise ValueError(f"favour must be 'low' or 'high', got {favour!r}")
    sign = -1.0 if favour == "low" else 1.0
    return (1.0 + sign * alpha * z).clamp(low, high)


def relative_positions(mask: Tensor) -> Tensor:
    """``(N, T)`` relative position ``u = (cumsum(m) - 1)/|o|`` of each response token (0 off the mask)."""
    mask = mask.float()
    length = mask.sum(-1, keepdim=True).clamp_min(1.0)
    return ((mask.cumsum(-1) - 1.0).clamp_min(0.0) / length) * mask


def position_bonus(advantages: Tensor, mask: Tensor, alpha: float = 0.1, steepness: float = 15.0,
                   center: float = 0.5, cap: float = 0.5) -> Tensor:
    """The authors' additive, sign-preserving position bonus; returns the shaped ``(N, T)`` advantages.

    ``A' = A + sign(A) · min(α σ(k (u - center)), cap · |A|)`` on masked tokens (``A = 0`` stays 0).
    """
    u = relative_positions(mask)
    bonus = alpha * torch.sigmoid(steepness * (u - center))
    boost = torch.minimum(bonus, cap * advantages.abs())
    return advantages + torch.sign(advantages) * boost * (mask > 0)


def rescale_to_mass(shaped: Tensor, original: Tensor, mask: Tensor, segment_ids: Tensor) -> Tensor:
    """Scale ``shaped`` so that each segment's ``Σ_tokens |A|`` equals the original's.

    Args:
        shaped: ``(N, T)`` shaped advantages.
        original: ``(N, T)`` advantages before shaping.
        mask: ``(N, T)`` response mask.
        segment_ids: ``(N,)`` segment of each row (e.g. the row itself, or group × advantage sign).
            Segments whose shaped mass is 0 are left unchanged.
    """
    mask = mask.to(shaped.dtype)
    _, segment = torch.unique(segment_ids, return_inverse=True)
    n_segments = int(segment.max().item()) + 1 if segment.numel() else 0
    before = torch.zeros(n_segments, dtype=shaped.dtype, device=shaped.device)
    after = torch.zeros_like(before)
    before.index_add_(0, segment, (original.abs() * mask).sum(-1).to(shaped.dtype))
    after.index_add_(0, segment, (shaped.abs() * mask).sum(-1))
    factor = torch.where(after > 0, before / after.clamp_min(torch.finfo(shaped.dtype).tiny), torch.ones_like(after))
    return shaped * factor[segment].unsqueeze(-1)
