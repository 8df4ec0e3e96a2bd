"""The update of one rollout step: its minibatches and micro-batches, the loss of a micro-batch, and the gradient's path
to the optimizer.

For each of ``ppo_epochs`` passes the rollout's rows are shuffled into minibatches (one optimizer step each), and each
minibatch is split into micro-batches whose losses share the minibatch's normaliser over all ranks, so accumulating
their gradients gives the minibatch's exactly. A micro-batch's loss is

    L = agg( clip(ρ, Â) · w_IS · w_hooks ) + Σ extra + β · agg( KL(π ‖ π_ref) )

with ``ρ = π/π_old`` (:func:`~lightning_rlvr.algorithms.ppo_clip_loss`), ``w_IS`` the engine importance weight
(:mod:`lightning_rlvr.algorithms.engine_correction`), ``w_hooks`` the interventions' token weights and ``extra`` their
loss terms (:mod:`lightning_rlvr.callbacks.base`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import Tensor

from lightning_rlvr.algorithms import (
    PolicyLossOutput,
    aggregate_loss,
    aggregation_normalizer,
    kl_penalty,
    ppo_clip_loss,
)
from lightning_rlvr.algorithms.engine_correction import engine_importance_weights
from lightning_rlvr.callbacks.base import MicroBatchContext, MinibatchView, StepContext
from lightning_rlvr.data.batch import RolloutBatch
from lightning_rlvr.distributed import all_sum
from lightning_rlvr.ops import TokenStats
from lightning_rlvr.sharding import global_grad_norm
from lightning_rlvr.training.hooks import minibatch_view
from lightning_rlvr.training.stats import UpdateStats

__all__ = ["GradientSync", "MicroBatch", "MicroBatchLoss", "Minibatch", "RolloutStep", "all_ranks_finite",
           "begin_step", "engine_correction", "log_engine_mismatch", "micro_batch_loss", "updates_per_rollout"]


@dataclass
class MicroBatch:
    """Rows of the rollout trained in one forward and backward."""

    index: Tensor  # rows of the rollout
    rows: Tensor  # their positions in the minibatch
    last: bool  # the minibatch's last micro-batch


@dataclass
class Minibatch:
    """Rows of the rollout that one optimizer step trains on."""

    index: Tensor  # rows of the rollout, sorted: a group's completions sit together and share their prompt forward
    mask: Tensor
    normalizer: Tensor  # of the loss aggregation, over all ranks
    n_tokens: Tensor  # valid tokens over all ranks
    micro_batch_size: int | None
    view: MinibatchView | None = None  # the statistics batch-level interventions select over

    @property
    def micro_batch_count(self) -> int:
        return math.ceil(len(self.index) / (self.micro_batch_size or len(self.index)))

    def micro_batches(self) -> Iterator[MicroBatch]:
        parts = self.index.split(self.micro_batch_size or len(self.index))
        first = 0
        for number, part in enumerate(parts):
            yield MicroBatch(part, torch.arange(first, first + len(part), device=part.device), number == len(parts) - 1)
            first += len(part)


@dataclass
class RolloutStep:
    """One rollout batch being learned from: its advantages, and what the update compares the policy with.

    ``old`` holds the behaviour policy's stats when they were computed before the update (several updates, or an
    intervention asked for them); on a single on-policy update they are the training forward's, detached, and ``seen``
    is filled micro-batch by micro-batch as it runs.
    """

    rollout: RolloutBatch
    ctx: StepContext
    old: TokenStats | None
    ref_logprobs: Tensor | None
    n_updates: int
    minibatch_size: int
    seen: TokenStats  # the old policy's stats as the update saw them

    def minibatches(self, hp: Any) -> Iterator[Minibatch]:
        """Every optimizer step's rows: ``hp.ppo_epochs`` shuffles (none for a single update) cut into minibatches,
        each with its loss normaliser and token count over all ranks (a collective)."""
        n, device = len(self.rollout), self.rollout.response_mask.device
        for _ in range(hp.ppo_epochs):
            order = torch.randperm(n, device=device) if self.n_updates > 1 else torch.arange(n, device=device)
            for index in order.split(self.minibatch_size):
                # In row order a group's completions sit together, so micro-batches share their prompt forward;
                # the minibatch's gradient is the same in any order.
                index = index.sort().values
                mask = self.rollout.response_mask[index]
                normalizer = all_sum(aggregation_normalizer(mask, hp.loss_aggregation, hp.loss_scale_factor))
                yield Minibatch(index, mask, normalizer, all_sum(mask.sum()), hp.micro_batch_size)

    def finished(self, updates_applied: int) -> StepContext:
        """The step's context as ``on_update_end`` sees it: the old policy's stats as the update saw them."""
        self.ctx.old_logprobs, self.ctx.old_entropy, self.ctx.old_sbar = self.seen.logprobs, self.seen.entropy, \
            self.seen.sbar
        self.ctx.updates_applied = updates_applied
        return self.ctx

    def outputs(self) -> dict[str, Tensor]:
        mask = self.rollout.response_mask
        return {"rewards": self.rollout.rewards.detach(), "entropy": self.seen.entropy.detach(),
                "mask": mask.detach()}


def updates_per_rollout(rows: int, hp: Any) -> tuple[int, int]:
    """``(minibatch size, optimizer steps)`` of a rollout of ``rows`` completions: ``ppo_epochs × ⌈rows / size⌉``."""
    minibatch = min(hp.minibatch_size or rows, rows)
    return minibatch, hp.ppo_epochs * math.ceil(rows / minibatch)


def begin_step(module: Any, rollout: RolloutBatch, advantages: Tensor, step_number: int) -> RolloutStep:
    """Outcome advantages on every response token, and the behaviour policy's and the reference's stats without
    gradient when the update or an intervention needs them."""
    hp, needs = module.hparams, module.hooks.needs
    mask = rollout.response_mask
    minibatch, n_updates = updates_per_rollout(len(rollout), hp)
    on_policy_single_update = n_updates == 1
    old = (None if on_policy_single_update and not needs.old_stats
           else module.scorer.behaviour_stats(module.policy, rollout, with_sbar=needs.flow_stats))
    ref_logprobs = module.reference_logprobs(rollout) if hp.kl_coef > 0 or needs.ref_logprobs else None
    ctx = StepContext(
        batch=rollout, mask=mask, advantages=advantages.unsqueeze(-1).expand_as(mask).contiguous(),
        old_logprobs=None if old is None else old.logprobs, old_entropy=None if old is None else old.entropy,
        old_sbar=None if old is None else old.sbar, ref_logprobs=ref_logprobs, step=step_number,
        aggregation=hp.loss_aggregation,
    )
    seen = (TokenStats(torch.zeros_like(mask), torch.zeros_like(mask),
                       torch.zeros_like(mask) if needs.flow_stats else None) if old is None
            else TokenStats(old.logprobs, old.entropy, old.sbar if needs.flow_stats else None))
    return RolloutStep(rollout, ctx, old, ref_logprobs, n_updates, minibatch, seen)


@dataclass
class MicroBatchLoss:
    """A micro-batch's loss and the parts the step's statistics are made of."""

    loss: Tensor
    pg_loss: Tensor
    kl_loss: Tensor | None
    policy_loss: PolicyLossOutput
    old_logprobs: Tensor
    logprobs: Tensor
    mask: Tensor


def micro_batch_loss(module: Any, step: RolloutStep, minibatch: Minibatch, micro: MicroBatch,
                     stats: UpdateStats) -> MicroBatchLoss:
    """The forward of one micro-batch and its loss (the module docstring's ``L``)."""
    hp, needs, hooks = module.hparams, module.hooks.needs, module.hooks
    rollout, old, index = step.rollout, step.old, micro.index
    clip = hp.clip_low, hp.clip_high, hp.dual_clip
    unchanged = module.policy_version == rollout.policy_version  # no update applied yet this step
    engine_logprobs = rollout.engine_logprobs

    def correction(old_logprobs: Tensor, rows: Tensor, mask: Tensor, **counted) -> Tensor | None:
        return engine_correction(hp, old_logprobs, None if engine_logprobs is None else engine_logprobs[rows], mask,
                                 **counted)

    if hooks and needs.minibatch_stats and minibatch.view is None and minibatch.micro_batch_count > 1:
        # Batch-level intervention statistics over the whole minibatch, whatever the micro-batch size.
        minibatch.view = minibatch_view(module.scorer, module.policy, rollout, minibatch.index,
                                        step.ctx.advantages[minibatch.index], old, needs, unchanged, clip, correction)
    token_stats = module.token_stats(module.policy, rollout.select(index), entropy_grad=needs.entropy_grad,
                                     with_sbar=needs.flow_stats, nucleus_top_p=needs.nucleus_top_p)
    # On the single on-policy update the current policy *is* the behaviour policy.
    old_logprobs = token_stats.logprobs.detach() if old is None else old.logprobs[index]
    old_entropy = token_stats.entropy.detach() if old is None else old.entropy[index]
    if old is None:
        step.seen.entropy[index] = old_entropy
        step.seen.logprobs[index] = old_logprobs
        if step.seen.sbar is not None:
            step.seen.sbar[index] = token_stats.sbar
    mask = rollout.response_mask[index]
    advantages = step.ctx.advantages[index]
    surrogate = ppo_clip_loss(token_stats.logprobs, old_logprobs, advantages, *clip)
    weight = None
    if rollout.engine_logprobs is not None:
        log_engine_mismatch(old_logprobs, rollout.engine_logprobs[index], mask, minibatch.n_tokens, stats)
        weight = correction(old_logprobs, index, mask, stats=stats, n_tokens=minibatch.n_tokens)
    policy_loss = surrogate if weight is None else dataclasses.replace(surrogate, loss=surrogate.loss * weight)
    aggregate = functools.partial(aggregate_loss, mask=mask, mode=hp.loss_aggregation, normalizer=minibatch.normalizer)
    ref_logprobs = None if step.ref_logprobs is None else step.ref_logprobs[index]
    if hooks:
        if needs.minibatch_stats and minibatch.view is None:  # one micro-batch: it is the minibatch
            minibatch.view = minibatch_view(module.scorer, module.policy, rollout, index, advantages, old, needs,
                                            unchanged, clip, lambda *_: weight, stats=token_stats,
                                            policy_loss=surrogate)
        mctx = MicroBatchContext(
            step=step.ctx, index=index, mask=mask, advantages=advantages, logprobs=token_stats.logprobs,
            old_logprobs=old_logprobs, entropy=token_stats.entropy, old_entropy=old_entropy, sbar=token_stats.sbar,
            nucleus_entropy=token_stats.nucleus_entropy, top2_gap=token_stats.top2_gap, ref_logprobs=ref_logprobs,
            policy_loss=surrogate, weights=torch.ones_like(mask), aggregate=aggregate, minibatch=minibatch.view,
            rows=micro.rows, share_scale=minibatch.micro_batch_count * module.trainer.world_size, engine_weights=weight,
        )
        pg_loss, extra = hooks.policy_loss_and_extra(mctx)
        stats.add_extra(extra)
        loss = pg_loss + extra
    else:
        pg_loss = aggregate(policy_loss.loss)
        loss = pg_loss
    kl_loss = None
    if hp.kl_coef > 0:
        kl = kl_penalty(token_stats.logprobs, ref_logprobs, hp.kl_estimator)
        kl_loss = aggregate_loss(kl, mask, hp.loss_aggregation, minibatch.normalizer)
        loss = loss + hp.kl_coef * kl_loss
    return MicroBatchLoss(loss, pg_loss, kl_loss, policy_loss, old_logprobs, token_stats.logprobs, mask)


def log_engine_mismatch(old_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, n_tokens: Tensor,
                        stats: UpdateStats) -> None:
    """``rollout/engine_kl``: the k1 estimate of KL(π_engine ‖ π_old) on the sampled tokens,
    mean(log π_engine − log π_old)."""
    with torch.no_grad():
        log_ratio = old_logprobs.detach() - engine_logprobs
        stats.add_engine_kl(((-log_ratio * mask).sum() / n_tokens.clamp_min(1)).item())


def engine_correction(hp: Any, old_logprobs: Tensor, engine_logprobs: Tensor | None, mask: Tensor,
                      stats: UpdateStats | None = None, n_tokens: Tensor | None = None) -> Tensor | None:
    """With ``engine_is_cap``, the importance weight (detached) of each token, as ``engine_is_mode`` says
    (:func:`~lightning_rlvr.algorithms.engine_correction.engine_importance_weights`): the rollout was sampled by the
    engine, not by the policy the PPO ratio is taken against. ``None`` without a correction or engine log-probs.
    With ``stats``, ``policy/tis_clipfrac`` / ``policy/mis_maskfrac`` (the share of tokens capped / dropped among
    the minibatch's ``n_tokens``) is counted.
    """
    if hp.engine_is_cap is None or engine_logprobs is None:
        return None
    with torch.no_grad():
        weight, affected = engine_importance_weights(old_logprobs.detach(), engine_logprobs, mask,
                                                     hp.engine_is_cap, hp.engine_is_mode)
        if stats is not None:
            stats.add_engine_correction((affected.float().sum() / n_tokens.clamp_min(1)).item(),
                                        hp.engine_is_mode.endswith("truncate"))
    return weight


class GradientSync:
    """Where the gradient lives between backward and the optimizer: with Lightning's DDP and FSDP2 in the parameters'
    ``.grad`` (this module clips it), with DeepSpeed in the engine's partitions (DeepSpeed clips and norms it)."""

    def __init__(self, strategy: Any) -> None:
        self.deepspeed = strategy.deepspeed_engine if isinstance(strategy, DeepSpeedStrategy) else None

    def next_micro_batch(self) -> None:
        """Tell DeepSpeed a new micro-batch starts, as ``DeepSpeedEngine.forward`` does at each of its calls.

        The policy runs inside one engine forward (``training_step``), so the engine never sees the micro-batches:
        ZeRO-3 counts them (its ``micro_step_id`` moves only here) to add each micro-batch's reduced gradient to the
        partition instead of overwriting it. Measured on one GPU: without this, ZeRO-3 kept only the last of 4
        micro-batches' gradients (scripts/gpu_check_strategies.py).
        """
        clear = getattr(getattr(self.deepspeed, "optimizer", None), "clear_backward_seen_flag", None)
        if callable(clear):
            clear()

    def before_backward(self, last_micro_batch: bool) -> None:
        if self.deepspeed is not None:
            # DeepSpeed reduces (ZeRO: partitions) gradients at an accumulation boundary, and with Lightning's
            # gradient_accumulation_steps=1 every backward would be one: micro-batches after the first would
            # overwrite, not add to, the reduced gradient.
            self.deepspeed.set_gradient_accumulation_boundary(last_micro_batch)

    @property
    def clips_itself(self) -> bool:
        return self.deepspeed is not None

    def norm_before_step(self, finite: bool, parameters: list[torch.nn.Parameter]) -> Tensor:
        """The global gradient norm (NaN after a non-finite loss); DeepSpeed's is known only after its step."""
        if self.deepspeed is not None:
            return torch.tensor(0.0 if finite else float("nan"))
        return global_grad_norm(parameters) if finite else torch.tensor(float("nan"))

    def norm_after_step(self, norm: Tensor) -> Tensor:
        """The global gradient norm DeepSpeed computed in its last step (before clipping; NaN if it kept none)."""
        if self.deepspeed is None:
            return norm
        value = self.deepspeed.get_global_grad_norm()
        return torch.tensor(float("nan") if value is None else float(value))


def all_ranks_finite(loss: Tensor) -> bool:
    """Whether the loss is finite on every rank (a collective every rank must run)."""
    return all_sum(torch.tensor(0.0 if torch.isfinite(loss) else 1.0, device=loss.device)).item() == 0
