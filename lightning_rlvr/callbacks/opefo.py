"""OPEFO: On-Policy Entropy Flow Optimization (Xu, Zhao, Wu, Luu; arXiv 2605.11491, ACL 2026 Findings).

Entropy-decreasing token updates outweigh entropy-increasing ones, so entropy drains. OPEFO predicts each
token's first-order entropy change ``c_t`` (ALGORITHMS.md §2.2, E3: ``c_t = −A_t r_t (S(a_t) − S̄_t)``, see
:mod:`lightning_rlvr.algorithms.entropy_change`), splits the tokens into ``S₊ = {c > 0}`` and
``S₋ = {c < 0}``, and reweights their policy-gradient loss by ``1 + λ`` and ``1 − λ`` with

.. math::
    λ^* = \\frac{F_- - F_+}{F_- + F_+}, \\qquad F_+ = \\sum_{S_+} c_t, \\quad F_- = \\sum_{S_-} |c_t|,

the closed form for zero net predicted flow, ``(1 + λ*)F₊ − (1 − λ*)F₋ = 0``, recomputed every batch
(ALGORITHMS.md §13.3, which overrides the derived design of §9.2). Tokens with ``c = 0`` (zero-advantage
groups, clipped tokens) keep weight 1. The paper trains *strictly on-policy* — one optimizer step per rollout
on the whole batch, so ``r = 1`` and the prediction is at the policy the step starts from; by default this
callback refuses other schedules and rollouts generated ahead (``Needs.on_policy``: no
``RolloutDataModule(max_policy_lag > 0)``); ``strict_on_policy=False`` allows them: flows then use the current
ratio and zero out clipped tokens, the §9.2 extension. With ``RLVRModule(engine_is_cap=...)`` each token's update
is also multiplied by its engine importance weight ``w``, so the flows balanced are ``w · c_t``: the applied update's
net predicted flow is zero (tested against the gradient of the applied loss).

Choices of ours, each an argument: ``flow="exact"`` uses E3; ``"onlyza"`` the sampled-logit-only estimate
``−A r π(1−π)(log π + H)``, likely the paper's Eq. 6, which a third-party review disputes (§13.3).
``coefficient="static"`` with ``static_lambda=1e-3`` and ``sides="increasing" | "decreasing"`` are the paper's
ablations (one-sided: only ``S₊`` gets ``1 + λ``, or only ``S₋`` gets ``1 − λ``). ``F₊``/``F₋`` are sums over
the minibatch's valid tokens on all ranks — the whole batch in the paper's strictly on-policy setting — whatever
``micro_batch_size`` is.

Metrics: ``opefo/lambda``, ``opefo/flow_up`` (F₊), ``opefo/flow_down`` (F₋), ``opefo/increasing_fraction``
(``|S₊| / (|S₊| + |S₋|)``), ``opefo/net_flow_weighted`` (``Σ (1 ± λ) w c`` over valid tokens: 0 for the default
rule).
The paper reports λ* small and positive (≈2.5e-4…1.75e-3 on Qwen models).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor
from typing_extensions import override

from lightning_rlvr.algorithms.entropy_change import balancing_coefficient, predicted_entropy_flow, sampled_logit_flow
from lightning_rlvr.callbacks.base import Intervention, MicroBatchContext, MinibatchView, Needs
from lightning_rlvr.distributed import all_sum

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["OPEFO"]


class OPEFO(Intervention):
    """Balance entropy-raising and entropy-lowering token updates to zero net predicted flow (arXiv 2605.11491).

    Args:
        flow: per-token prediction, ``"exact"`` (E3, full vocabulary) or ``"onlyza"`` (sampled logit only).
        coefficient: ``"adaptive"`` (λ* per batch, the paper) or ``"static"`` (``static_lambda``, an ablation).
        static_lambda: λ for ``coefficient="static"`` (1e-3 in the paper's ablation).
        sides: ``"both"`` (paper), ``"increasing"`` (only ``S₊`` reweighted) or ``"decreasing"`` (only ``S₋``).
        strict_on_policy: refuse a module with more than one optimizer step per rollout (paper's setting).

    Example::

        >>> from lightning_rlvr.callbacks import OPEFO
        >>> OPEFO().needs.flow_stats
        True
    """

    metric_prefix = "opefo"

    def __init__(self, flow: Literal["exact", "onlyza"] = "exact",
                 coefficient: Literal["adaptive", "static"] = "adaptive", static_lambda: float = 1e-3,
                 sides: Literal["both", "increasing", "decreasing"] = "both", strict_on_policy: bool = True) -> None:
        if flow not in ("exact", "onlyza"):
            raise ValueError(f"OPEFO: flow must be 'exact' or 'onlyza', got {flow!r}")
        if coefficient not in ("adaptive", "static"):
            raise ValueError(f"OPEFO: coefficient must be 'adaptive' or 'static', got {coefficient!r}")
        if not -1 < static_lambda < 1:
            raise ValueError(f"OPEFO: static_lambda must be in (-1, 1), got {static_lambda}")
        if sides not in ("both", "increasing", "decreasing"):
            raise ValueError(f"OPEFO: sides must be 'both', 'increasing' or 'decreasing', got {sides!r}")
        self.flow, self.coefficient, self.static_lambda = flow, coefficient, float(static_lambda)
        self.sides, self.strict_on_policy = sides, bool(strict_on_policy)
        # S̄ only for the exact flow; the sampled-logit estimate needs log π and H alone.
        self.needs = Needs(flow_stats=flow == "exact", minibatch_stats=True, on_policy=self.strict_on_policy)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(flow=self.flow, coefficient=self.coefficient, static_lambda=self.static_lambda,
                               sides=self.sides, strict_on_policy=self.strict_on_policy)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.strict_on_policy:
            return
        hp = pl_module.hparams
        data = trainer.datamodule
        rollout = getattr(data, "prompts_per_step", 0) * getattr(data, "group_size", 0)
        minibatch = hp.get("minibatch_size")
        if hp.get("ppo_epochs", 1) != 1 or (minibatch is not None and minibatch < rollout):
            raise ValueError(
                f"OPEFO(strict_on_policy=True) needs one optimizer step per rollout (model.ppo_epochs=1 and "
                f"model.minibatch_size unset or >= {rollout} completions); got ppo_epochs={hp.get('ppo_epochs')}, "
                f"minibatch_size={minibatch}. Pass strict_on_policy=False to allow several updates."
            )

    def token_flow(self, view: MinibatchView) -> Tensor:
        """Predicted entropy change per token (units of the step size), detached; 0 where the clip is active."""
        out = view.policy_loss
        clipped = out.clipped_high | out.clipped_low | out.dual_clipped
        if self.flow == "exact":
            return predicted_entropy_flow(view.advantages, view.logprobs, view.entropy, view.sbar, out.ratio, clipped)
        return sampled_logit_flow(view.advantages, view.logprobs, view.entropy, out.ratio, clipped)

    @override
    def token_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: MicroBatchContext) -> Tensor:
        view, rows = ctx.statistics_view()
        return view.once(self, lambda: self._weights(view, ctx))[rows]

    def _weights(self, view: MinibatchView, ctx: MicroBatchContext) -> Tensor:
        valid = view.valid
        # As applied: the loss multiplies each token by its engine importance weight too (engine_is_cap).
        flow = torch.where(valid, view.applied(self.token_flow(view)), torch.zeros_like(view.mask))
        up, down = flow > 0, flow < 0
        totals = all_sum(torch.stack([flow[up].sum(), -flow[down].sum(), up.sum().float(), down.sum().float()]))
        flow_up, flow_down, n_up, n_down = (t.item() for t in totals)
        lam = balancing_coefficient(flow_up, flow_down) if self.coefficient == "adaptive" else self.static_lambda
        weights = torch.ones_like(view.mask)
        if self.sides in ("both", "increasing"):
            weights = torch.where(up, weights * (1 + lam), weights)
        if self.sides in ("both", "decreasing"):
            weights = torch.where(down, weights * (1 - lam), weights)
        net = all_sum((weights * flow).sum()).item()
        ctx.log(self.log_name("lambda"), lam)
        ctx.log(self.log_name("flow_up"), flow_up)
        ctx.log(self.log_name("flow_down"), flow_down)
        ctx.log(self.log_name("increasing_fraction"), n_up / (n_up + n_down) if n_up + n_down else float("nan"))
        ctx.log(self.log_name("net_flow_weighted"), net)
        return weights
