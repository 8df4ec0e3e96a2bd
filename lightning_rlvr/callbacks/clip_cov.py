"""ClipCov: detach the policy-gradient term of a few random high-covariance tokens (Cui et al., arXiv 2505.22617).

Over the valid tokens of the minibatch (on all ranks; ``scope="micro_batch"``: of each micro-batch, the reference
code's per-device semantics), with current log-probs and the (shaped) advantages,
``Cov_t = (log π_t − mean log π)(A_t − mean A)``. Among tokens with
``lower < Cov_t < upper`` that the PPO clip has not already cut off, ``n = max(⌊ratio · N⌋, 1)`` tokens
are drawn **uniformly at random** (not the top-n) and their per-token pg loss is multiplied by 0.
They stay in the loss denominator. This is the reference code's semantics
(PRIME-RL/Entropy-Mechanism-of-RL and verl ``compute_policy_loss_clip_cov``), which differs from a
casual reading of the paper in three ways:

- "ratio" is a fraction of *all* valid tokens (2e-4), not of the candidates;
- the bounds are absolute covariance values (1 and 5), not multiples of the mean covariance;
- the reference recipe turns the ordinary PPO clip nearly off (``clip_ratio_low = clip_ratio_high = 1``,
  i.e. ``clamp(r, 0, 2)``) and uses no dual clip: set ``clip_low: 1.0``, ``clip_high: 1.0`` on the module
  to reproduce it (see the comment in ``configs/clip_cov.yaml``).

The random draw uses this callback's own generator (seeded by ``seed``, checkpointed), once per minibatch (per
micro-batch with ``scope="micro_batch"``), so a run is reproducible and every rank draws the same permutation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_rlvr.algorithms.covariance import clip_cov_selection, token_covariance
from lightning_rlvr.callbacks.base import Intervention, MicroBatchContext, MinibatchView, StatisticsScope

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ClipCov"]


class ClipCov(Intervention):
    """Clip-Cov token detachment.

    Args:
        ratio: fraction of valid tokens to detach per minibatch (reference 2e-4; at least one token).
        lower: ω_low, exclusive lower bound of the covariance of candidates (reference 1.0).
        upper: ω_high, exclusive upper bound (reference 5.0).
        seed: seed of the generator of the random draw.
        scope: the tokens the covariance, the candidates and the count are taken over: ``"minibatch"``
            (independent of ``micro_batch_size``) or ``"micro_batch"`` (the reference code's).

    Example::

        >>> from lightning_rlvr.callbacks import ClipCov
        >>> ClipCov(ratio=0.02).state_key
        "ClipCov{'ratio': 0.02, 'lower': 1.0, 'upper': 5.0}"
    """

    metric_prefix = "clip_cov"

    def __init__(self, ratio: float = 2e-4, lower: float = 1.0, upper: float = 5.0, seed: int = 0,
                 scope: StatisticsScope = "minibatch") -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"ClipCov: ratio must be in (0, 1], got {ratio}")
        if not lower < upper:
            raise ValueError(f"ClipCov: need lower < upper, got {lower}, {upper}")
        self.needs = self._statistics_scope(scope)
        self.ratio = float(ratio)
        self.lower = float(lower)
        self.upper = float(upper)
        self.seed = int(seed)
        self.generator = torch.Generator().manual_seed(self.seed)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(ratio=self.ratio, lower=self.lower, upper=self.upper)

    @override
    def token_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: MicroBatchContext) -> Tensor:
        view, rows = ctx.statistics_view(self.scope)
        return 1.0 - view.once(self, lambda: self._detached(view, ctx))[rows]

    def _detached(self, view: MinibatchView, ctx: MicroBatchContext) -> Tensor:
        """``(B, T)`` 1 on the tokens whose pg loss is detached, over ``view``'s rows."""
        logprobs, offset = view.gather_valid(view.logprobs)
        advantages, _ = view.gather_valid(view.advantages)
        out = view.policy_loss
        ppo_clipped, _ = view.gather_valid(out.clipped_high | out.clipped_low)
        covariance = token_covariance(logprobs, advantages)
        selected = clip_cov_selection(covariance, ~ppo_clipped, self.ratio, self.lower, self.upper, self.generator)
        n_valid = max(covariance.numel(), 1)
        ctx.log(self.log_name("selected_fraction"), selected.sum().item() / n_valid)
        ctx.log(self.log_name("candidate_fraction"),
                ((covariance > self.lower) & (covariance < self.upper) & ~ppo_clipped).sum().item() / n_valid)
        ctx.log(self.log_name("covariance_mean"), covariance.mean().item() if covariance.numel() else 0.0)
        return view.scatter_valid(selected, offset).to(view.mask.dtype)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.generator.set_state(state_dict["generator"])
