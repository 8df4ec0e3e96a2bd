"""HAPO: Hindsight-Aware Policy Optimization (He, Wu, Liu, …, Zhang; arXiv 2604.11056).

"Where hindsight credit can reside": the credit a token can carry is bounded by its entropy,
``I(o_t; R | o_{<t}) ≤ H_t``, so low-entropy tokens can hardly be responsible for the outcome. HAPO is a
sign-preserving change to GRPO that reallocates each response's advantage toward its high-capacity tokens:
``A'_{i,t} = A_i [(1 − λ) + λ H_{i,t} / H̄_i]`` with the behaviour policy's entropy, capped at ``m_max``
(:mod:`lightning_rlvr.algorithms.hindsight_credit`; the formula is ours — the paper's was not found,
ALGORITHMS.md §9.3/§13.5). Every token keeps its advantage's sign; each response keeps its total credit
``Σ_t A'_{i,t} = Σ_t A_i`` (exactly, for the sequence-level advantages of GRPO; for advantages an earlier
callback made per-token, the multipliers still average 1 per response).

The paper's Four Quadrant Decomposition is logged: reward polarity (``A > 0`` / ``A < 0``) × entropy
(``H ≥ τ``, ``τ`` the batch ``quadrant_quantile``-quantile of the behaviour entropy over all ranks). Per
quadrant ``q ∈ {pos_high, pos_low, neg_high, neg_low}``: ``hapo/share_<q>`` (token share), ``hapo/credit_<q>``
(share of ``Σ|A'|``: where the reallocation put the credit), ``hapo/flow_<q>`` (predicted first-order entropy
change ``Σ −A'(S − S̄)`` of the quadrant's tokens per batch token, ALGORITHMS.md §2.2; the flow of the shaped
advantages at the behaviour policy, before the PPO ratio and any engine importance weights: where the reallocation
pushes, not the applied update's flow, which OPEFO balances). Also
``hapo/multiplier_max`` and ``hapo/mass_ratio`` (``Σ|A'| / Σ|A|``: 1 up to rounding, as signs are kept).
A caution from a third-party note (§13.5): an unanchored posterior-shift credit collapsed entropy in the paper's
study; this reallocation keeps GRPO's per-response credit and only moves it between tokens.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from typing_extensions import override

from lightning_rlvr.algorithms.entropy_change import predicted_entropy_flow
from lightning_rlvr.algorithms.hindsight_credit import QUADRANTS, capacity_multipliers, entropy_quadrants
from lightning_rlvr.algorithms.selection import lower_quantile
from lightning_rlvr.callbacks.base import Intervention, Needs, StepContext
from lightning_rlvr.distributed import all_max, all_sum, gather_cat

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["HAPO"]


class HAPO(Intervention):
    """Capacity-guided, sign- and mass-preserving advantage reallocation within each response (arXiv 2604.11056).

    Args:
        strength: λ ∈ [0, 1): 0 = GRPO, larger moves more credit to high-entropy tokens.
        max_multiplier: cap ``m_max > 1`` on a token's multiplier.
        quadrant_quantile: entropy quantile that splits the high- and low-entropy quadrants (metrics only).

    Example::

        >>> from lightning_rlvr.callbacks import HAPO
        >>> HAPO(strength=0.5).needs.old_stats
        True
    """

    metric_prefix = "hapo"

    def __init__(self, strength: float = 0.5, max_multiplier: float = 3.0, quadrant_quantile: float = 0.8) -> None:
        if not 0 <= strength < 1:
            raise ValueError(f"HAPO: strength must be in [0, 1), got {strength}")
        if max_multiplier <= 1:
            raise ValueError(f"HAPO: max_multiplier must be > 1, got {max_multiplier}")
        if not 0 <= quadrant_quantile <= 1:
            raise ValueError(f"HAPO: quadrant_quantile must be in [0, 1], got {quadrant_quantile}")
        self.strength, self.max_multiplier = float(strength), float(max_multiplier)
        self.quadrant_quantile = float(quadrant_quantile)
        self.needs = Needs(old_stats=True, flow_stats=True)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(strength=self.strength, max_multiplier=self.max_multiplier,
                               quadrant_quantile=self.quadrant_quantile)

    @override
    def shape_advantages(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> Tensor:
        mask, entropy = ctx.mask, ctx.old_entropy.float()
        multipliers = capacity_multipliers(entropy, mask, self.strength, self.max_multiplier)
        shaped = ctx.advantages * multipliers
        self._log_quadrants(ctx, shaped, multipliers)
        return shaped

    def _log_quadrants(self, ctx: StepContext, shaped: Tensor, multipliers: Tensor) -> None:
        valid = ctx.mask > 0
        all_entropy, _ = gather_cat(ctx.old_entropy[valid].float())
        if all_entropy.numel() == 0:
            return
        quadrant = entropy_quadrants(ctx.advantages, ctx.old_entropy, lower_quantile(all_entropy, self.quadrant_quantile))
        flow = predicted_entropy_flow(shaped, ctx.old_logprobs, ctx.old_entropy, ctx.old_sbar)
        rows = []
        for q in range(len(QUADRANTS)):
            in_q = (quadrant == q) & valid
            rows.append(torch.stack([in_q.sum().float(), shaped[in_q].abs().sum(), flow[in_q].sum()]))
        totals = all_sum(torch.cat([torch.stack(rows).flatten(), torch.stack([
            valid.sum().float(), shaped[valid].abs().sum(), ctx.advantages[valid].abs().sum()
        ])]).double())
        per_quadrant = totals[:12].view(4, 3)
        n_valid, mass_after, mass_before = totals[12:15].tolist()
        credit = per_quadrant[:, 1].sum().item()
        for q, name in enumerate(QUADRANTS):
            count, abs_credit, flow_sum = per_quadrant[q].tolist()
            ctx.log(self.log_name(f"share_{name}"), count / n_valid)
            ctx.log(self.log_name(f"credit_{name}"), abs_credit / credit if credit > 0 else math.nan)
            ctx.log(self.log_name(f"flow_{name}"), flow_sum / n_valid)
        ctx.log(self.log_name("mass_ratio"), mass_after / mass_before if mass_before > 0 else math.nan)
        ctx.log(self.log_name("multiplier_max"), all_max(multipliers.amax()).item())
