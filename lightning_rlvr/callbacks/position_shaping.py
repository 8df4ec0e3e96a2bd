"""PositionShaping: larger advantage magnitudes for tokens late in the response (arXiv 2508.02260).

Deng et al. find that in the plateau stage learning efficiency correlates with tokens near the *end* of a
response. Their released code (ALGORITHMS.md §13.1, ``add_loaction_bonus``) adds a sigmoid bonus of the
relative position, capped so that no advantage changes sign:

.. math::
    u_{i,t} = \\frac{\\mathrm{cumsum}_t(m_i) - 1}{|o_i|}, \\quad
    A'_{i,t} = A_{i,t} + \\mathrm{sign}(A_{i,t})\\,\\min\\!\\big(α\\,σ(k(u_{i,t} - 0.5)),\\; ½|A_{i,t}|\\big),

``α = 0.1``, ``k = 15``, for both signs (zero advantages stay zero), switched on only for verl steps
``200 < global_steps < 300`` of 600-step runs, where the authors' plateau begins. The window is kept as that
fraction of the run by default, ``active_fraction=(1/3, 1/2)`` (rollout steps ``round(N/3) ≤ step < round(N/2)``
of an ``N``-step fit: 200–299 at 600 steps, one step more than the authors' 200–298 in 0-based steps), so that it
falls where the plateau begins in a run of any length; the authors' absolute steps are ``active_steps=(200, 299)``
with ``active_fraction=None`` (in a 4,500-step run they are the rising stage). ``active_in="plateau"`` gates it on
a :class:`~lightning_rlvr.callbacks.StageDetector` instead (with both windows ``None``), which is what the paper's
plateau-stage motivation suggests.

Options that are ours, not the code's: ``entropy_quantile=q`` gives the bonus only to tokens whose
old-policy entropy is at least the batch's ``q``-quantile (lower order statistic, all ranks) (the paper's finding concerns *high-entropy*
late tokens; the code's entropy factor is commented out); ``preserve_mass=True`` rescales each response
so its total ``Σ_t |A|`` is unchanged (the bonus then only moves credit toward the end).

Metrics ``position_shaping/``: ``active``, and while active ``bonus_mean`` (mean ``|A'| − |A|`` over
valid tokens), ``mass_ratio`` (``Σ|A'| / Σ|A|``), and with ``entropy_quantile`` ``selected_fraction``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from typing_extensions import override

from lightning_rlvr.algorithms.selection import lower_quantile
from lightning_rlvr.algorithms.stage_shaping import position_bonus, rescale_to_mass
from lightning_rlvr.callbacks.base import Intervention, Needs, StepContext, masked_mean
from lightning_rlvr.callbacks.stage_gate import ActivationGate, ActiveIn
from lightning_rlvr.distributed import all_sum, gather_cat

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PositionShaping"]


class PositionShaping(Intervention):
    """Additive, sign-preserving bonus on the advantage magnitude of late response tokens.

    Args:
        alpha: α, the bonus scale (authors 0.1).
        steepness: k of the sigmoid (authors 15).
        center: relative position where the bonus is α/2 (authors 0.5).
        cap: the bonus is at most ``cap · |A|`` (authors 0.5; must be < 1 to keep signs).
        entropy_quantile: only tokens with old-policy entropy ≥ this batch quantile get the bonus (ours);
            ``None`` = every token (authors).
        preserve_mass: rescale each response to its original ``Σ_t |A|`` (ours; off = authors).
        active_in: ``"always"``, ``"rising"`` or ``"plateau"`` (needs a ``StageDetector``).
        active_steps: ``(start, stop)`` rollout-step window (the authors' code: ``(200, 299)``) or ``None``.
        active_fraction: ``(a, b)`` window as fractions of the run's rollout steps (default ``(1/3, 1/2)``: where
            the authors' window sits in their runs) or ``None``; excludes ``active_steps``.

    Example::

        >>> from lightning_rlvr.callbacks import PositionShaping
        >>> PositionShaping().gate.active_fraction
        (0.3333333333333333, 0.5)
        >>> PositionShaping(active_steps=(200, 299), active_fraction=None).gate.active_steps
        (200, 299)
    """

    metric_prefix = "position_shaping"

    def __init__(self, alpha: float = 0.1, steepness: float = 15.0, center: float = 0.5, cap: float = 0.5,
                 entropy_quantile: float | None = None, preserve_mass: bool = False, active_in: ActiveIn = "always",
                 active_steps: tuple[int, int] | None = None,
                 active_fraction: tuple[float, float] | None = (1 / 3, 1 / 2)) -> None:
        if not alpha > 0:
            raise ValueError(f"PositionShaping: alpha must be > 0, got {alpha}")
        if not steepness > 0:
            raise ValueError(f"PositionShaping: steepness must be > 0, got {steepness}")
        if not 0 < cap < 1:
            raise ValueError(f"PositionShaping: cap must be in (0, 1) so that no advantage changes sign, got {cap}")
        if entropy_quantile is not None and not 0 <= entropy_quantile < 1:
            raise ValueError(f"PositionShaping: entropy_quantile must be in [0, 1) or None, got {entropy_quantile}")
        self.alpha, self.steepness, self.center, self.cap = float(alpha), float(steepness), float(center), float(cap)
        self.entropy_quantile = None if entropy_quantile is None else float(entropy_quantile)
        self.preserve_mass = bool(preserve_mass)
        self.gate = ActivationGate("PositionShaping", active_in, active_steps, active_fraction)
        self.needs = Needs(old_stats=self.entropy_quantile is not None)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(alpha=self.alpha, steepness=self.steepness, center=self.center, cap=self.cap,
                               entropy_quantile=self.entropy_quantile, preserve_mass=self.preserve_mass,
                               **self.gate.describe())

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.gate.resolve(trainer)

    def _bonus_mask(self, ctx: StepContext) -> Tensor:
        """Tokens that may get the bonus: all valid ones, or those at/above the global entropy quantile."""
        if self.entropy_quantile is None:
            return ctx.mask
        valid = ctx.mask > 0
        entropy, _ = gather_cat(ctx.old_entropy[valid].float())
        if entropy.numel() == 0:
            return ctx.mask
        threshold = lower_quantile(entropy, self.entropy_quantile)
        selected = (ctx.old_entropy >= threshold) & valid
        ctx.log(self.log_name("selected_fraction"), all_sum(selected.sum()).item() / entropy.numel())
        return selected.to(ctx.mask.dtype)

    @override
    def shape_advantages(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> Tensor | None:
        if not self.gate.active_logged(trainer, ctx, self.log_name("active")):
            return None
        advantages, mask = ctx.advantages, ctx.mask
        # Positions are relative to the whole response; the entropy filter only decides who gets the bonus.
        boosted = position_bonus(advantages, mask, self.alpha, self.steepness, self.center, self.cap)
        bonus_mask = self._bonus_mask(ctx)
        shaped = torch.where(bonus_mask > 0, boosted, advantages)
        if self.preserve_mass:
            shaped = rescale_to_mass(shaped, advantages, mask, torch.arange(len(ctx.batch), device=mask.device))
        ctx.log(self.log_name("bonus_mean"), masked_mean(shaped.abs() - advantages.abs(), mask))
        mass = all_sum(torch.stack([(shaped.abs() * mask).sum(), (advantages.abs() * mask).sum()]).float())
        ctx.log(self.log_name("mass_ratio"), (mass[0] / mass[1]).item() if mass[1] > 0 else float("nan"))
        return shaped
