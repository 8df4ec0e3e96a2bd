"""Loss aggregation modes (verl ``agg_loss``) with normalisers taken over the whole minibatch.

A minibatch may be split into micro-batches for gradient accumulation (and across ranks). To give
the gradient of the *global* mean, each micro-batch's sum is divided by a normaliser computed once
for the whole minibatch, :func:`aggregation_normalizer`, and the micro-batch losses are summed:

- ``token-mean``: ``Σ L·m / N_tok`` (DAPO; ``N_tok`` = valid tokens in the minibatch);
- ``seq-mean-token-sum``: ``Σ_i Σ_t L·m / N_seq`` (sequences with at least one valid token);
- ``seq-mean-token-mean``: ``Σ_i (Σ_t L·m / |o_i|) / N_seq`` (GRPO paper);
- ``seq-mean-token-sum-norm``: ``Σ L·m / (N_seq_total · C)`` with a constant ``C`` (Dr.GRPO; default
  ``C`` = padded response length). Dividing by the (constant) number of sequences only rescales the
  learning rate, and keeps the loss on the same scale as the other modes.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

AggregationMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGREGATION_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
__all__ = ["AGGREGATION_MODES", "AggregationMode", "aggregate_loss", "aggregation_normalizer"]


def _check(mode: str) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {AGGREGATION_MODES}")


def aggregation_normalizer(mask: Tensor, mode: AggregationMode, loss_scale_factor: float | None = None) -> Tensor:
    """The denominator of ``mode`` for the *whole* minibatch ``mask`` (``(B, T)``), as a float tensor.

    Under DDP, all-reduce (sum) this before use so that it counts every rank's minibatch.
    """
    _check(mode)
    mask = mask.float()
    if mode == "token-mean":
        return mask.sum()
    n_seq = (mask.sum(-1) > 0).float().sum()
    if mode == "seq-mean-token-sum-norm":
        scale = float(loss_scale_factor) if loss_scale_factor is not None else float(mask.shape[-1])
        return torch.tensor(float(mask.shape[0]) * scale, device=mask.device)
    return n_seq


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    mode: AggregationMode = "token-mean",
    normalizer: Tensor | float | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Aggregate a per-token loss ``(B, T)`` into a scalar.

    Args:
        loss: per-token loss.
        mask: 1 on valid response tokens (float or bool; fractional weights are allowed).
        mode: one of :data:`AGGREGATION_MODES`.
        normalizer: the minibatch-wide denominator from :func:`aggregation_normalizer`; ``None`` uses
            this tensor's own (correct when ``loss`` is the whole minibatch).
        loss_scale_factor: the constant ``C`` of ``seq-mean-token-sum-norm``.
    """
    _check(mode)
    mask = mask.to(loss.dtype)
    if normalizer is None:
        normalizer = aggregation_normalizer(mask, mode, loss_scale_factor)
    if mode == "seq-mean-token-mean":
        per_seq = (loss * mask).sum(-1) / (mask.sum(-1) + 1e-8)
        numerator = per_seq.sum()
    else:
        numerator = (loss * mask).sum()
    return numerator / torch.clamp(torch.as_tensor(normalizer, dtype=loss.dtype, device=loss.device), min=1e-8)
