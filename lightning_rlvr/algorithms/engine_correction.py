"""Importance-sampling corrections for rollouts sampled by an engine that is not the trainer (vLLM).

The engine samples from ``π_engine``, which differs from the policy ``π_old`` the PPO ratio is taken against (other
kernels, other precision): without a correction the update is off-policy (Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"; Liu et al. 2025, "When speed kills stability"). Each token's
policy-gradient loss is weighted by a detached importance weight built from ``ρ_t = π_old(a_t) / π_engine(a_t)``:

- ``token_truncate`` (TIS): ``min(ρ_t, C)``;
- ``token_mask`` (masked IS): ``ρ_t · 1[1/C ≤ ρ_t ≤ C]``, tokens whose ratio is extreme are dropped;
- ``sequence_truncate``: ``min(ρ_i, C)`` for every token of response ``i``, ``ρ_i = Π_t ρ_t`` over its tokens;
- ``sequence_mask``: ``ρ_i · 1[1/C ≤ ρ_i ≤ C]``, whole responses dropped.

When to use which: token-level truncation (verl's and TRL's default) keeps every token and bounds the variance;
it is biased when ratios are large. The sequence ratio is the unbiased weight of a whole response, but its variance
grows with length (a product of per-token ratios), so it is capped or masked. Masking drops what is too far off
instead of keeping it at a capped weight: use it when the mismatch is occasional and large (a stale or partial weight
push, a numerically broken token), which a cap would let through with weight ``C``. verl (``rollout_is``,
``rollout_is_threshold`` with lower bound ``1/C``) and TRL (``vllm_importance_sampling_mode``) ship the same four.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

__all__ = ["ENGINE_IS_MODES", "EngineISMode", "engine_importance_weights"]

EngineISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
ENGINE_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@torch.no_grad()
def engine_importance_weights(old_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, cap: float,
                              mode: EngineISMode = "token_truncate") -> tuple[Tensor, Tensor]:
    """Per-token importance weights (detached) and the per-token flag of the tokens the cap or mask changed.

    Args:
        old_logprobs: ``(N, T)`` log-probs of the sampled tokens under the policy that the PPO ratio uses.
        engine_logprobs: ``(N, T)`` the engine's log-probs of the same tokens (at the same temperature).
        mask: ``(N, T)`` 1 on response tokens.
        cap: ``C > 1``: the truncation bound, and ``[1/C, C]`` the kept range of the mask modes.
        mode: one of :data:`ENGINE_IS_MODES` (module docstring).

    Returns:
        ``(weights, affected)``: ``weights`` ``(N, T)`` float32, 0 outside the mask; ``affected`` ``(N, T)`` bool,
        the tokens whose weight was capped (truncate) or dropped (mask) — for sequence modes every token of the
        sequence.

    Example::

        >>> old, engine, mask = torch.tensor([[0.0, -1.0]]), torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2)
        >>> engine_importance_weights(old, engine, mask, cap=2.0)[0]
        tensor([[2., 1.]])
    """
    if mode not in ENGINE_IS_MODES:
        raise ValueError(f"engine importance-sampling mode must be one of {ENGINE_IS_MODES}, got {mode!r}")
    if not cap > 1:
        raise ValueError(f"the importance-sampling cap must be > 1, got {cap}")
    mask = mask.float()
    valid = mask.bool()
    log_ratio = torch.where(valid, old_logprobs.float() - engine_logprobs.float(), 0.0)  # padding may hold anything
    if mode.startswith("sequence"):
        # log of the product of the token ratios, one per response, spread over its tokens
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)
    ratio = log_ratio.exp()
    if mode.endswith("truncate"):
        affected = ratio > cap
        weights = ratio.clamp(max=cap)
    else:
        affected = log_ratio.abs() > math.log(cap)  # compared in log space: a sequence ratio may overflow
        weights = ratio.masked_fill(affected, 0.0)
    return weights * mask, affected & valid
