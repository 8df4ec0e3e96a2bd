"""Outcome advantages for group-sampled RLVR: GRPO, Dr.GRPO (no std normalisation) and RLOO.

All functions take one scalar reward per completion and an integer group id per completion (the
prompt it answers) and return one advantage per completion; the trainer broadcasts it to every
response token. Groups may have any size and need not be contiguous.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_mean_std", "grpo_advantages", "rloo_advantages"]


def group_mean_std(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-completion mean, unbiased std (N−1) and size of its group.

    The mean is taken as ``m + mean_G(r − m)`` with ``m`` the group's smallest reward: a group whose rewards are
    all equal then has a mean *exactly* equal to them (``r − m = 0`` in any precision), so its centred rewards, std
    and every advantage below are exactly 0 — ``sum / n`` in float32 is not (eight rewards of 1/3 would give each
    member ``+0.029`` after the std division). Measuring from a member also avoids cancellation for large rewards.

    A group of size 1 gets std 1 (and centred reward ``r − r = 0``), so its advantage is 0: this project's
    convention, as it is DAPO dynamic sampling's to keep singletons (verl instead gives a singleton mean 0, std 1,
    i.e. advantage ``r``).
    """
    rewards = rewards.float()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    # Explicit float32 throughout: under Lightning's bf16-true the default dtype is bfloat16 inside training_step.
    zeros = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device)
    lowest = torch.full_like(zeros, torch.inf).scatter_reduce(0, inverse, rewards, "amin")
    offsets = zeros.index_add(0, inverse, rewards - lowest[inverse])
    counts_f = counts.to(device=rewards.device, dtype=rewards.dtype)
    means = lowest + offsets / counts_f
    sq = zeros.index_add(0, inverse, (rewards - means[inverse]) ** 2)
    std = torch.where(counts_f > 1, (sq / (counts_f - 1).clamp_min(1)).sqrt(), torch.ones_like(means))
    return means[inverse], std[inverse], counts_f[inverse]


def grpo_advantages(rewards: Tensor, group_ids: Tensor, normalize_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantage ``A_i = (r_i − mean_G r) / (std_G r + ε)``.

    With ``normalize_by_std=False`` this is Dr.GRPO's ``A_i = r_i − mean_G r`` (arXiv 2503.20783), which
    removes the question-difficulty bias of the std division.

    Args:
        rewards: ``(N,)`` scalar reward per completion.
        group_ids: ``(N,)`` integer id of the prompt each completion answers.
        normalize_by_std: divide by the unbiased group std (GRPO, arXiv 2402.03300) or not (Dr.GRPO).
        eps: added to the std (verl default 1e-6).
    """
    mean, std, _ = group_mean_std(rewards, group_ids)
    centered = rewards.float() - mean
    return centered / (std + eps) if normalize_by_std else centered


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """REINFORCE leave-one-out: ``A_i = r_i − mean_{j≠i} r_j = G/(G−1) · (r_i − mean_G r)``.

    Singleton groups get advantage 0 (there is no baseline to leave one out of).
    (Ahmadian et al. 2024, arXiv 2402.14740; Kool et al. 2019.)
    """
    mean, _, count = group_mean_std(rewards, group_ids)
    scale = torch.where(count > 1, count / (count - 1).clamp_min(1), torch.zeros_like(count))
    return scale * (rewards.float() - mean)
