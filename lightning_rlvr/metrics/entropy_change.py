"""Agreement between a predicted and an observed series: sign agreement, Pearson, Spearman, fitted scale.

Used by :class:`~lightning_rlvr.callbacks.EntropyChangeProbe` on per-step (window) and per-token values.
All take 1-D tensors of equal length, compute in float64, and return ``nan`` where the statistic is
undefined (fewer than 2 points, a constant series).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["average_ranks", "fitted_step_size", "pearson", "sign_agreement", "spearman"]


def _pair(predicted: Tensor, observed: Tensor) -> tuple[Tensor, Tensor]:
    x, y = torch.as_tensor(predicted).double().flatten(), torch.as_tensor(observed).double().flatten()
    if x.shape != y.shape:
        raise ValueError(f"predicted {tuple(x.shape)} and observed {tuple(y.shape)} differ in length")
    keep = torch.isfinite(x) & torch.isfinite(y)
    return x[keep], y[keep]


def sign_agreement(predicted: Tensor, observed: Tensor) -> float:
    """Fraction of points where ``sign(predicted) == sign(observed)`` (a zero matches only a zero)."""
    x, y = _pair(predicted, observed)
    return (torch.sign(x) == torch.sign(y)).double().mean().item() if x.numel() else math.nan


def pearson(predicted: Tensor, observed: Tensor) -> float:
    """Pearson correlation ``Σ(x−x̄)(y−ȳ) / sqrt(Σ(x−x̄)² Σ(y−ȳ)²)``."""
    x, y = _pair(predicted, observed)
    if x.numel() < 2:
        return math.nan
    x, y = x - x.mean(), y - y.mean()
    denominator = torch.sqrt((x * x).sum() * (y * y).sum())
    return (x * y).sum().div(denominator).item() if denominator > 0 else math.nan


def average_ranks(values: Tensor) -> Tensor:
    """0-based ranks with ties sharing the mean of their positions (as ``scipy.stats.rankdata - 1``)."""
    values = torch.as_tensor(values).double().flatten()
    unique, inverse, counts = torch.unique(values, sorted=True, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts
    return (first + (counts - 1) / 2).double()[inverse]


def spearman(predicted: Tensor, observed: Tensor) -> float:
    """Spearman rank correlation: Pearson of the average ranks."""
    x, y = _pair(predicted, observed)
    return pearson(average_ranks(x), average_ranks(y)) if x.numel() >= 2 else math.nan


def fitted_step_size(predicted: Tensor, observed: Tensor) -> float:
    """Least-squares ``η`` of ``observed ≈ η · predicted`` through the origin: ``Σ xy / Σ x²``."""
    x, y = _pair(predicted, observed)
    denominator = (x * x).sum()
    return ((x * y).sum() / denominator).item() if x.numel() and denominator > 0 else math.nan
