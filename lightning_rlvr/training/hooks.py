"""Calling the interventions' hooks at their points of a step, in list order (:mod:`lightning_rlvr.callbacks.base`).

The five hooks, their order and what each may change are the protocol's; this file only calls them, checks what they
return, and builds the minibatch statistics that batch-level interventions select over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_rlvr.algorithms import PolicyLossOutput, ppo_clip_loss
from lightning_rlvr.callbacks.base import Intervention, MicroBatchContext, MinibatchView, Needs, StepContext, detached
from lightning_rlvr.data.batch import RolloutBatch
from lightning_rlvr.ops import TokenStats
from lightning_rlvr.training.token_stats import PolicyScorer, engine_behaviour_stats

__all__ = ["InterventionRunner", "minibatch_view"]


class InterventionRunner:
    """The trainer's :class:`~lightning_rlvr.callbacks.base.Intervention` callbacks, and the union of their needs,
    fixed for one fit.

    Args:
        trainer: the Trainer whose callbacks are searched (``None``: no interventions).
        module: the LightningModule passed to every hook.
    """

    def __init__(self, trainer: Any, module: Any) -> None:
        self.trainer = trainer
        self.module = module
        self.interventions: list[Intervention] = [
            cb for cb in getattr(trainer, "callbacks", None) or [] if isinstance(cb, Intervention)]
        self.needs = Needs()
        for cb in self.interventions:
            self.needs = self.needs | cb.needs

    def __bool__(self) -> bool:
        return bool(self.interventions)

    def on_rollout(self, rollout: RolloutBatch) -> RolloutBatch:
        for cb in self.interventions:
            rollout = cb.on_rollout(self.trainer, self.module, rollout) or rollout
        return rollout

    def shape_advantages(self, ctx: StepContext) -> Tensor:
        """``ctx.advantages`` after every callback's shaping (each sees the previous one's, detached)."""
        for cb in self.interventions:
            shaped = cb.shape_advantages(self.trainer, self.module, ctx)
            if shaped is not None:
                if shaped.shape != ctx.mask.shape:
                    raise ValueError(f"{type(cb).__name__}.shape_advantages returned shape {tuple(shaped.shape)}, "
                                     f"expected {tuple(ctx.mask.shape)}")
                ctx.advantages = shaped.detach()
        return ctx.advantages

    def policy_loss_and_extra(self, mctx: MicroBatchContext) -> tuple[Tensor, Tensor]:
        """Token weights then extra loss terms, each callback in list order: ``(pg_loss, Σ extra)``."""
        for cb in self.interventions:
            factor = cb.token_weights(self.trainer, self.module, mctx)
            if factor is not None:
                mctx.weights = mctx.weights * factor.detach()
        loss = mctx.policy_loss.loss
        if mctx.engine_weights is not None:
            loss = loss * mctx.engine_weights
        pg_loss = mctx.aggregate(loss * mctx.weights)
        extra = torch.zeros((), device=pg_loss.device, dtype=pg_loss.dtype)
        for cb in self.interventions:
            term = cb.extra_loss(self.trainer, self.module, mctx)
            if term is not None:
                mctx.extra_losses[cb.state_key] = term
                extra = extra + term
        return pg_loss, extra

    def on_update_end(self, ctx: StepContext) -> None:
        for cb in self.interventions:
            cb.on_update_end(self.trainer, self.module, ctx)


def minibatch_view(scorer: PolicyScorer, policy: torch.nn.Module, rollout: RolloutBatch, rows: Tensor,
                   advantages: Tensor, old: TokenStats | None, needs: Needs, unchanged: bool, clip: tuple,
                   engine_weights: Callable[[Tensor, Tensor, Tensor], Tensor | None],
                   stats: TokenStats | None = None, policy_loss: PolicyLossOutput | None = None) -> MinibatchView:
    """The statistics of minibatch ``rows`` that batch-level interventions select over.

    From the training forward when the minibatch is one micro-batch (``stats``, ``policy_loss`` given); before the
    step's first update (``unchanged``), from the behaviour stats the engine computed while decoding (the same
    policy); otherwise from one no-grad pass over the minibatch at the current parameters, in micro-batch-sized
    chunks (the same rows as the training forward's, so the same values), before its micro-batches are trained on.
    ``clip`` is the surrogate's ``(clip_low, clip_high, dual_clip)``; ``engine_weights(old_logprobs, rows, mask)`` the
    engine importance weights of those rows (``None`` without a correction), the same the loss applies.
    """
    if stats is None and unchanged and needs.nucleus_top_p is None:
        stats = engine_behaviour_stats(rollout, needs.flow_stats, rows)
    if stats is None:
        stats = scorer.no_grad_stats(policy, rollout.select(rows), with_sbar=needs.flow_stats,
                                     nucleus_top_p=needs.nucleus_top_p)
    logprobs = stats.logprobs.detach()
    old_logprobs = logprobs if old is None else old.logprobs[rows]
    old_entropy = stats.entropy.detach() if old is None else old.entropy[rows]
    if policy_loss is None:
        policy_loss = ppo_clip_loss(logprobs, old_logprobs, advantages, *clip)
    sbar = None if stats.sbar is None else stats.sbar.detach()
    mask = rollout.response_mask[rows]
    return MinibatchView(mask=mask, advantages=advantages, logprobs=logprobs,
                         old_logprobs=old_logprobs, entropy=stats.entropy.detach(), old_entropy=old_entropy,
                         policy_loss=detached(policy_loss), sbar=sbar,
                         nucleus_entropy=stats.nucleus_entropy, top2_gap=stats.top2_gap,
                         engine_weights=engine_weights(old_logprobs, rows, mask))
