"""PolarityFilter: train on the tokens of one advantage sign only (the ablation of Deng et al., arXiv 2508.02260).

Deng et al. conclude that in the rising stage the entropy reduction on *negative* samples drives the
performance gain. Their released code (``compute_policy_loss``, ``positive_only`` / ``negative_only`` in
``ppo_trainer.yaml``) tests such claims by dropping one polarity from the policy-gradient loss: with the
token-level loss, the clipped surrogate is averaged over the kept tokens only,

.. math::
    \\mathcal{L} = \\frac{\\sum_{i,t} m_{i,t}\\, k_{i,t}\\, \\ell_{i,t}}{\\sum_{i,t} m_{i,t}\\, k_{i,t}}, \\qquad
    k_{i,t} = \\mathbb{1}[A_{i,t} > 0] \\;\\text{(positive only)} \\;\\text{or}\\; \\mathbb{1}[A_{i,t} < 0]
    \\;\\text{(negative only)},

with ``ℓ`` the PPO surrogate and ``m`` the response mask (zero advantages are dropped either way). Here the
filter is a per-token weight ``k · Σm / Σ(m k)`` over the minibatch's tokens on all ranks, which under the
``token-mean`` aggregation is exactly that masked mean (under the other aggregations it is the same mask with
the same constant rescaling, so the kept tokens' gradient keeps its scale). ``renormalise=False`` drops the
rescaling (the plain mask: the gradient shrinks with the kept share). ``scope="micro_batch"`` takes the counts
per micro-batch, as the authors' per-device masked mean does (which then weights micro-batches equally rather
than by their tokens). The advantages seen are the shaped ones (after every ``shape_advantages``), as in the
authors' code, where the mask follows the position and perplexity shaping.

Metrics ``polarity_filter/``: ``kept_fraction`` (share of valid tokens trained on).

Example::

    >>> from lightning_rlvr.callbacks import PolarityFilter
    >>> PolarityFilter("negative").train_on
    'negative'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor
from typing_extensions import override

from lightning_rlvr.callbacks.base import Intervention, MicroBatchContext, MinibatchView, StatisticsScope
from lightning_rlvr.distributed import all_sum

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PolarityFilter"]

Polarity = Literal["positive", "negative"]


class PolarityFilter(Intervention):
    """Keep only the tokens whose (shaped) advantage has one sign in the policy-gradient loss.

    Args:
        train_on: ``"positive"`` (the code's ``positive_only``: ``A > 0``) or ``"negative"`` (``negative_only``:
            ``A < 0``).
        renormalise: rescale the kept tokens so the loss is their mean (the authors' masked mean under
            ``token-mean``); ``False`` = the plain mask.
        scope: the tokens the counts are taken over: ``"minibatch"`` (independent of ``micro_batch_size``) or
            ``"micro_batch"`` (the authors' per-device micro-batch); all ranks either way.
    """

    metric_prefix = "polarity_filter"

    def __init__(self, train_on: Polarity = "negative", renormalise: bool = True,
                 scope: StatisticsScope = "minibatch") -> None:
        if train_on not in ("positive", "negative"):
            raise ValueError(f"PolarityFilter: train_on must be 'positive' or 'negative', got {train_on!r}")
        self.train_on, self.renormalise = train_on, bool(renormalise)
        self.needs = self._statistics_scope(scope)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(train_on=self.train_on, renormalise=self.renormalise, scope=self.scope)

    def kept(self, advantages: Tensor, mask: Tensor) -> Tensor:
        """``(N, T)`` bool: the valid tokens of the trained polarity."""
        sign = advantages > 0 if self.train_on == "positive" else advantages < 0
        return sign & (mask > 0)

    @override
    def token_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: MicroBatchContext) -> Tensor:
        view, rows = ctx.statistics_view(self.scope)
        scale = view.once(self, lambda: self._scale(view, ctx))
        return self.kept(ctx.advantages, ctx.mask).to(ctx.mask.dtype) * scale

    def _scale(self, view: MinibatchView, ctx: MicroBatchContext) -> float:
        counts = all_sum(torch.stack([self.kept(view.advantages, view.mask).sum(), view.valid.sum()]).float())
        kept, valid = counts.tolist()
        ctx.log(self.log_name("kept_fraction"), kept / valid if valid else float("nan"))
        if not self.renormalise or kept == 0:
            return 1.0  # nothing kept: the weights are all zero anyway
        return valid / kept
