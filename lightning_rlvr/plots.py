"""Diagnostic figures (matplotlib, no pyplot: no global backend state) and where they are written.

:func:`save_figures` logs each figure to every :class:`~lightning.pytorch.loggers.MLFlowLogger` of the trainer
as an artifact under ``plots/`` (``MlflowClient.log_figure``), and writes PNGs to a folder when there is no
MLflow logger or a folder is given. Only rank 0 writes. Figures are built on
:class:`matplotlib.figure.Figure` directly, so nothing is registered with pyplot and nothing needs closing.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from matplotlib.figure import Figure

from lightning_rlvr.metrics.entropy_change import sign_agreement

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["entropy_by_stratum_figure", "entropy_change_figure", "paired_ratio_figure", "run_curves_figure",
           "save_figures", "trailing_mean"]


def entropy_by_stratum_figure(steps: Sequence[float], failed: Sequence[float], successful: Sequence[float],
                              ratio: Sequence[float]) -> Figure:
    """Token entropy of failed and successful responses over training, and their ratio."""
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(steps, failed, color="tab:red", label="failed")
    left.plot(steps, successful, color="tab:green", label="successful")
    left.set(xlabel="rollout step", ylabel="token entropy (nats)", title="Entropy by verifier outcome")
    left.legend()
    right.plot(steps, ratio, color="tab:purple")
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    right.set(xlabel="rollout step", ylabel="failed / successful", title="Failed-to-successful ratio")
    return fig


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` finite values (NaN steps, e.g. no failed completion, are skipped)."""
    out, kept = [], []
    for value in values:
        if math.isfinite(value):
            kept.append(value)
        recent = kept[-window:]
        out.append(sum(recent) / len(recent) if recent else math.nan)
        kept = recent
    return out


def run_curves_figure(val_steps: Sequence[float], val_accuracy: Sequence[float], steps: Sequence[float],
                      failed: Sequence[float], successful: Sequence[float], window: int = 100) -> Figure:
    """A run at a glance: held-out accuracy, and the token entropy of failed and successful completions.

    Entropies are trailing means over ``window`` rollout steps (per-step values are noisy at 16 prompts a step).
    """
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(val_steps, val_accuracy, marker="o", color="tab:blue")
    left.set(xlabel="rollout step", ylabel="held-out greedy accuracy", title="Held-out accuracy", ylim=(0, 1))
    right.plot(steps, trailing_mean(failed, window), color="tab:red", label="failed")
    right.plot(steps, trailing_mean(successful, window), color="tab:green", label="successful")
    right.set(xlabel="rollout step", ylabel="token entropy (nats)",
              title=f"Entropy by verifier outcome ({window}-step mean)")
    right.legend()
    return fig


def paired_ratio_figure(steps: Sequence[float], geometric_mean: Sequence[float], low: Sequence[float],
                        high: Sequence[float]) -> Figure:
    """Common-question paired ratio per window: geometric mean and bootstrap CI bars."""
    fig = Figure(figsize=(5, 3.5), layout="constrained")
    ax = fig.subplots()
    below = [max(g - lo, 0.0) for g, lo in zip(geometric_mean, low)]
    above = [max(hi - g, 0.0) for g, hi in zip(geometric_mean, high)]
    ax.errorbar(steps, geometric_mean, yerr=[below, above], fmt="o", capsize=3, color="tab:purple")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="rollout step", ylabel="paired ratio (geometric mean)", title="Paired failed/successful entropy")
    return fig


def entropy_change_figure(covariance: Sequence[float], flow: Sequence[float], observed: Sequence[float]) -> Figure:
    """Predicted (−covariance, flow; units of the step size) vs observed per-step entropy change, with sign agreement."""
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    for ax, values, name in zip(fig.subplots(1, 2), ([-c for c in covariance], flow), ("−covariance", "flow")):
        ax.scatter(values, observed, s=8, alpha=0.6)
        ax.axhline(0, color="grey", lw=0.8)
        ax.axvline(0, color="grey", lw=0.8)
        ax.set(xlabel=f"predicted ({name})", ylabel="observed ΔH",
               title=f"{name}: sign agreement {sign_agreement(torch.tensor(values), torch.tensor(observed)):.2f}")
    return fig


def save_figures(trainer: pl.Trainer, figures: dict[str, Figure], folder: str | None = None) -> list[str]:
    """Log ``{name: figure}`` to MLflow (``plots/<name>.png``) and/or write ``<folder>/<name>.png``.

    Args:
        trainer: its MLflow loggers receive the artifacts; without one, ``folder`` defaults to
            ``<trainer.default_root_dir>/plots``.
        figures: the figures.
        folder: also (or instead) write PNGs here.

    Returns:
        The local paths written (MLflow artifacts are not listed).
    """
    from lightning.pytorch.loggers import MLFlowLogger

    written: list[str] = []
    if not trainer.is_global_zero:
        return written
    mlflow_loggers = [lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)]
    for logger in mlflow_loggers:
        for name, fig in figures.items():
            logger.experiment.log_figure(logger.run_id, fig, f"plots/{name}.png")
    if folder is None and not mlflow_loggers:
        folder = os.path.join(trainer.default_root_dir, "plots")
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
        for name, fig in figures.items():
            path = os.path.join(folder, f"{name}.png")
            fig.savefig(path, dpi=110)
            written.append(path)
    return written
