"""EntropyPerformanceAnalysis: the three granularities of arXiv 2508.02260's analysis, logged every step.

Deng et al. ("Decomposing the Entropy-Performance Exchange") study how entropy and performance trade off
at three levels; this callback measures each on the embedded task or a real run (no effect on training):

- **stage** — ``analysis/entropy_slope`` and ``analysis/accuracy_slope``: least-squares slopes per step
  of the token-mean entropy and of the rollout accuracy (fraction of correct completions) over the last
  ``slope_window`` steps. The rising stage has a steep negative entropy slope and a positive accuracy one.
- **instance** — the observed entropy change of the update, ``ΔH_t = H_{θ'}(·|s_t) − H_θ(·|s_t)`` on the
  same rollout tokens, recomputed with the updated policy (one no-grad forward over ``change_rows`` rows
  per measured step: the cost of this analysis), split by response polarity:
  ``analysis/delta_entropy/{positive,negative}`` (mean per token; positive = verified correct) and
  ``analysis/delta_entropy/{positive,negative}_contribution`` (``Σ_polarity ΔH / #tokens``; the two add up
  to the mean change, so one sees which polarity carries the entropy reduction — the paper finds the
  negative samples do in the rising stage). Also token entropy and ΔH by response-perplexity bucket,
  ``analysis/entropy_by_ppl/<b>`` and ``analysis/delta_entropy_by_ppl/<b>`` (equal-count buckets of the
  old-policy ``lnPPL`` over all ranks; 0 = lowest perplexity).
- **token** — token entropy and ΔH by relative-position bucket, ``analysis/entropy_by_position/<b>``
  and ``analysis/delta_entropy_by_position/<b>`` (deciles of the centred relative position by default;
  0 = start of the response).

All buckets are :class:`~lightning_rlvr.metrics.entropy_analysis.BucketedMean` torchmetrics (sum states),
computed on every rank, so values are over the global batch under DDP. Empty buckets log ``nan``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from lightning_rlvr.algorithms.stage_detection import linear_slope
from lightning_rlvr.algorithms.stage_shaping import response_log_perplexity
from lightning_rlvr.callbacks.base import Intervention, StepContext, entropy_before_update, masked_mean
from lightning_rlvr.metrics.entropy_analysis import BucketedMean, position_buckets, rank_buckets

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import Tensor

__all__ = ["EntropyPerformanceAnalysis"]


class EntropyPerformanceAnalysis(Intervention):
    """Stage-, instance- and token-level entropy diagnostics (see the module docstring for every metric).

    Args:
        every_n_steps: measure the bucketed metrics (and the entropy change) every this many rollout steps;
            the slopes are updated every step.
        slope_window: steps in the trailing window of the stage-level slopes.
        position_buckets: number of relative-position buckets (10 = deciles).
        perplexity_buckets: number of equal-count response-perplexity buckets.
        measure_change: recompute the rollout's entropy after the update to measure ``ΔH`` (one forward).
        change_rows: measure ``ΔH`` on the first this many rows of the rollout (whole prompt groups, the
            rollout's prompts are already shuffled); ``None`` = all rows.

    Example::

        >>> from lightning_rlvr.callbacks import EntropyPerformanceAnalysis
        >>> EntropyPerformanceAnalysis(position_buckets=4).position.num_buckets
        4
    """

    metric_prefix = "analysis"

    def __init__(self, every_n_steps: int = 1, slope_window: int = 50, position_buckets: int = 10,
                 perplexity_buckets: int = 5, measure_change: bool = True, change_rows: int | None = None) -> None:
        for name, value, least in (("every_n_steps", every_n_steps, 1), ("slope_window", slope_window, 2),
                                   ("position_buckets", position_buckets, 1),
                                   ("perplexity_buckets", perplexity_buckets, 1)):
            if value < least:
                raise ValueError(f"EntropyPerformanceAnalysis: {name} must be >= {least}, got {value}")
        if change_rows is not None and change_rows < 1:
            raise ValueError(f"EntropyPerformanceAnalysis: change_rows must be >= 1 or None, got {change_rows}")
        self.every_n_steps, self.slope_window = every_n_steps, slope_window
        self.measure_change, self.change_rows = bool(measure_change), change_rows
        self.position = BucketedMean(position_buckets)
        self.perplexity = BucketedMean(perplexity_buckets)
        self.position_change = BucketedMean(position_buckets)
        self.perplexity_change = BucketedMean(perplexity_buckets)
        self.polarity_change = BucketedMean(2)
        self.entropy_history: list[float] = []
        self.accuracy_history: list[float] = []
        self._before: Tensor | None = None  # H_before of the change rows, when the engine gave the behaviour stats

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(every_n_steps=self.every_n_steps, slope_window=self.slope_window,
                               position_buckets=self.position.num_buckets,
                               perplexity_buckets=self.perplexity.num_buckets,
                               measure_change=self.measure_change, change_rows=self.change_rows)

    def _metrics(self) -> list[BucketedMean]:
        return [self.position, self.perplexity, self.position_change, self.perplexity_change, self.polarity_change]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for metric in self._metrics():
            metric.to(pl_module.device)

    def _log_buckets(self, ctx: StepContext, name: str, metric: BucketedMean, values: Tensor, buckets: Tensor,
                     weights: Tensor) -> dict[str, Tensor]:
        metric.reset()
        metric.update(values, buckets, weights)
        result = metric.compute()
        for b, value in enumerate(result["mean"].tolist()):
            ctx.log(self.log_name(f"{name}/{b}"), value)
        return result

    def _change_rows(self, ctx: StepContext) -> Tensor:
        return torch.arange(min(self.change_rows or len(ctx.batch), len(ctx.batch)), device=ctx.mask.device)

    @override
    def shape_advantages(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> Tensor | None:
        measured = self.measure_change and ctx.step % self.every_n_steps == 0
        self._before = entropy_before_update(pl_module, ctx, self._change_rows(ctx)) if measured else None
        return None

    @override
    def on_update_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> None:
        mask = ctx.mask
        correct = ctx.batch.correct.to(mask.dtype).unsqueeze(-1)
        self.entropy_history = (self.entropy_history + [masked_mean(ctx.old_entropy, mask)])[-self.slope_window :]
        self.accuracy_history = (self.accuracy_history + [masked_mean(correct, torch.ones_like(correct))])[
            -self.slope_window :]
        ctx.log(self.log_name("entropy_slope"), linear_slope(self.entropy_history))
        ctx.log(self.log_name("accuracy_slope"), linear_slope(self.accuracy_history))
        if ctx.step % self.every_n_steps:
            return
        positions = position_buckets(mask, self.position.num_buckets)
        ppl = rank_buckets(response_log_perplexity(ctx.old_logprobs, mask), self.perplexity.num_buckets)
        ppl = ppl.unsqueeze(-1).expand_as(mask)
        self._log_buckets(ctx, "entropy_by_position", self.position, ctx.old_entropy, positions, mask)
        self._log_buckets(ctx, "entropy_by_ppl", self.perplexity, ctx.old_entropy, ppl, mask)
        if not self.measure_change or ctx.updates_applied == 0:  # no update applied: no change to measure
            return
        rows = self._change_rows(ctx)
        after = pl_module.recompute_token_stats(ctx.batch.select(rows)).entropy
        before = ctx.old_entropy[rows] if self._before is None else self._before
        change, sub_mask = after - before, mask[rows]
        self._log_buckets(ctx, "delta_entropy_by_position", self.position_change, change, positions[rows], sub_mask)
        self._log_buckets(ctx, "delta_entropy_by_ppl", self.perplexity_change, change, ppl[rows], sub_mask)
        negative = (~ctx.batch.correct[rows]).long().unsqueeze(-1).expand_as(sub_mask)
        self.polarity_change.reset()
        self.polarity_change.update(change, negative, sub_mask)
        result = self.polarity_change.compute()
        total = result["count"].sum().item()
        for b, polarity in enumerate(("positive", "negative")):
            ctx.log(self.log_name(f"delta_entropy/{polarity}"), result["mean"][b].item())
            ctx.log(self.log_name(f"delta_entropy/{polarity}_contribution"),
                    result["sum"][b].item() / total if total > 0 else math.nan)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"entropy_history": list(self.entropy_history), "accuracy_history": list(self.accuracy_history)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.entropy_history = [float(v) for v in state_dict["entropy_history"]]
        self.accuracy_history = [float(v) for v in state_dict["accuracy_history"]]
