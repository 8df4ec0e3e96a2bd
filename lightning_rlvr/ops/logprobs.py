"""Chunked per-token log-probabilities and entropy of a softmax, without a full float32 ``log_softmax``.

For logits ``z`` (already the model's output) and sampling temperature ``τ`` we work with the scaled
logits ``u = z / τ`` and the distribution ``p = softmax(u)``:

.. math::
    \\log \\pi(a) = u_a - \\operatorname{logsumexp}(u), \\qquad
    H = -\\sum_j p_j \\log p_j .

The rows of the ``(N, V)`` logits are processed ``chunk_size`` rows at a time in float32, so peak extra
memory is ``O(chunk_size · V)`` instead of ``O(N · V)``. When a gradient is needed, a custom autograd
function recomputes the softmax chunk by chunk in the backward pass instead of keeping every chunk's
float32 probabilities alive (the closed forms below), so memory stays lean with gradient too:

.. math::
    \\frac{\\partial \\log \\pi(a)}{\\partial u_j} = \\mathbb 1[j=a] - p_j, \\qquad
    \\frac{\\partial H}{\\partial u_j} = -p_j (\\log p_j + H).

The same pass can also return the vocabulary statistic of the first-order entropy change (ALGORITHMS.md
§2.2; arXiv 2510.10150, 2602.03392 Thm 3.3): with ``S(j) = p_j (\\log p_j + H)``,

.. math::
    \\bar S = \\sum_j p_j S(j) = \\sum_j p_j^2 (\\log p_j + H),

so that a gradient step of size ``η`` on ``A · r · log π(a)`` at one position changes that position's
entropy by ``ΔH ≈ -η A r (S(a) - \\bar S)``; ``S(a)`` itself needs only ``log π(a)`` and ``H``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TokenStats", "naive_logprobs_and_entropy", "nucleus_entropy_and_gap", "token_logprobs_and_entropy"]


@dataclass
class TokenStats:
    """Per-token quantities computed in one pass over the vocabulary.

    Attributes:
        logprobs: ``log π(a_t)`` of the given labels, float32, shape ``labels.shape``.
        entropy: full-vocabulary entropy ``H_t`` (nats), float32, or ``None`` when not requested.
        sbar: ``S̄_t = Σ_j p_j² (log p_j + H_t)``, float32 and detached, or ``None`` when not requested.
        nucleus_entropy: entropy of the renormalised top-p set (:func:`nucleus_entropy_and_gap`), or ``None``.
        top2_gap: ``log p_(1) − log p_(2)``, the top-two log-probability gap, or ``None``.
    """

    logprobs: Tensor
    entropy: Tensor | None
    sbar: Tensor | None = None
    nucleus_entropy: Tensor | None = None
    top2_gap: Tensor | None = None


def _scaled_chunk(logits: Tensor, temperature: float) -> Tensor:
    """A float32 copy of a chunk of logits divided by ``τ``: a buffer the chunk kernels may overwrite."""
    u = logits.to(torch.float32, copy=True)
    return u.div_(temperature) if temperature != 1.0 else u


def _dot_rows(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise dot products of two ``(rows, V)`` tensors without a ``(rows, V)`` temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _chunk_forward(u: Tensor, labels: Tensor, with_sbar: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Log-prob of ``labels``, entropy, logsumexp (and ``S̄``) for one float32 chunk of scaled logits.

    ``u`` is overwritten (it becomes ``log p``): besides it, one ``(rows, V)`` buffer (``p``) is allocated.
    """
    lse = torch.logsumexp(u, dim=-1)
    log_p = _log_probs_(u, lse)
    logp_label = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    p = torch.exp(log_p)
    entropy = -_dot_rows(p, log_p)
    sbar = None
    if with_sbar:  # Σ p² log p + H Σ p²
        p.square_()
        sbar = _dot_rows(p, log_p) + entropy * p.sum(-1)
    return logp_label, entropy, lse, sbar


def _chunk_backward(u: Tensor, lse: Tensor, entropy: Tensor, labels: Tensor, grad_logp: Tensor,
                    grad_entropy: Tensor) -> Tensor:
    """Gradient with respect to one chunk of scaled logits ``u`` (overwritten), from those of its log-probs and
    entropies: ``d logp_a/du = onehot(a) - p`` and ``dH/du = -p (log p + H)``, so
    ``g = -p (g_logp + g_H (log p + H)) + onehot(a) g_logp``, built in the buffers of ``u`` and ``p``."""
    log_p = _log_probs_(u, lse)
    p = torch.exp(log_p)
    factor = log_p.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1)).add_(grad_logp.unsqueeze(-1))
    g = p.mul_(factor).neg_()
    return g.scatter_add_(-1, labels.unsqueeze(-1), grad_logp.unsqueeze(-1))


def _log_probs_(u: Tensor, lse: Tensor) -> Tensor:
    """``u - lse`` in place. Clamped so that masked (-inf) logits give p·log p = 0 instead of 0·(-inf) = NaN."""
    return u.sub_(lse.unsqueeze(-1)).clamp_min_(torch.finfo(torch.float32).min)


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """Autograd function over flattened ``(N, V)`` logits; recomputes the softmax per chunk in backward."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, chunk_size: int,  # type: ignore[override]
                with_sbar: bool):
        n = logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        sbar = torch.empty(n if with_sbar else 0, dtype=torch.float32, device=logits.device)
        for start in range(0, n, chunk_size):
            sl = slice(start, start + chunk_size)
            u = _scaled_chunk(logits[sl], temperature)
            logp[sl], entropy[sl], lse[sl], chunk_sbar = _chunk_forward(u, labels[sl], with_sbar)
            if with_sbar:
                sbar[sl] = chunk_sbar
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(sbar)
        return logp, entropy, sbar

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor, grad_sbar: Tensor):  # type: ignore[override]
        logits, labels, lse, entropy = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        grad_logits = torch.empty_like(logits)
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(lse)
        for start in range(0, logits.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            u = _scaled_chunk(logits[sl], temperature)
            g = _chunk_backward(u, lse[sl], entropy[sl], labels[sl], grad_logp[sl], grad_entropy[sl])
            grad_logits[sl] = (g / temperature).to(logits.dtype)
        return grad_logits, None, None, None, None


def token_logprobs_and_entropy(
    logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    with_sbar: bool = False,
) -> TokenStats:
    """Log-probabilities of ``labels`` and full-vocabulary entropy under ``softmax(logits / temperature)``.

    Args:
        logits: ``(..., V)`` raw logits in any float dtype (bf16 is fine; math is done in float32).
        labels: ``(...)`` token ids whose log-probability is returned.
        temperature: sampling temperature the tokens were drawn with (logits are divided by it).
        chunk_size: rows (tokens) processed at once; bounds the float32 working set to ``chunk_size × V``.
        with_entropy: compute the entropy at all.
        entropy_grad: let gradient flow through the entropy (needed only by entropy-bonus terms);
            otherwise the entropy is detached, which is what diagnostics want.
        with_sbar: also return ``S̄`` (module docstring), from the same chunks: no extra vocabulary pass.

    Returns:
        :class:`TokenStats` with float32 ``logprobs`` (differentiable if ``logits`` is) and ``entropy``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")
    shape = labels.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).long()
    logp, entropy, sbar = _ChunkedLogprobEntropy.apply(flat_logits, flat_labels, float(temperature), int(chunk_size),
                                                       bool(with_sbar))
    if not (with_entropy and entropy_grad):
        entropy = entropy.detach()
    return TokenStats(logprobs=logp.reshape(shape), entropy=entropy.reshape(shape) if with_entropy else None,
                      sbar=sbar.reshape(shape) if with_sbar else None)


@torch.no_grad()
def nucleus_entropy_and_gap(logits: Tensor, temperature: float = 1.0, top_p: float = 0.9, chunk_size: int = 1024,
                            max_candidates: int = 256) -> tuple[Tensor, Tensor]:
    r"""Local top-p entropy and top-two log-prob gap per position (PAEC's decision-sensitivity signals), no grad.

    With ``p = softmax(logits / τ)`` sorted descending, the nucleus is the smallest prefix whose mass reaches
    ``top_p`` (the token that crosses ``top_p`` is included, as in nucleus sampling), ``q`` its renormalised
    probabilities, and

    .. math::
        H^{top}_t = -\sum_{j \in N_p} q_j \log q_j, \qquad Δ_t = \log p_{(1)} - \log p_{(2)} \ge 0 .

    Only the ``max_candidates`` most likely tokens are ranked (``topk``, not a full sort of the vocabulary);
    when they hold less than ``top_p`` the nucleus is those candidates — which matters only for nearly
    uniform distributions over a large vocabulary, where ``H^{top}`` is then ``≈ log(max_candidates)``.

    Args:
        logits: ``(..., V)`` raw logits, ``V ≥ 2``.
        temperature: the sampling temperature.
        top_p: nucleus mass in ``(0, 1]``.
        chunk_size: rows processed at once.
        max_candidates: tokens ranked per row.

    Returns:
        ``(nucleus_entropy, top2_gap)``, float32, shape ``logits.shape[:-1]``.
    """
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if logits.shape[-1] < 2 or max_candidates < 2:
        raise ValueError("nucleus_entropy_and_gap needs a vocabulary and max_candidates of at least 2")
    flat = logits.reshape(-1, logits.shape[-1])
    k = min(max_candidates, flat.shape[-1])
    entropy = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    gap = torch.empty_like(entropy)
    for start in range(0, flat.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        log_p = torch.log_softmax(flat[sl].float() / temperature, dim=-1).topk(k, dim=-1).values
        p = log_p.exp()
        mass_before = p.cumsum(-1) - p
        in_nucleus = mass_before < top_p  # the first token always is (mass before it is 0)
        q = torch.where(in_nucleus, p, torch.zeros_like(p))
        q = q / q.sum(-1, keepdim=True)
        entropy[sl] = -(q * torch.log(q.clamp_min(1e-30))).sum(-1)
        gap[sl] = log_p[:, 0] - log_p[:, 1]
    shape = logits.shape[:-1]
    return entropy.reshape(shape), gap.reshape(shape)


def naive_logprobs_and_entropy(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> TokenStats:
    """Reference implementation with a full float32 ``log_softmax`` (for tests and benchmarks only)."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1).long()).squeeze(-1)
    p = logp_all.exp()
    entropy = -(p * logp_all).sum(-1)
    sbar = (p * p * (logp_all + entropy.unsqueeze(-1))).sum(-1)
    return TokenStats(logprobs=logp, entropy=entropy, sbar=sbar)
