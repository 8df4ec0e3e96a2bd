"""EP-GRPO's pure pieces: entropy gate, divergence-anchored process signal, cumulative-entropy progress bins.

Entropy-Progress Aligned GRPO with Implicit Process Guidance (arXiv 2605.04960) names three fixes — entropy-gated
modulation of the sequence advantage into token weights, policy divergence anchored to the outcome advantage
(no external reward model), and progress-aligned advantage normalisation by cumulative entropy that keeps a
gradient under zero reward variance — but no formulas were found (ALGORITHMS.md §9.5, §13.6; lowest
confidence). The design is ours:

.. math::
    g_t = \\operatorname{clip}\\big(1 + β (H_t / \\bar H_i - 1),\\ g_{lo},\\ g_{hi}\\big), \\qquad
    p_t = \\begin{cases} \\operatorname{sign}(A_i) \\tanh(d_t / τ_d) & A_i \\ne 0 \\\\
                        s_i \\tanh(d_t / τ_d) & A_i = 0 \\end{cases}, \\qquad d_t = \\log π_{old}(a_t) - \\log π_{ref}(a_t),

    P_{i,t} = \\frac{\\sum_{s \\le t} H_{i,s}}{\\sum_s H_{i,s}}, \\qquad
    A'_{i,t} = g_t (A_i + γ p_t), \\qquad
    A''_{i,t} = A'_{i,t} - μ_{q,b} \\quad \\Big(\\text{or } \\frac{A'_{i,t} - μ_{q,b}}{σ_{q,b} + ε}\\Big)
    \\text{ over the tokens of question } q \\text{ in progress bin } b .

``d_t`` is the PRIME-style implicit process reward (log-ratio to the reference); ``P`` is how far through the
response's total uncertainty token ``t`` is, binned into ``K`` equal bins. ``s_i = +1`` for a verified success and
``−1`` for a failure: in a zero-variance group the signal still follows the outcome (an all-failed group is
pulled back toward the reference, an all-solved one is reinforced where it moved).

Two choices were measured, not guessed (docs/interventions/ep_grpo.md, quickstart setting): the first design signed zero-variance groups
``+1`` whatever their outcome and z-scored each cell. Both feed back: on all-failed groups ``+tanh(d)`` rewards
whatever the policy already moved toward, and dividing by ``σ_{q,b}`` blows the ``γ``-weighted signal of a
zero-variance group up to unit scale. With the reference at the warmed-up policy, seed 0: the first design
collapsed (held-out 0.000, entropy 0.000), outcome-signed but z-scored reached 0.056 (entropy 0.98), outcome-signed
and centred 0.667 (3 seeds: 0.676 ± 0.009, GRPO 0.772 ± 0.055). Centring without the division keeps ``γ`` the
weight of the process signal relative to the outcome advantage.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["cumulative_entropy_progress", "divergence_signal", "entropy_gate", "progress_bins",
           "progress_normalize"]


def _row_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)


def entropy_gate(entropy: Tensor, mask: Tensor, strength: float = 0.5, low: float = 0.5, high: float = 2.0,
                 eps: float = 1e-8) -> Tensor:
    """``g_t`` (module docstring) on valid tokens, 0 elsewhere; rows of zero mean entropy get 1."""
    if not 0 < low <= 1 <= high:
        raise ValueError(f"entropy_gate needs 0 < low <= 1 <= high, got {low}, {high}")
    mask = mask.to(entropy.dtype)
    mean = _row_mean(entropy, mask)
    relative = torch.where(mean > eps, entropy / mean.clamp_min(eps), torch.ones_like(entropy))
    return (1 + strength * (relative - 1)).clamp(low, high) * mask


def divergence_signal(old_logprobs: Tensor, ref_logprobs: Tensor, sequence_advantages: Tensor,
                      temperature: float = 0.5, correct: Tensor | None = None) -> Tensor:
    """``p_t``: the bounded policy-vs-reference log-ratio, signed by the outcome.

    Args:
        old_logprobs: ``(N, T)`` log-probs of the behaviour policy.
        ref_logprobs: ``(N, T)`` log-probs of the reference.
        sequence_advantages: ``(N,)`` or ``(N, T)`` outcome advantages (only their sign is used).
        temperature: ``τ_d > 0``, the log-ratio scale at which ``tanh`` saturates.
        correct: ``(N,)`` bool, the verifier outcome: the sign ``s_i`` where the advantage is 0. ``None`` leaves
            those rows unsigned (``+tanh``; unstable in training, kept for the ablation and tests).
    """
    if temperature <= 0:
        raise ValueError(f"divergence_signal: temperature must be > 0, got {temperature}")
    if sequence_advantages.dim() == 1:
        sequence_advantages = sequence_advantages.unsqueeze(-1)
    signal = torch.tanh((old_logprobs - ref_logprobs) / temperature)
    sign = torch.sign(sequence_advantages)
    outcome_sign = torch.ones_like(sign) if correct is None else (2.0 * correct.to(sign.dtype) - 1).reshape(-1, 1)
    return torch.where(sign == 0, outcome_sign * signal, sign * signal)


def cumulative_entropy_progress(entropy: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``P_{i,t} ∈ (0, 1]``; rows of zero total entropy progress linearly with position. 0 off the mask."""
    mask = mask.to(entropy.dtype)
    cumulative = (entropy * mask).cumsum(-1)
    total = cumulative[:, -1:]
    linear = mask.cumsum(-1) / mask.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(total > eps, cumulative / total.clamp_min(eps), linear) * mask


def progress_bins(progress: Tensor, num_bins: int) -> Tensor:
    """Bin ``b = ⌈P K⌉ − 1 ∈ {0, …, K−1}`` of each token (``P = 0`` goes to bin 0)."""
    if num_bins < 1:
        raise ValueError(f"progress_bins: num_bins must be >= 1, got {num_bins}")
    return (torch.ceil(progress * num_bins).long() - 1).clamp(0, num_bins - 1)


def progress_normalize(values: Tensor, mask: Tensor, group_ids: Tensor, bins: Tensor, num_bins: int,
                       eps: float = 1e-6, scale: bool = True) -> Tensor:
    """Centre ``values`` within each (question group, progress bin) over valid tokens; 0 elsewhere.

    With ``scale`` also divide by the cell's population std (a z-score). A cell with one token (or identical
    values) gets 0.
    """
    valid = mask > 0
    cells = (group_ids.unsqueeze(-1) * num_bins + bins)[valid]
    x = values[valid].double()
    n_cells = int(cells.max().item()) + 1 if cells.numel() else 0
    count = torch.zeros(n_cells, dtype=torch.float64, device=values.device).index_add_(0, cells, torch.ones_like(x))
    total = torch.zeros_like(count).index_add_(0, cells, x)
    mean = total / count.clamp_min(1)
    centred = x - mean[cells]
    var = torch.zeros_like(count).index_add_(0, cells, centred.square()) / count.clamp_min(1)
    out = torch.zeros_like(values)
    out[valid] = (centred / (var.sqrt()[cells] + eps) if scale else centred).to(values.dtype)
    return out
