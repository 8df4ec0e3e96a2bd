"""Hand-built step / micro-batch contexts for calling intervention hooks without a Trainer."""

from __future__ import annotations

import functools

import torch

from lightning_rlvr.algorithms import aggregate_loss, ppo_clip_loss
from lightning_rlvr.callbacks import MicroBatchContext, StepContext
from lightning_rlvr.data.batch import RolloutBatch


def rollout_batch(rewards, mask, group_ids=None) -> RolloutBatch:
    mask = torch.as_tensor(mask, dtype=torch.float32)
    n, width = mask.shape
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    return RolloutBatch(
        input_ids=torch.zeros(n, width + 1, dtype=torch.long), attention_mask=torch.ones(n, width + 1),
        response_mask=mask, prompt_length=1, rewards=rewards, scores=rewards, correct=rewards > 0.5,
        truncated=torch.zeros(n, dtype=torch.bool),
        group_ids=torch.as_tensor(group_ids if group_ids is not None else [0] * n), policy_version=0, temperature=1.0,
    )


def step_context(rewards, mask, advantages=None, group_ids=None, old_logprobs=None, old_entropy=None) -> StepContext:
    batch = rollout_batch(rewards, mask, group_ids)
    mask = batch.response_mask
    if advantages is None:
        advantages = torch.zeros_like(mask)
    advantages = torch.as_tensor(advantages, dtype=torch.float32)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(mask)
    return StepContext(batch=batch, mask=mask, advantages=advantages.clone(), old_logprobs=old_logprobs,
                       old_entropy=old_entropy)


class WholeMinibatchContext(MicroBatchContext):
    """A micro-batch that is its whole minibatch, as the module builds it when it does not split a minibatch: its
    statistics view is built from its own fields when first asked (so a test may set them after construction)."""

    def statistics_view(self, scope="minibatch"):
        return super().statistics_view("micro_batch")


def micro_context(step: StepContext, logprobs, old_logprobs=None, entropy=None, clip_low=0.2, clip_high=0.2,
                  index=None, mode="token-mean", normalizer=None, old_entropy=None, sbar=None) -> MicroBatchContext:
    """A micro-batch context over rows ``index`` (default: all) of ``step`` (default normaliser: these rows')."""
    index = torch.arange(len(step.batch)) if index is None else torch.as_tensor(index)
    mask = step.mask[index]
    logprobs = torch.as_tensor(logprobs, dtype=torch.float32)
    old = logprobs.detach().clone() if old_logprobs is None else torch.as_tensor(old_logprobs, dtype=torch.float32)
    advantages = step.advantages[index]
    out = ppo_clip_loss(logprobs, old, advantages, clip_low, clip_high)
    entropy = torch.zeros_like(mask) if entropy is None else entropy
    ctx = WholeMinibatchContext(
        step=step, index=index, mask=mask, advantages=advantages, logprobs=logprobs, old_logprobs=old,
        entropy=entropy, ref_logprobs=None, policy_loss=out, weights=torch.ones_like(mask),
        aggregate=functools.partial(aggregate_loss, mask=mask, mode=mode, normalizer=normalizer),
        old_entropy=entropy if old_entropy is None else old_entropy, sbar=sbar,
    )
    return ctx
