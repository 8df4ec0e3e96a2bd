"""AdaptiveEntropy: an entropy bonus whose coefficient a controller steers toward a target entropy.

Default = Skywork-OR1's adaptive entropy control (He et al., arXiv 2505.22312, §3.2; code
``EntController`` in SkyworkAI/Skywork-OR1), which keeps a coefficient ``c`` and a switch ``e``:

.. math::
    L = L_{pg} - c\\,e\\,\\mathrm{agg}(H_t), \\qquad
    \\text{after the step: } c \\leftarrow \\mathrm{clip}(c \\pm δ, c_{min}, c_{max}),\\;
    e \\leftarrow [\\hat H < H^*],

``+δ`` while the measured entropy ``Ĥ`` is below the target ``H*`` (``−δ`` above), and ``Ĥ`` is the
step's mean sampled-token NLL ``−mean(log π_old(a_t))`` (what the reference measures; an unbiased
estimate of the token entropy at temperature 1). The coefficient used at step k was set from step k−1.
Reference defaults (``or1_scripts``): ``H* = 0.2``, ``c_0 = 0``, ``δ = 1e-4``, ``c ∈ [0, 0.005]``.

The AER variant (arXiv 2510.10959, "difficulty-aware coefficient allocation, initial-anchored target
entropy, dynamic global coefficient adjustment"; its formulas are not public, so this is our design,
ALGORITHMS.md §7.2) is the same callback with ``target_relative_to_initial=True`` (``H* = target · H_0``,
``H_0`` the first step's entropy), ``controller="proportional"`` (``c ← clip(c + δ (H* − Ĥ))``),
``gate=False`` and ``difficulty_aware=True``: the token coefficient of prompt q is ``c · f_q`` with
``f_q = (1 − acc_q) / mean_q'(1 − acc_q')``, so unsolved prompts get the bonus and solved ones none.
``AdaptiveEntropy.aer()`` builds it with the proposed defaults.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor
from typing_extensions import override

from lightning_rlvr.algorithms.entropy_regularization import (
    difficulty_weights,
    group_failure_rates,
    proportional_controller_step,
    sign_controller_step,
)
from lightning_rlvr.callbacks.base import Intervention, MicroBatchContext, Needs, StepContext, masked_mean
from lightning_rlvr.distributed import all_sum

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["AdaptiveEntropy"]


class AdaptiveEntropy(Intervention):
    """Entropy bonus with a coefficient controlled toward a target entropy (Skywork-OR1; AER as options).

    Args:
        target: target entropy ``H*`` in nats, or with ``target_relative_to_initial`` a fraction of ``H_0``.
        init_coef: initial coefficient ``c_0``.
        step_size: ``δ``: the fixed step of the ``"sign"`` controller, or the gain (per nat of error) of the
            ``"proportional"`` one.
        min_coef: lower bound of ``c``.
        max_coef: upper bound of ``c``.
        controller: ``"sign"`` (Skywork-OR1: ``c ± δ``) or ``"proportional"`` (AER: ``c + δ(H* − Ĥ)``).
        measure: ``"sampled_nll"`` (Skywork-OR1: ``−mean log π_old(a_t)``) or ``"entropy"`` (the old policy's
            full-vocabulary token entropy).
        gate: apply the bonus only while ``Ĥ < H*`` (Skywork-OR1's switch).
        target_relative_to_initial: ``H* = target · H_0`` with ``H_0`` measured at the first step (AER).
        difficulty_aware: scale each prompt's bonus by ``f_q`` (AER).

    Example::

        >>> from lightning_rlvr.callbacks import AdaptiveEntropy
        >>> AdaptiveEntropy(target=0.3).coef
        0.0
    """

    needs = Needs(entropy_grad=True)
    metric_prefix = "adaptive_entropy"

    def __init__(
        self,
        target: float = 0.2,
        init_coef: float = 0.0,
        step_size: float = 1e-4,
        min_coef: float = 0.0,
        max_coef: float = 0.005,
        controller: Literal["sign", "proportional"] = "sign",
        measure: Literal["sampled_nll", "entropy"] = "sampled_nll",
        gate: bool = True,
        target_relative_to_initial: bool = False,
        difficulty_aware: bool = False,
    ) -> None:
        if not target > 0:
            raise ValueError(f"AdaptiveEntropy: target must be > 0, got {target}")
        if target_relative_to_initial and target > 1:
            raise ValueError(f"AdaptiveEntropy: a target relative to the initial entropy must be <= 1, got {target}")
        if not step_size > 0:
            raise ValueError(f"AdaptiveEntropy: step_size must be > 0, got {step_size}")
        if not 0 <= min_coef <= max_coef:
            raise ValueError(f"AdaptiveEntropy: need 0 <= min_coef <= max_coef, got {min_coef}, {max_coef}")
        if not min_coef <= init_coef <= max_coef:
            raise ValueError(f"AdaptiveEntropy: init_coef must lie in [min_coef, max_coef], got {init_coef}")
        if controller not in ("sign", "proportional"):
            raise ValueError(f"AdaptiveEntropy: controller must be 'sign' or 'proportional', got {controller!r}")
        if measure not in ("sampled_nll", "entropy"):
            raise ValueError(f"AdaptiveEntropy: measure must be 'sampled_nll' or 'entropy', got {measure!r}")
        self.target = float(target)
        self.init_coef = float(init_coef)
        self.step_size = float(step_size)
        self.min_coef = float(min_coef)
        self.max_coef = float(max_coef)
        self.controller = controller
        self.measure = measure
        self.gate = bool(gate)
        self.target_relative_to_initial = bool(target_relative_to_initial)
        self.difficulty_aware = bool(difficulty_aware)
        # State (checkpointed): the coefficient, the switch, and H_0 for a relative target.
        self.coef = self.init_coef
        self.enabled = True
        self.initial_entropy: float | None = None
        self._weights: tuple[int, Tensor] | None = None  # (id of the step context, per-row f_q)

    @classmethod
    def aer(cls, target: float = 0.5, step_size: float = 1e-3, max_coef: float = 1e-2) -> AdaptiveEntropy:
        """The AER configuration (ALGORITHMS.md §7.2): ``H* = 0.5 H_0``, proportional, difficulty-aware."""
        return cls(target=target, step_size=step_size, max_coef=max_coef, controller="proportional",
                   measure="entropy", gate=False, target_relative_to_initial=True, difficulty_aware=True)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(target=self.target, controller=self.controller, measure=self.measure,
                               difficulty_aware=self.difficulty_aware)

    @property
    def realized_coef(self) -> float:
        """The coefficient applied this step: ``c · e``."""
        return self.coef * float(self.enabled)

    def target_entropy(self) -> float | None:
        """``H*`` in nats (``None`` before ``H_0`` is known for a relative target)."""
        if not self.target_relative_to_initial:
            return self.target
        return None if self.initial_entropy is None else self.target * self.initial_entropy

    def _row_weights(self, step: StepContext) -> Tensor:
        if self._weights is None or self._weights[0] != id(step):
            batch = step.batch
            failure, _ = group_failure_rates(batch.correct, batch.group_ids)
            # The mean over prompts runs over every rank's prompts, so all ranks weight alike.
            totals = all_sum(torch.stack([failure.sum(), failure.new_tensor(float(failure.numel()))]))
            mean_failure = totals[0].item() / max(totals[1].item(), 1.0)
            self._weights = (id(step), difficulty_weights(batch.correct, batch.group_ids, mean_failure))
        return self._weights[1]

    @override
    def extra_loss(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: MicroBatchContext) -> Tensor | None:
        coef = self.realized_coef
        if coef == 0:
            return None
        entropy = ctx.entropy
        if self.difficulty_aware:
            entropy = entropy * self._row_weights(ctx.step)[ctx.index].to(entropy.device).unsqueeze(-1)
        return -coef * ctx.aggregate(entropy)

    @override
    def on_update_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> None:
        if self.measure == "sampled_nll":
            measured = -masked_mean(ctx.old_logprobs, ctx.mask)
        else:
            measured = masked_mean(ctx.old_entropy, ctx.mask)
        ctx.log(self.log_name("coef"), self.realized_coef)  # the coefficient this step trained with
        ctx.log(self.log_name("measured_entropy"), measured)
        self._weights = None
        if measured != measured:  # nan: no valid tokens this step; keep the state
            return
        if self.target_relative_to_initial and self.initial_entropy is None:
            self.initial_entropy = measured
        target = self.target_entropy()
        if self.controller == "sign":
            self.coef = sign_controller_step(self.coef, measured, target, self.step_size, self.min_coef, self.max_coef)
        else:
            self.coef = proportional_controller_step(self.coef, measured, target, self.step_size, self.min_coef,
                                                     self.max_coef)
        self.enabled = measured < target if self.gate else True
        ctx.log(self.log_name("target"), target)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "enabled": self.enabled, "initial_entropy": self.initial_entropy}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.coef = float(state_dict["coef"])
        self.enabled = bool(state_dict["enabled"])
        self.initial_entropy = state_dict["initial_entropy"]
