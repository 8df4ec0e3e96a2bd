"""The RLVR objective written from the equations (../shared/ALGORITHMS.md §1), sharing no code with lightning_rlvr.

Plain PyTorch over a Hugging Face model: its own forward and log-softmax gather, group advantages, the PPO
surrogate with clip-higher and dual clip, the KL estimators and the four loss aggregations. The objective tests
(tests/test_objective.py) compare the gradient a real training step applies with ``torch.autograd.grad`` of this.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def completion_logprobs(model, input_ids: Tensor, attention_mask: Tensor, prompt_length: int,
                        temperature: float) -> Tensor:
    """``log softmax(z / τ)`` of each completion token, from a full forward of prompt + completion.

    Prompts are left-padded, so positions count real tokens only (``cumsum(mask) - 1``).
    """
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits
    predicting = logits[:, prompt_length - 1 : -1] / temperature  # column P+t-1 predicts completion token t
    tokens = input_ids[:, prompt_length:]
    return torch.log_softmax(predicting, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def group_advantages(rewards: list[float], groups: list[int], mode: str, eps: float = 1e-6) -> list[float]:
    """GRPO ``(r − mean) / (std + ε)`` (unbiased std), Dr.GRPO ``r − mean``, RLOO ``r − mean of the others``;
    a group of one gets 0."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for rows in members.values():
        values = [rewards[i] for i in rows]
        n = len(values)
        if n == 1:
            continue
        mean = sum(values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        for i in rows:
            if mode == "grpo":
                out[i] = (rewards[i] - mean) / (std + eps)
            elif mode == "dr_grpo":
                out[i] = rewards[i] - mean
            else:  # rloo
                out[i] = rewards[i] - (sum(values) - rewards[i]) / (n - 1)
    return out


def ppo_surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float, clip_high: float,
                  dual_clip: float | None) -> Tensor:
    """Per-token ``max(−A r, −A clip(r, 1−ε_low, 1+ε_high))``; with dual clip ``min(·, −A c)`` where ``A < 0``."""
    ratio = torch.exp(logp - old_logp)
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high))
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    return loss


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """x = log π − log π_ref: k1 x, abs |x|, k2 x²/2, k3 e^{−x} + x − 1 (verl's ``low_var_kl``: −x clamped to
    [−20, 20], the value to [−10, 10]), k3+ the k3 value with the k2 gradient."""
    x = logp - ref_logp
    k2 = 0.5 * x * x
    log_ratio = (-x).clamp(-20, 20)
    k3 = (torch.exp(log_ratio) - log_ratio - 1).clamp(-10, 10)
    return {"k1": x, "abs": x.abs(), "k2": k2, "k3": k3, "k3+": k2 - k2.detach() + k3.detach()}[estimator]


def aggregate(loss: Tensor, mask: Tensor, mode: str, scale: float | None = None) -> Tensor:
    """The four modes over one whole minibatch (``scale``: the constant of ``seq-mean-token-sum-norm``,
    default the padded completion length)."""
    per_row = (loss * mask).sum(-1)
    lengths = mask.sum(-1)
    if mode == "token-mean":
        return per_row.sum() / lengths.sum()
    if mode == "seq-mean-token-sum":
        return per_row.sum() / (lengths > 0).sum()
    if mode == "seq-mean-token-mean":
        return (per_row / (lengths + 1e-8)).sum() / (lengths > 0).sum()
    constant = scale if scale is not None else mask.shape[1]
    return per_row.sum() / (mask.shape[0] * constant)
