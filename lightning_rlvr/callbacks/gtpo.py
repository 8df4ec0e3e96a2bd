"""GTPO: entropy-weighted token advantages (Tan et al., arXiv 2508.04349, "Dynamic Entropy Weighting").

Replaces the outcome advantages with advantages of shaped token rewards (formulas in
:mod:`lightning_rlvr.algorithms.gtpo`): correct responses gain most at their high-entropy tokens,
wrong ones are penalised most at their confident tokens. Entropies are the *old* policy's (the
callback asks the module for them before the update). Because it rebuilds the advantages from the
rewards, put GTPO first in a stack of advantage shapers. Groups are whole on each rank (every rank
generates all G completions of its prompts), so no cross-rank reduction is needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor
from typing_extensions import override

from lightning_rlvr.algorithms.gtpo import GTPONormalization, gtpo_advantages, gtpo_token_rewards
from lightning_rlvr.callbacks.base import Intervention, Needs, StepContext, masked_mean

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["GTPO"]


class GTPO(Intervention):
    """Token-level reward shaping with the old policy's entropy.

    Args:
        alpha_outcome: α₁, weight of the outcome reward (reimplementations: 1.0).
        alpha_entropy: α₂, weight of the entropy share (0.1; ``α₁ + α₂ = 1`` conserves reward).
        threshold: a response is correct (O⁺) when its reward exceeds this.
        normalization: ``"group"`` (all tokens of a group; default) or ``"polarity"`` (O⁺ and O⁻ tokens
            separately, as the reimplementations do; this drops the correct-vs-wrong sign).
        eps: added to entropies before shares and inverses.

    Example::

        >>> from lightning_rlvr.callbacks import GTPO
        >>> GTPO().needs.old_stats
        True
    """

    needs = Needs(old_stats=True)
    metric_prefix = "gtpo"

    def __init__(
        self,
        alpha_outcome: float = 1.0,
        alpha_entropy: float = 0.1,
        threshold: float = 0.5,
        normalization: GTPONormalization = "group",
        eps: float = 1e-6,
    ) -> None:
        if alpha_outcome < 0 or alpha_entropy < 0 or alpha_outcome + alpha_entropy == 0:
            raise ValueError(f"GTPO: alphas must be >= 0 and not both 0, got {alpha_outcome}, {alpha_entropy}")
        if normalization not in ("group", "polarity"):
            raise ValueError(f"GTPO: normalization must be 'group' or 'polarity', got {normalization!r}")
        if not eps > 0:
            raise ValueError(f"GTPO: eps must be > 0, got {eps}")
        self.alpha_outcome = float(alpha_outcome)
        self.alpha_entropy = float(alpha_entropy)
        self.threshold = float(threshold)
        self.normalization = normalization
        self.eps = float(eps)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(alpha_outcome=self.alpha_outcome, alpha_entropy=self.alpha_entropy,
                               threshold=self.threshold, normalization=self.normalization)

    @override
    def shape_advantages(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> Tensor:
        batch = ctx.batch
        shaped = gtpo_token_rewards(batch.rewards, ctx.old_entropy, ctx.mask, batch.group_ids, self.alpha_outcome,
                                    self.alpha_entropy, self.threshold, self.eps)
        advantages = gtpo_advantages(shaped, batch.rewards, ctx.mask, batch.group_ids, self.threshold,
                                     self.normalization, self.eps)
        positive = (batch.rewards > self.threshold).float().unsqueeze(-1) * ctx.mask
        ctx.log(self.log_name("shaped_reward_positive"), masked_mean(shaped, positive))
        ctx.log(self.log_name("shaped_reward_negative"), masked_mean(shaped, ctx.mask - positive))
        ctx.log(self.log_name("advantage_abs_mean"), masked_mean(advantages.abs(), ctx.mask))
        return advantages
