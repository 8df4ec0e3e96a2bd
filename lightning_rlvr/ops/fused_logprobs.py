"""Log-probabilities and entropy straight from the final hidden states, never holding the ``(N, V)`` logits.

With hidden states ``h`` (``N × H``), the output projection ``W`` (``V × H``, bias ``b``) and temperature ``τ``,
the scaled logits of a chunk of rows are ``u = (h W^T + b) / τ``; each chunk's log-prob of the label, entropy
(and ``S̄``) are computed as in :mod:`lightning_rlvr.ops.logprobs` and the chunk's logits are dropped. The
backward pass recomputes them chunk by chunk and forms

.. math::
    \\frac{\\partial L}{\\partial h} = \\frac{1}{τ} G W, \\qquad
    \\frac{\\partial L}{\\partial W} = \\frac{1}{τ} G^T h, \\qquad
    \\frac{\\partial L}{\\partial b} = \\frac{1}{τ} \\textstyle\\sum_{rows} G,

with ``G`` the chunk's gradient with respect to ``u`` (closed forms in ``logprobs.py``). Peak extra memory is
``O(chunk_size · V)`` forward and backward, plus a float32 accumulator of ``W``'s gradient; the model's
``lm_head`` never runs, so no ``N × V`` tensor exists at any point. This is what makes 150k-token vocabularies
affordable at long lengths (the same idea as Liger-Kernel's fused linear cross-entropy and verl's fused
entropy kernels, written here in plain PyTorch so it runs on any device).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_rlvr.ops.logprobs import TokenStats, _chunk_backward, _chunk_forward, nucleus_entropy_and_gap

__all__ = ["DEFAULT_CHUNK_BYTES", "FUSED_CHUNK_BYTES", "chunk_rows", "hidden_logprobs_and_entropy", "hidden_nucleus_entropy_and_gap"]

# Float32 bytes of one chunk of logits: two or three such buffers live at once, whatever the batch. 16 MiB keeps
# the logits path's working set within a few percent of a full log_softmax; the fused path takes 64 MiB, because
# its chunks are also matrix-multiplication tiles and 27-row tiles (at V = 152k) ran 1.4x slower than 110-row ones.
DEFAULT_CHUNK_BYTES = 16 << 20
FUSED_CHUNK_BYTES = 64 << 20


def chunk_rows(vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk such that a chunk's float32 logits take at most ``chunk_bytes`` (at least one row)."""
    return max(1, chunk_bytes // (4 * vocab_size))


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """A fresh float32 chunk of scaled logits ``(h W^T + b) / τ``, built in one buffer (bf16: two)."""
    logits = hidden @ weight.T
    if bias is not None:
        logits.add_(bias)
    logits = logits.float()
    return logits.div_(temperature) if temperature != 1.0 else logits


class _FusedLinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,  # type: ignore[override]
                temperature: float, chunk_size: int, with_sbar: bool):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        sbar = torch.empty(n if with_sbar else 0, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_size):
            sl = slice(start, start + chunk_size)
            u = _chunk_logits(hidden[sl], weight, bias, temperature)
            logp[sl], entropy[sl], lse[sl], chunk_sbar = _chunk_forward(u, labels[sl], with_sbar)
            if with_sbar:
                sbar[sl] = chunk_sbar
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(sbar)
        return logp, entropy, sbar

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor, grad_sbar: Tensor):  # type: ignore[override]
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp
        grad_entropy = torch.zeros_like(lse) if grad_entropy is None else grad_entropy
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        for start in range(0, hidden.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            u = _chunk_logits(hidden[sl], weight, bias, temperature)
            g = _chunk_backward(u, lse[sl], entropy[sl], labels[sl], grad_logp[sl], grad_entropy[sl])
            g = g / temperature  # now the gradient with respect to the chunk's logits h W^T + b
            if need_hidden:
                grad_hidden[sl] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_weight:
                grad_weight.addmm_(g.T, hidden[sl].float())
            if need_bias:
                grad_bias += g.sum(0)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def hidden_logprobs_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    with_sbar: bool = False,
    bias: Tensor | None = None,
) -> TokenStats:
    """``log π(labels)`` and entropy under ``softmax((hidden W^T + b) / τ)``, chunk by chunk (module docstring).

    Args:
        hidden: ``(..., H)`` final hidden states (after the model's last norm), any float dtype.
        weight: ``(V, H)`` output projection (``lm_head.weight``, tied or not).
        labels: ``(...)`` token ids whose log-probability is returned.
        temperature: sampling temperature.
        chunk_size: rows per chunk; ``None`` picks :func:`chunk_rows` of the vocabulary (64 MiB of logits).
        with_entropy: return the entropy at all.
        entropy_grad: let gradient flow through the entropy (entropy-bonus terms); detached otherwise.
        with_sbar: also return ``S̄`` (see :mod:`lightning_rlvr.ops.logprobs`).
        bias: ``(V,)`` output bias, if the projection has one.

    Returns:
        :class:`TokenStats` with float32 ``logprobs`` (differentiable in ``hidden``, ``weight`` and ``bias``).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not match")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} is not (V, {hidden.shape[-1]})")
    chunk_size = chunk_rows(weight.shape[0], FUSED_CHUNK_BYTES) if chunk_size is None else int(chunk_size)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    shape = labels.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    logp, entropy, sbar = _FusedLinearLogprobEntropy.apply(flat_hidden, weight, bias, labels.reshape(-1).long(),
                                                           float(temperature), chunk_size, bool(with_sbar))
    if not (with_entropy and entropy_grad):
        entropy = entropy.detach()
    return TokenStats(logprobs=logp.reshape(shape), entropy=entropy.reshape(shape) if with_entropy else None,
                      sbar=sbar.reshape(shape) if with_sbar else None)


@torch.no_grad()
def hidden_nucleus_entropy_and_gap(hidden: Tensor, weight: Tensor, temperature: float = 1.0, top_p: float = 0.9,
                                   chunk_size: int | None = None, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`~lightning_rlvr.ops.nucleus_entropy_and_gap` from hidden states, one chunk of logits at a time."""
    chunk_size = chunk_rows(weight.shape[0], FUSED_CHUNK_BYTES) if chunk_size is None else int(chunk_size)
    flat = hidden.reshape(-1, hidden.shape[-1])
    parts = [nucleus_entropy_and_gap(_chunk_logits(flat[start:start + chunk_size], weight, bias, 1.0), temperature,
                                     top_p, chunk_size) for start in range(0, flat.shape[0], chunk_size)]
    entropy = torch.cat([part[0] for part in parts]) if parts else flat.new_zeros(0, dtype=torch.float32)
    gap = torch.cat([part[1] for part in parts]) if parts else flat.new_zeros(0, dtype=torch.float32)
    return entropy.reshape(hidden.shape[:-1]), gap.reshape(hidden.shape[:-1])
