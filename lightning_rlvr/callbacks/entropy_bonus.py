"""EntropyBonus: a fixed-coefficient bonus on the current policy's full-vocabulary token entropy.

.. math::
    L = L_{pg} - c \\cdot \\mathrm{agg}(H_t), \\qquad H_t = -\\textstyle\\sum_j π_θ(j|s_t) \\log π_θ(j|s_t),

with the module's loss aggregation and the gradient through the whole softmax (verl
``compute_entropy_loss``; Skywork-OR1 ``dp_actor.py``). Fixed coefficients are brittle (too small does
nothing, too large explodes entropy); :class:`~lightning_rlvr.callbacks.AdaptiveEntropy` adapts it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor
from typing_extensions import override

from lightning_rlvr.callbacks.base import Intervention, MicroBatchContext, Needs

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["EntropyBonus"]


class EntropyBonus(Intervention):
    """Subtract ``coef`` × aggregated token entropy from the loss.

    Args:
        coef: the bonus coefficient ``c > 0`` (verl's old default 1e-3).

    Example::

        >>> from lightning_rlvr.callbacks import EntropyBonus
        >>> EntropyBonus(coef=1e-3).state_key
        "EntropyBonus{'coef': 0.001}"
    """

    needs = Needs(entropy_grad=True)
    metric_prefix = "entropy_bonus"

    def __init__(self, coef: float = 1e-3) -> None:
        if not coef > 0:
            raise ValueError(f"EntropyBonus: coef must be > 0, got {coef}")
        self.coef = float(coef)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(coef=self.coef)

    @override
    def extra_loss(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: MicroBatchContext) -> Tensor:
        term = -self.coef * ctx.aggregate(ctx.entropy)
        ctx.log_share(self.log_name("loss"), term.detach())
        return term
