"""PerplexityShaping: scale each response's advantage by its perplexity within the group (arXiv 2508.02260).

Deng et al. find that in the plateau stage learning efficiency correlates with high-entropy tokens of
*low-perplexity* responses, and shape the advantage accordingly. The rule of their released code
(ALGORITHMS.md §13.1; formulas in :mod:`lightning_rlvr.algorithms.stage_shaping`):

.. math::
    \\ln PPL_i = -\\tfrac{1}{|o_i|}\\textstyle\\sum_t \\log π_{old}(a_{i,t}), \\quad
    z_i = \\frac{\\ln PPL_i - μ_g}{σ_g}, \\quad
    A'_{i,t} = \\mathrm{clip}(1 - α z_i,\\; 0.8,\\; 1.2)\\, A_{i,t},

with ``μ_g``, ``σ_g`` (population std, ``σ := 1`` if ``≤ 1e-6``) over the group's log-perplexities inside
Tukey's fences (1.5 IQR), ``α = 0.01``. A weight is positive, so every advantage keeps its sign; low-PPL
responses get larger magnitudes for both signs. **The released low-PPL branch is a no-op** (``w`` is
computed, printed and never multiplied in; only ``use_ppl_high`` applies it): run as shipped, their
``low_ppl.sh`` is plain GRPO. This callback applies the weight, as the paper describes. The code gates
nothing (it shapes every step); ``active_in`` / ``active_steps`` / ``active_fraction`` gate it here.

``preserve_mass=True`` (ours) rescales, per group and advantage sign, so that the positive and the
negative advantage mass of each group are unchanged: only *which* responses carry it changes.

Metrics ``ppl_shaping/``: ``active``, and while active ``weight_mean`` / ``weight_min`` / ``weight_max``,
``clamped_fraction`` (weights at a bound), ``outlier_fraction`` (outside the fences), ``log_ppl_mean``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor
from typing_extensions import override

from lightning_rlvr.algorithms.stage_shaping import (
    group_iqr_zscores,
    perplexity_weights,
    rescale_to_mass,
    response_log_perplexity,
)
from lightning_rlvr.callbacks.base import Intervention, Needs, StepContext, masked_mean
from lightning_rlvr.callbacks.stage_gate import ActivationGate, ActiveIn
from lightning_rlvr.distributed import all_max

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PerplexityShaping"]


class PerplexityShaping(Intervention):
    """Low-perplexity responses' advantages amplified, high-perplexity ones attenuated (both signs kept).

    Args:
        alpha: α, the weight's slope per unit of z-score (authors 0.01).
        weight_range: ``(low, high)`` clip of the weight (authors ``(0.8, 1.2)``).
        favour: ``"low"`` (the paper's rule: ``1 − α z``) or ``"high"`` (the code's ``use_ppl_high``: ``1 + α z``).
        iqr_factor: Tukey-fence factor of the outlier filter (authors 1.5).
        preserve_mass: rescale per group and sign so the advantage mass is unchanged (ours; off = authors).
        active_in: ``"always"`` (authors), ``"rising"`` or ``"plateau"`` (needs a ``StageDetector``).
        active_steps: ``(start, stop)`` rollout-step window, or ``None`` (every step).
        active_fraction: ``(a, b)`` window as fractions of the run's rollout steps, or ``None``.

    Example::

        >>> from lightning_rlvr.callbacks import PerplexityShaping
        >>> PerplexityShaping().needs.old_stats
        True
    """

    needs = Needs(old_stats=True)
    metric_prefix = "ppl_shaping"

    def __init__(self, alpha: float = 0.01, weight_range: tuple[float, float] = (0.8, 1.2), favour: str = "low",
                 iqr_factor: float = 1.5, preserve_mass: bool = False, active_in: ActiveIn = "always",
                 active_steps: tuple[int, int] | None = None, active_fraction: tuple[float, float] | None = None) -> None:
        if not alpha > 0:
            raise ValueError(f"PerplexityShaping: alpha must be > 0, got {alpha}")
        low, high = (float(w) for w in weight_range)
        if not 0 < low <= 1 <= high:
            raise ValueError(f"PerplexityShaping: weight_range must satisfy 0 < low <= 1 <= high, got {weight_range}")
        if favour not in ("low", "high"):
            raise ValueError(f"PerplexityShaping: favour must be 'low' or 'high', got {favour!r}")
        if iqr_factor < 0:
            raise ValueError(f"PerplexityShaping: iqr_factor must be >= 0, got {iqr_factor}")
        self.alpha, self.weight_range, self.favour = float(alpha), (low, high), favour
        self.iqr_factor, self.preserve_mass = float(iqr_factor), bool(preserve_mass)
        self.gate = ActivationGate("PerplexityShaping", active_in, active_steps, active_fraction)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(alpha=self.alpha, weight_range=self.weight_range, favour=self.favour,
                               iqr_factor=self.iqr_factor, preserve_mass=self.preserve_mass, **self.gate.describe())

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.gate.resolve(trainer)

    @override
    def shape_advantages(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> Tensor | None:
        if not self.gate.active_logged(trainer, ctx, self.log_name("active")):
            return None
        batch = ctx.batch
        log_ppl = response_log_perplexity(ctx.old_logprobs, ctx.mask)
        z, inlier = group_iqr_zscores(log_ppl, batch.group_ids, self.iqr_factor)
        weights = perplexity_weights(z, self.alpha, *self.weight_range, favour=self.favour)
        shaped = ctx.advantages * weights.to(ctx.advantages.dtype).unsqueeze(-1)
        if self.preserve_mass:
            sign = (ctx.advantages * ctx.mask).sum(-1) > 0
            shaped = rescale_to_mass(shaped, ctx.advantages, ctx.mask, batch.group_ids.to(sign.device) * 2 + sign)
        rows = weights.new_ones(len(batch), 1)
        low, high = self.weight_range
        ctx.log(self.log_name("weight_mean"), masked_mean(weights.unsqueeze(-1), rows))
        ctx.log(self.log_name("weight_max"), all_max(weights.max()).item())
        ctx.log(self.log_name("weight_min"), -all_max(-weights.min()).item())
        at_bound = ((weights <= low) | (weights >= high)).float()
        ctx.log(self.log_name("clamped_fraction"), masked_mean(at_bound.unsqueeze(-1), rows))
        ctx.log(self.log_name("outlier_fraction"), masked_mean((~inlier).float().unsqueeze(-1), rows))
        ctx.log(self.log_name("log_ppl_mean"), masked_mean(log_ppl.unsqueeze(-1), rows))
        return shaped
