"""KLCov: a KL penalty on the top-k covariance tokens only (Cui et al., arXiv 2505.22617, Eq. 13–14).

Over the valid tokens of the minibatch (on all ranks; ``scope="micro_batch"``: of each micro-batch, the reference
code's per-device semantics), ``Cov_t = (log π_t − mean log π)(A_t − mean A)``
(current log-probs, detached). The ``k = max(1, ⌊ratio · N⌋)`` tokens with the largest ``Cov_t``
(ties: the earlier token) get ``coef · |log π_θ − log π_old|`` added to their per-token loss, aggregated
like the pg loss. Reference semantics (verl / PRIME-RL ``compute_policy_loss_kl_cov``):

- ``ratio`` is a fraction (verl ``kl_cov_ratio``); PRIME-RL's scripts pass ``k_percent`` in percent, so
  their ``k_percent=0.2`` (7B) is ``ratio=2e-3`` here and ``0.02`` (32B) is ``2e-4``;
- the paper's ``β = 1`` (verl's yaml default ``ppo_kl_coef = 0.1`` differs; this default is the paper's);
- the reference surrogate has **no PPO clip** (``−A·r`` everywhere); set ``clip_low: 1.0`` and a large
  ``clip_high`` on the module to match it (see the comment in ``configs/kl_cov.yaml``).

The penalty's gradient is zero while ``π_θ = π_old``: on the first minibatch of a rollout the term is
inert, and with a single on-policy update per rollout KL-Cov does nothing. Use several minibatches
(the reference: 8 updates per rollout) or PPO epochs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor
from typing_extensions import override

from lightning_rlvr.algorithms.covariance import kl_cov_selection, token_covariance
from lightning_rlvr.callbacks.base import Intervention, MicroBatchContext, MinibatchView, StatisticsScope

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["KLCov"]


class KLCov(Intervention):
    """KL-Cov: ``coef · |log π_θ − log π_old|`` on the top-``ratio`` covariance tokens.

    Args:
        ratio: fraction of valid tokens penalised per minibatch (paper 2e-3 for 7B, 2e-4 for 32B).
        coef: β, the penalty weight (paper 1.0).
        scope: the tokens the covariance and the top-k are taken over: ``"minibatch"`` (independent of
            ``micro_batch_size``) or ``"micro_batch"`` (the reference code's).

    Example::

        >>> from lightning_rlvr.callbacks import KLCov
        >>> KLCov(ratio=0.01, coef=1.0).state_key
        "KLCov{'ratio': 0.01, 'coef': 1.0}"
    """

    metric_prefix = "kl_cov"

    def __init__(self, ratio: float = 2e-3, coef: float = 1.0, scope: StatisticsScope = "minibatch") -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"KLCov: ratio must be in (0, 1], got {ratio}")
        if not coef > 0:
            raise ValueError(f"KLCov: coef must be > 0, got {coef}")
        self.needs = self._statistics_scope(scope)
        self.ratio = float(ratio)
        self.coef = float(coef)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(ratio=self.ratio, coef=self.coef)

    @override
    def extra_loss(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: MicroBatchContext) -> Tensor:
        view, rows = ctx.statistics_view(self.scope)
        penalised = view.once(self, lambda: self._penalised(view, ctx))[rows]
        abs_kl = (ctx.logprobs - ctx.old_logprobs).abs()
        term = ctx.aggregate(self.coef * abs_kl * penalised)
        ctx.log_share(self.log_name("loss"), term.detach())
        return term

    def _penalised(self, view: MinibatchView, ctx: MicroBatchContext) -> Tensor:
        """``(B, T)`` 1 on the top-``ratio`` covariance tokens of ``view``'s rows."""
        logprobs, offset = view.gather_valid(view.logprobs)
        advantages, _ = view.gather_valid(view.advantages)
        covariance = token_covariance(logprobs, advantages)
        selected = kl_cov_selection(covariance, self.ratio)
        n_valid = max(covariance.numel(), 1)
        ctx.log(self.log_name("selected_fraction"), selected.sum().item() / n_valid)
        ctx.log(self.log_name("selected_covariance"),
                covariance[selected].mean().item() if selected.any() else 0.0)
        return view.scatter_valid(selected, offset).to(view.mask.dtype)
