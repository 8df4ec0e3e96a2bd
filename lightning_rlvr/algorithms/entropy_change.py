"""First-order entropy change of a policy-gradient update, and STEER's token weights (arXiv 2510.10150).

Softmax ``π = softmax(z)`` with entropy ``H``: since ``∂π_k/∂z_j = π_k(δ_kj − π_j)``,

.. math::
    \\frac{\\partial H}{\\partial z_j} = -\\pi_j(\\log\\pi_j + H), \\qquad
    \\Delta H \\approx -\\sum_j \\pi_j (\\log\\pi_j + H)\\, \\Delta z_j = -\\mathrm{Cov}_{j\\sim\\pi}(\\log\\pi_j, \\Delta z_j)

(ALGORITHMS.md §2.1; the covariance form is 2505.22617's lemma). One RLVR token — sampled token ``a``,
advantage ``A``, ratio ``r`` — ascends ``A·r·log π(a)``, whose logit gradient is ``A r (e_a − π)``; a step
``η`` on that position's logits therefore changes its entropy by

.. math::
    \\Delta H_t \\approx -\\eta A r \\big(S(a) - \\bar S\\big), \\quad S(j) = \\pi_j(\\log\\pi_j + H), \\quad
    \\bar S = \\sum_j \\pi_j S(j)                                                                  \\tag{E3}

(§2.2; arXiv 2602.03392 Thm 3.3 states the same). ``c_t = −A r (S(a) − S̄)`` is the token's predicted
entropy flow in units of ``η``; it is zero where the PPO clip cuts the gradient. The shortcut "only ``z_a``
moves" gives ``−η A r π_a (1 − π_a)(log π_a + H)`` instead, which is wrong for rare tokens: there
``S(a) ≈ 0`` and the ``−S̄`` term dominates (a rare token with ``A > 0`` *raises* entropy by ``≈ η A r S̄``).

STEER (Hao et al., arXiv 2510.10150; code ``zz-haooo/STEER``, ``compute_token_weights``) damps tokens by a
magnitude ``|Ω|`` of their estimated entropy change. The released code's

.. math::
    \\Omega_{code} = \\frac{A}{\\pi_{old}(a)}\\, \\pi_a (1-\\pi_a)(\\log\\pi_a + H_{old}) = A\\, r\\, (1-\\pi_a)(\\log\\pi_a + H_{old})

lacks a factor ``π_a`` relative to the only-``z_a`` change (ALGORITHMS.md §13.2, verified by finite
differences), so :func:`steer_omega` offers ``"code"`` (default, reproduces the paper's runs),
``"onlyza"`` (``π_a · Ω_code``) and ``"exact"`` (``A r (S(a) − S̄)``, E3 at the current policy).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "OmegaMode",
    "WeightMode",
    "balancing_coefficient",
    "first_order_entropy_change",
    "predicted_entropy_flow",
    "sampled_logit_flow",
    "sampled_token_score",
    "steer_omega",
    "steer_weights",
]

OmegaMode = Literal["code", "onlyza", "exact"]
WeightMode = Literal["exp", "linear"]


def first_order_entropy_change(logits: Tensor, delta_logits: Tensor) -> Tensor:
    """``ΔH ≈ −Σ_j π_j (log π_j + H) Δz_j`` over the last dimension (E1; a reference for any logit step)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float32 at least; float64 stays float64
    log_p = torch.log_softmax(logits.to(dtype), dim=-1)
    p = log_p.exp()
    entropy = -(p * log_p).sum(-1, keepdim=True)
    return -(p * (log_p + entropy) * delta_logits.to(dtype)).sum(-1)


def sampled_token_score(logprobs: Tensor, entropy: Tensor) -> Tensor:
    """``S(a) = π_a (log π_a + H)``: positive for tokens likelier than ``e^{−H}``, negative for rarer ones."""
    return logprobs.exp() * (logprobs + entropy)


def predicted_entropy_flow(
    advantages: Tensor,
    logprobs: Tensor,
    entropy: Tensor,
    sbar: Tensor,
    ratio: Tensor | None = None,
    clipped: Tensor | None = None,
) -> Tensor:
    """Per-token predicted entropy change ``c_t = −A r (S(a) − S̄)`` of one ascent step (units of ``η``), E3.

    Args:
        advantages: ``A`` per token.
        logprobs: ``log π(a)`` of the policy the step starts from.
        entropy: ``H`` of that policy.
        sbar: ``S̄`` of that policy.
        ratio: ``r = π/π_old`` (``None``: 1, the behaviour policy's own first step).
        clipped: boolean, tokens whose gradient the PPO clip cuts off (their ``c_t`` is 0).
    """
    return _scaled_and_unclipped(-advantages * (sampled_token_score(logprobs, entropy) - sbar), ratio, clipped)


def sampled_logit_flow(
    advantages: Tensor,
    logprobs: Tensor,
    entropy: Tensor,
    ratio: Tensor | None = None,
    clipped: Tensor | None = None,
) -> Tensor:
    """The "only ``z_a`` moves" estimate ``−A r π_a(1 − π_a)(log π_a + H)`` (units of ``η``; module doc).

    Wrong for rare tokens (E3 is the exact first-order change); kept because papers use it (OPEFO's Eq. 6 is
    likely this simplification).
    """
    pi = logprobs.exp()
    return _scaled_and_unclipped(-advantages * pi * (1 - pi) * (logprobs + entropy), ratio, clipped)


def _scaled_and_unclipped(flow: Tensor, ratio: Tensor | None, clipped: Tensor | None) -> Tensor:
    """The flow of the ratio-weighted surrogate (``× r``), zero where the PPO clip cuts the gradient."""
    if ratio is not None:
        flow = flow * ratio
    if clipped is not None:
        flow = torch.where(clipped, torch.zeros_like(flow), flow)
    return flow


def balancing_coefficient(flow_up: Tensor | float, flow_down: Tensor | float) -> float:
    """OPEFO's ``λ* = (F₋ − F₊)/(F₋ + F₊)`` (0 when both totals are 0).

    Weights ``1 + λ*`` on entropy-raising and ``1 − λ*`` on entropy-lowering tokens give zero net predicted
    flow, ``(1 + λ*)F₊ − (1 − λ*)F₋ = 0``.

    Args:
        flow_up: ``F₊ = Σ_{c>0} c``. flow_down: ``F₋ = Σ_{c<0} |c|``.
    """
    up, down = float(flow_up), float(flow_down)
    return (down - up) / (down + up) if down + up > 0 else 0.0


def steer_omega(
    mode: OmegaMode,
    advantages: Tensor,
    logprobs: Tensor,
    old_logprobs: Tensor,
    old_entropy: Tensor | None = None,
    entropy: Tensor | None = None,
    sbar: Tensor | None = None,
) -> Tensor:
    """STEER's per-token entropy-change estimate ``Ω`` (detached; non-finite values → 0, as in the code).

    ``"code"``: ``A/π_old · x(1−x)(log x + H_old)`` with ``x = clamp(π, 1e-8, 1−1e-8)`` and
    ``π_old`` clamped to ``[1e-8, 1]`` (the released code exactly); ``"onlyza"``: ``x · Ω_code``;
    ``"exact"``: ``A r (S(a) − S̄)`` with ``S(a)``, ``S̄`` of the current policy (``entropy``, ``sbar``).
    Positive ``Ω`` means the token's update lowers entropy (``ΔH ≈ −η Ω`` for ``"exact"``).
    """
    with torch.no_grad():
        logprobs, old_logprobs = logprobs.detach().float(), old_logprobs.detach().float()
        if mode == "exact":
            if entropy is None or sbar is None:
                raise ValueError("steer_omega(mode='exact') needs the current entropy and sbar")
            ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -20.0, 20.0))
            omega = advantages * ratio * (sampled_token_score(logprobs, entropy.detach().float()) - sbar)
        elif mode in ("code", "onlyza"):
            if old_entropy is None:
                raise ValueError(f"steer_omega(mode={mode!r}) needs the old-policy entropy")
            x = logprobs.exp().clamp(1e-8, 1 - 1e-8)
            old_p = old_logprobs.exp().clamp(1e-8, 1.0)
            omega = advantages / old_p * x * (1 - x) * (torch.log(x) + old_entropy.detach().float())
            if mode == "onlyza":
                omega = omega * x
        else:
            raise ValueError(f"unknown omega mode {mode!r}; expected 'code', 'onlyza' or 'exact'")
        return torch.where(torch.isfinite(omega), omega, torch.zeros_like(omega))


def steer_weights(
    magnitude: Tensor,
    lowest: Tensor | float,
    highest: Tensor | float,
    mode: WeightMode = "exp",
    w_min: float = 0.8,
    w_max: float = 1.2,
    floor: float = 0.02,
) -> Tensor:
    """STEER's token weights from ``m = |Ω|`` and its extremes ``[lowest, highest]`` over the valid tokens.

    ``"exp"`` (the paper's main mode): ``k = −ln(w_min) / max(highest, floor)``,
    ``w = clamp(exp(−k m), w_min, 1)`` — the largest ``|Ω|`` gets exactly ``w_min`` unless ``highest``
    is below ``floor``, where every weight stays above ``w_min``. ``"linear"``: ``w = clamp(w_max −
    (m − lowest)(w_max − w_min)/(highest − lowest), w_min, w_max)``, and ``(w_min + w_max)/2`` for every
    token when ``highest == lowest``. ``w_max`` is unused in ``"exp"`` mode.
    """
    highest = torch.as_tensor(highest, dtype=magnitude.dtype, device=magnitude.device)
    lowest = torch.as_tensor(lowest, dtype=magnitude.dtype, device=magnitude.device)
    if mode == "exp":
        k = -math.log(w_min) / torch.clamp(highest, min=floor)
        return torch.exp(-k * magnitude).clamp(w_min, 1.0)
    if mode == "linear":
        if highest <= lowest:
            return torch.full_like(magnitude, (w_min + w_max) / 2)
        scaled = w_max - (magnitude - lowest) * (w_max - w_min) / (highest - lowest)
        return scaled.clamp(w_min, w_max)
    raise ValueError(f"unknown weight mode {mode!r}; expected 'exp' or 'linear'")
