"""STEER: Stabilizing Token-level Entropy-changE via Reweighting (Hao et al., arXiv 2510.10150).

The paper shows that the entropy change one update causes at a token is governed by four factors —
whether the PPO clip is active, the advantage, the token's probability, and the entropy of its position
— and reweights every token's policy-gradient loss by a decreasing function of the magnitude of that
estimated change ``|Ω|``, so that no token moves the entropy by much in either direction:

.. math::
    \\text{exp mode: } w_t = \\operatorname{clip}\\big(e^{-k|Ω_t|}, λ_{min}, 1\\big), \\quad
    k = \\frac{-\\ln λ_{min}}{\\max(\\max_s |Ω_s|, 0.02)}; \\qquad
    \\text{linear mode: } w_t = w_{max} - \\frac{|Ω_t| - \\min|Ω|}{\\max|Ω| - \\min|Ω|}(w_{max} - w_{min})

with min/max over the valid tokens of the minibatch, on all ranks, so the weights depend neither on the number of
GPUs nor on ``micro_batch_size`` (``scope="micro_batch"``: per micro-batch, the released code's per-device pool).
Reference semantics (``zz-haooo/STEER``, ``compute_token_weights``): the default
``omega="code"`` is the released code's ``Ω = A·r·(1−π)(log π + H_old)`` with the *old-policy* entropy;
``"onlyza"`` and ``"exact"`` are the corrected estimates of ALGORITHMS.md §13.2 (the code's Ω lacks a factor
``π`` against the first-order change; see :mod:`lightning_rlvr.algorithms.entropy_change`). The paper's main
runs use exp mode with ``λ_min = 0.8``, clip 0.2/0.28 and dual-clip ``c = 10`` (set those on the module). With
``RLVRModule(engine_is_cap=...)`` each token's update is also multiplied by its engine importance weight ``w``, so
``|Ω|`` is that of the applied update, ``|w·Ω|``.

Metrics (each over a minibatch's valid tokens on all ranks, averaged over the step's minibatches):
``steer/weight_mean``, ``steer/weight_min``, ``steer/weight_max``, ``steer/omega_abs_max``, and
``steer/clipfrac_high`` (``A > 0`` and ``r > 1 + ε_high``) / ``steer/clipfrac_low`` (``A < 0`` and
``r < 1 − ε_low``) of the tokens it weighs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from typing_extensions import override

from lightning_rlvr.algorithms.entropy_change import OmegaMode, WeightMode, steer_omega, steer_weights
from lightning_rlvr.callbacks.base import Intervention, MicroBatchContext, MinibatchView, StatisticsScope
from lightning_rlvr.distributed import all_max, all_sum

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["STEER"]


class STEER(Intervention):
    """Down-weight tokens whose update would change entropy the most (arXiv 2510.10150).

    Args:
        mode: ``"exp"`` (paper's main mode, ``λ = exp(−k|Ω|)``) or ``"linear"`` (min-max map to
            ``[w_min, w_max]``).
        w_min: the smallest weight (λ_min; 0.8 in both of the authors' run scripts).
        w_max: the largest weight in linear mode (1.2 in ``run_linear.sh``; exp mode caps at 1).
        omega: which estimate of the entropy change: ``"code"`` (reference), ``"onlyza"``, ``"exact"``.
        omega_floor: exp mode's lower bound on ``max|Ω|`` (0.02 in the code), so that a batch of tiny
            changes is not stretched to ``w_min``. ``"onlyza"``/``"exact"`` values are smaller by about
            ``π``: a floor sized for the code's Ω keeps their weights near 1 unless it is lowered.
        scope: the tokens the extremes of ``|Ω|`` are taken over: ``"minibatch"`` (independent of
            ``micro_batch_size``) or ``"micro_batch"`` (the code's per-device micro-batch).

    Example::

        >>> from lightning_rlvr.callbacks import STEER
        >>> STEER(mode="linear", w_min=0.8, w_max=1.2).state_key
        "STEER{'mode': 'linear', 'w_min': 0.8, 'w_max': 1.2, 'omega': 'code', 'omega_floor': 0.02}"
    """

    metric_prefix = "steer"

    def __init__(self, mode: WeightMode = "exp", w_min: float = 0.8, w_max: float = 1.2, omega: OmegaMode = "code",
                 omega_floor: float = 0.02, scope: StatisticsScope = "minibatch") -> None:
        if mode not in ("exp", "linear"):
            raise ValueError(f"STEER: mode must be 'exp' or 'linear', got {mode!r}")
        if omega not in ("code", "onlyza", "exact"):
            raise ValueError(f"STEER: omega must be 'code', 'onlyza' or 'exact', got {omega!r}")
        if mode == "exp" and not 0 < w_min < 1:
            raise ValueError(f"STEER: exp mode needs 0 < w_min < 1, got {w_min}")
        if mode == "linear" and not 0 <= w_min <= w_max:
            raise ValueError(f"STEER: linear mode needs 0 <= w_min <= w_max, got [{w_min}, {w_max}]")
        if omega_floor <= 0:
            raise ValueError(f"STEER: omega_floor must be > 0, got {omega_floor}")
        self.mode, self.w_min, self.w_max = mode, float(w_min), float(w_max)
        self.omega, self.omega_floor = omega, float(omega_floor)
        # The exact estimate needs S̄ of the current policy, from the training forward pass.
        self.needs = dataclasses.replace(self._statistics_scope(scope), flow_stats=omega == "exact")

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(mode=self.mode, w_min=self.w_min, w_max=self.w_max, omega=self.omega,
                               omega_floor=self.omega_floor)

    @override
    def token_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: MicroBatchContext) -> Tensor:
        view, rows = ctx.statistics_view(self.scope)
        return view.once(self, lambda: self._weights(view, ctx))[rows]

    def _weights(self, view: MinibatchView, ctx: MicroBatchContext) -> Tensor:
        # As applied: the loss multiplies each token by its engine importance weight too (engine_is_cap).
        omega = view.applied(steer_omega(self.omega, view.advantages, view.logprobs, view.old_logprobs,
                                         view.old_entropy, view.entropy, view.sbar))
        magnitude, valid = omega.abs(), view.valid
        # Extremes over the valid tokens of every rank (±inf where a rank has none: neutral for max).
        highest = all_max(torch.where(valid, magnitude, -torch.inf).amax() if valid.any()
                          else magnitude.new_tensor(-torch.inf))
        lowest = 0.0  # exp mode needs only the maximum
        if self.mode == "linear":
            lowest = -all_max(-(torch.where(valid, magnitude, torch.inf).amin() if valid.any()
                                else magnitude.new_tensor(torch.inf)))
        if not torch.isfinite(highest):  # no valid token anywhere: nothing to weigh
            return torch.ones_like(view.mask)
        weights = steer_weights(magnitude, lowest, highest, self.mode, self.w_min, self.w_max, self.omega_floor)
        weights = torch.where(valid, weights, torch.zeros_like(weights))
        self._log(view, ctx, weights, highest)
        return weights

    def _log(self, view: MinibatchView, ctx: MicroBatchContext, weights: Tensor, highest: Tensor) -> None:
        valid = view.valid
        out = view.policy_loss
        sums = all_sum(torch.stack([weights[valid].sum(), valid.sum().float(),
                                    (out.clipped_high & valid).sum().float(), (out.clipped_low & valid).sum().float()]))
        extremes = all_max(torch.stack([weights[valid].amax() if valid.any() else weights.new_tensor(-torch.inf),
                                        -weights[valid].amin() if valid.any() else weights.new_tensor(-torch.inf)]))
        count = sums[1].item()
        ctx.log(self.log_name("weight_mean"), sums[0].item() / count)
        ctx.log(self.log_name("weight_max"), extremes[0].item())
        ctx.log(self.log_name("weight_min"), -extremes[1].item())
        ctx.log(self.log_name("omega_abs_max"), highest.item())
        ctx.log(self.log_name("clipfrac_high"), sums[2].item() / count)
        ctx.log(self.log_name("clipfrac_low"), sums[3].item() / count)
