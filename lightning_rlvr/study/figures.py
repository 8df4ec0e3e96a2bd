"""The study report's figures: entropy and accuracy trajectories, predicted vs observed entropy change, and the
failed/successful entropy ratio per method."""

from __future__ import annotations

import math
import statistics

from matplotlib.figure import Figure

from lightning_rlvr.plots import trailing_mean
from lightning_rlvr.study.summaries import (
    MethodSummary,
    RunSummary,
    _majority_rate,
    _sign_agreement,
    fmt,
)

__all__ = ["entropy_change_scatter", "paired_ratio_figure", "trajectories_figure"]

def _colours(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return [cmap(i % 20) for i in range(n)]


def _mean_curve(runs: list[RunSummary], attribute: str) -> tuple[list[int], list[float]]:
    """Mean over seeds at the steps every run logged."""
    series = [dict(getattr(r, attribute)) for r in runs]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    return steps, [statistics.fmean(s[t] for s in series) for t in steps]


def trajectories_figure(methods: dict[str, MethodSummary], smooth: int = 20) -> Figure:
    """Token entropy (moving average, mean over seeds) and held-out accuracy (mean over seeds) per method."""
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    for colour, summary in zip(_colours(len(methods)), methods.values()):
        steps, values = _mean_curve(summary.runs, "entropy")
        left.plot(steps, trailing_mean(values, smooth), color=colour, lw=1.2, label=summary.method)
        steps, values = _mean_curve(summary.runs, "val_accuracy")
        right.plot(steps, values, color=colour, marker="o", ms=3, lw=1.2, label=summary.method)
    left.set(xlabel="rollout step", ylabel="token entropy (nats)", title=f"Entropy ({smooth}-step mean, seed mean)")
    right.set(xlabel="rollout step", ylabel="held-out greedy accuracy", title="Held-out accuracy (seed mean)")
    right.legend(fontsize=7, ncols=2, loc="lower right")
    return fig


def entropy_change_scatter(methods: dict[str, MethodSummary]) -> Figure:
    """Predicted (−covariance, flow) vs observed per-step entropy change, every probed step of every run."""
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    pooled = [p for m in methods.values() for r in m.runs for p in r.probe]
    observed = [o for _, _, o in pooled]
    for index, (ax, name) in enumerate(zip(axes, ("−covariance", "flow"))):
        for colour, summary in zip(_colours(len(methods)), methods.values()):
            points = [p for r in summary.runs for p in r.probe]
            ax.scatter([p[index] for p in points], [p[2] for p in points], s=4, alpha=0.4, color=colour,
                       label=summary.method)
        ax.axhline(0, color="grey", lw=0.8)
        ax.axvline(0, color="grey", lw=0.8)
        agreement = _sign_agreement([p[index] for p in pooled], observed)
        ax.set(xlabel=f"predicted ({name})", ylabel="observed ΔH per step",
               title=f"{name}: sign agreement {fmt(agreement, 2)} (majority sign {fmt(_majority_rate(observed), 2)})")
    axes[1].legend(fontsize=7, ncols=2, markerscale=3)
    return fig


def paired_ratio_figure(methods: dict[str, MethodSummary]) -> Figure:
    """Last-window paired failed/successful entropy ratio per run, with its bootstrap CI, by method."""
    fig = Figure(figsize=(12, 3.8), layout="constrained")
    ax = fig.subplots()
    names = list(methods)
    for i, summary in enumerate(methods.values()):
        for j, run in enumerate(summary.runs):
            x = i + (j - (len(summary.runs) - 1) / 2) * 0.15
            if math.isfinite(run.paired_ratio):
                ax.errorbar([x], [run.paired_ratio], yerr=[[max(run.paired_ratio - run.paired_ci_low, 0)],
                                                           [max(run.paired_ci_high - run.paired_ratio, 0)]],
                            fmt="o", ms=3, capsize=2, color="tab:purple")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set(ylabel="failed / successful entropy", title="Paired ratio, last window, one point per seed (95% CI)")
    return fig


# -- markdown -----------------------------------------------------------------------------------------------
