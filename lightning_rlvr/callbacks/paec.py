"""PAEC: Position-Aware Entropy Calibration (Yang, Liu, Zheng, Yang, Li; arXiv 2606.08543).

A penalty, not a bonus: entropy is pushed up only where it matters and only when it has fallen below a floor.
Each position gets a detached soft mask ``g_t`` from the current policy's local top-p entropy and top-two
log-prob gap (:func:`~lightning_rlvr.algorithms.position_calibration.decision_sensitivity_mask`, thresholds =
batch quantiles, the top ``1 − ρ = 20 %``); the mask-weighted entropy ``H̄ = Σ g H / Σ g`` of the batch is
kept above ``ρ_min · H_0`` by ``λ · max(0, ρ_min H_0 − H̄)²``, where the scalar anchor ``H_0`` is the mean of
``H̄`` over the first ``anchor_steps = 4`` rollout steps (no penalty during them). ALGORITHMS.md §13.4 gives
what was found of the paper (mask quantile ρ = 0.8, the K = 4 anchor, the one-sided quadratic); the mask
function, its temperatures, ``λ`` and ``ρ_min`` were not found and are ours (defaults λ = 0.05, ρ_min = 0.9).

Options: ``hinge="per_token"`` penalises ``Σ g_t max(0, floor − H_t)² / Σ g_t`` instead of the aggregate
hinge; ``mask="none"`` sets ``g = 1`` (the paper's "without mask" ablation). Quantiles and sums are over the
minibatch's valid tokens on all ranks, whatever ``micro_batch_size`` is: ``H̄``, ``Σ g`` and the hinge are the
minibatch's, and each micro-batch contributes its tokens' share of the penalty's gradient.

Metrics: ``paec/anchor``, ``paec/floor``, ``paec/selected_entropy`` (H̄), ``paec/below_floor`` (1 when the
hinge is active), ``paec/penalty``, ``paec/mask_mean``, ``paec/mask_selected_fraction`` (``g > ½``),
``paec/entropy_unmasked`` (the (1−g)-weighted entropy, to compare with ``selected_entropy``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor
from typing_extensions import override

from lightning_rlvr.algorithms.position_calibration import decision_sensitivity_mask, entropy_floor_penalty
from lightning_rlvr.algorithms.selection import lower_quantile
from lightning_rlvr.callbacks.base import Intervention, MicroBatchContext, MinibatchView, Needs, StepContext
from lightning_rlvr.distributed import all_sum

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PAEC"]


class PAEC(Intervention):
    """Anchored lower bound on the entropy of decision-sensitive positions (arXiv 2606.08543).

    Args:
        coefficient: λ of the penalty.
        floor_ratio: ρ_min: the floor is ``floor_ratio × anchor``.
        mask_quantile: ρ: thresholds are the ρ-quantile of the nucleus entropy and the (1−ρ)-quantile of the gap.
        top_p: nucleus mass of the local entropy.
        anchor_steps: K rollout steps whose mean ``H̄`` is the anchor.
        entropy_temperature: sigmoid temperature of the nucleus-entropy term (nats).
        gap_temperature: sigmoid temperature of the gap term (nats).
        hinge: ``"aggregate"`` (hinge of the batch mean) or ``"per_token"``.
        mask: ``"soft"`` or ``"none"`` (every position weighted 1).

    Example::

        >>> from lightning_rlvr.callbacks import PAEC
        >>> PAEC().needs.nucleus_top_p
        0.9
    """

    metric_prefix = "paec"

    def __init__(self, coefficient: float = 0.05, floor_ratio: float = 0.9, mask_quantile: float = 0.8,
                 top_p: float = 0.9, anchor_steps: int = 4, entropy_temperature: float = 0.1,
                 gap_temperature: float = 0.5, hinge: Literal["aggregate", "per_token"] = "aggregate",
                 mask: Literal["soft", "none"] = "soft") -> None:
        if coefficient < 0:
            raise ValueError(f"PAEC: coefficient must be >= 0, got {coefficient}")
        if floor_ratio <= 0:
            raise ValueError(f"PAEC: floor_ratio must be > 0, got {floor_ratio}")
        if not 0 < mask_quantile < 1:
            raise ValueError(f"PAEC: mask_quantile must be in (0, 1), got {mask_quantile}")
        if not 0 < top_p <= 1:
            raise ValueError(f"PAEC: top_p must be in (0, 1], got {top_p}")
        if anchor_steps < 1:
            raise ValueError(f"PAEC: anchor_steps must be >= 1, got {anchor_steps}")
        if entropy_temperature <= 0 or gap_temperature <= 0:
            raise ValueError("PAEC: entropy_temperature and gap_temperature must be > 0")
        if hinge not in ("aggregate", "per_token"):
            raise ValueError(f"PAEC: hinge must be 'aggregate' or 'per_token', got {hinge!r}")
        if mask not in ("soft", "none"):
            raise ValueError(f"PAEC: mask must be 'soft' or 'none', got {mask!r}")
        self.coefficient, self.floor_ratio, self.mask_quantile = float(coefficient), float(floor_ratio), float(mask_quantile)
        self.top_p, self.anchor_steps = float(top_p), int(anchor_steps)
        self.entropy_temperature, self.gap_temperature = float(entropy_temperature), float(gap_temperature)
        self.hinge, self.mask = hinge, mask
        self.needs = Needs(entropy_grad=True, nucleus_top_p=self.top_p if mask == "soft" else None,
                           minibatch_stats=True)
        self.anchor_sum, self.anchor_count = 0.0, 0
        self._step_selected: list[float] = []

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(coefficient=self.coefficient, floor_ratio=self.floor_ratio,
                               mask_quantile=self.mask_quantile, top_p=self.top_p, anchor_steps=self.anchor_steps,
                               hinge=self.hinge, mask=self.mask)

    @property
    def anchor(self) -> float | None:
        """``H_0`` once ``anchor_steps`` steps were seen, else ``None``."""
        return self.anchor_sum / self.anchor_count if self.anchor_count >= self.anchor_steps else None

    def soft_mask(self, view: MinibatchView) -> Tensor:
        """``g`` on ``view``'s rows (0 off the mask), thresholds from all ranks' valid tokens."""
        if self.mask == "none":
            return view.mask.clone()
        if view.nucleus_entropy is None or view.top2_gap is None:
            raise RuntimeError("PAEC needs the nucleus entropy and top-two gap; the module did not compute them")
        nucleus, _ = view.gather_valid(view.nucleus_entropy)
        gap, _ = view.gather_valid(view.top2_gap)
        if nucleus.numel() == 0:
            return torch.zeros_like(view.mask)
        g = decision_sensitivity_mask(view.nucleus_entropy, view.top2_gap, lower_quantile(nucleus, self.mask_quantile),
                                      lower_quantile(gap, 1 - self.mask_quantile), self.entropy_temperature,
                                      self.gap_temperature)
        return g * view.mask

    def _minibatch_penalty(self, view: MinibatchView, ctx: MicroBatchContext) -> dict[str, Any] | None:
        """The minibatch's mask, ``Σ g`` and hinge (all ranks), or ``None`` when no penalty applies."""
        g = self.soft_mask(view).detach()
        entropy = view.entropy
        sums = all_sum(torch.stack([(g * entropy).sum(), g.sum(), ((view.mask - g) * entropy).sum(),
                                    (view.mask - g).sum(), (g > 0.5).float().sum(), view.mask.sum()]).double())
        weighted, g_total, rest, rest_total, n_selected, n_valid = sums.tolist()
        if g_total <= 0:
            return None
        selected = weighted / g_total
        self._step_selected.append(selected)
        ctx.log(self.log_name("selected_entropy"), selected)
        ctx.log(self.log_name("mask_mean"), g_total / n_valid)
        ctx.log(self.log_name("mask_selected_fraction"), n_selected / n_valid)
        ctx.log(self.log_name("entropy_unmasked"), rest / rest_total if rest_total > 0 else math.nan)
        anchor = self.anchor
        if anchor is None:
            return None
        floor = self.floor_ratio * anchor
        violation = max(floor - selected, 0.0)
        if self.hinge == "aggregate":
            penalty = self.coefficient * violation**2
        else:
            penalty = self.coefficient * all_sum((entropy_floor_penalty(entropy, floor) * g).sum()).item() / g_total
        ctx.log(self.log_name("anchor"), anchor)
        ctx.log(self.log_name("floor"), floor)
        ctx.log(self.log_name("below_floor"), float(selected < floor))
        ctx.log(self.log_name("penalty"), penalty)
        return {"g": g, "g_total": g_total, "floor": floor, "violation": violation, "penalty": penalty}

    @override
    def extra_loss(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: MicroBatchContext) -> Tensor | None:
        view, rows = ctx.statistics_view()
        minibatch = view.once(self, lambda: self._minibatch_penalty(view, ctx))
        if minibatch is None:
            return None
        g, g_total, entropy = minibatch["g"][rows], minibatch["g_total"], ctx.entropy
        if self.hinge == "aggregate":
            # λ·relu(floor − H̄)² with H̄ = Σ g·H / Σ g over the minibatch on all ranks: its gradient on this
            # micro-batch's tokens is −2λ·relu(floor − H̄)·g_t/Σg, carried by a surrogate whose value is these
            # tokens' share of the penalty.
            local = (g * entropy).sum()
            term = -2 * self.coefficient * minibatch["violation"] * (local - local.detach()) / g_total
            return term + minibatch["penalty"] * g.sum() / g_total
        return self.coefficient * (entropy_floor_penalty(entropy, minibatch["floor"]) * g).sum() / g_total

    @override
    def on_update_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> None:
        # The anchor is the first K steps' H̄ under the policy each step starts from (its first micro-batch pass).
        if self.anchor_count < self.anchor_steps and self._step_selected:
            self.anchor_sum += self._step_selected[0]
            self.anchor_count += 1
        self._step_selected = []

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"anchor_sum": self.anchor_sum, "anchor_count": self.anchor_count}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.anchor_sum = float(state_dict["anchor_sum"])
        self.anchor_count = int(state_dict["anchor_count"])
