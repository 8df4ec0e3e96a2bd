"""The update a training step applies equals the gradient of the objective written independently
(tests/reference_objective.py), in every aggregation mode, with and without KL, over several minibatches and PPO
epochs, with and without micro-batching, and with one intervention of each hook kind applied by hand.

The gradients are captured right before each optimizer step (a step pre-hook: after accumulation over the
micro-batches, before AdamW, which would hide any uniform scale error), together with the parameters they were
taken at; the reference recomputes everything in float64 from those parameters.
"""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
from lightning_rlvr.callbacks import Intervention
from lightning_rlvr.verifiers import CallableVerifier
from tests.conftest import ScriptedEngine
from tests.reference_objective import aggregate, completion_logprobs, group_advantages, kl_estimate, ppo_surrogate

PROMPTS, GROUP, TEMPERATURE = 4, 4, 0.7
EOS = 2


def digits(text: str) -> list[int]:
    return [4 + int(c) for c in text]  # '0' is token 4 in the tiny character tokenizer


# Completions of 1-4 tokens, some without EOS (truncated): the masks differ row to row.
SCRIPT = [digits("1") + [EOS], digits("23") + [EOS], digits("456"), digits("7") + [EOS], digits("89") + [EOS],
          digits("0") + [EOS], digits("12") + [EOS], digits("345") + [EOS], digits("6"), digits("78") + [EOS],
          digits("9") + [EOS], digits("01") + [EOS], digits("2345"), digits("6") + [EOS], digits("78") + [EOS],
          digits("901") + [EOS]]


def graded(completion: str, answer: str) -> float:
    """Non-binary, varied within every group."""
    return (len(completion) * 7 + sum(map(int, completion or "0"))) % 5 / 4


class Capture(pl.Callback):
    """Each optimizer step's parameters and gradients, and the rollout the step trained on."""

    def __init__(self) -> None:
        self.steps: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self.rollouts: list = []

    def on_train_start(self, trainer, pl_module) -> None:
        params = list(pl_module.policy.parameters())

        def record(optimizer, args, kwargs) -> None:
            self.steps.append(([p.detach().clone() for p in params], [p.grad.detach().clone() for p in params]))

        trainer.optimizers[0].register_step_pre_hook(record)
        original = trainer.datamodule.rollout

        def rollout(problems):
            batch = original(problems)
            self.rollouts.append(batch)
            return batch

        trainer.datamodule.rollout = rollout


# -- one intervention per hook kind, each with an effect the reference applies by hand ------------------------------
class SetEveryThirdReward(Intervention):
    def on_rollout(self, trainer, pl_module, batch):
        rewards = batch.rewards.clone()
        rewards[::3] = 1.0
        return dataclasses.replace(batch, rewards=rewards)


class PositionAdvantage(Intervention):
    def shape_advantages(self, trainer, pl_module, ctx):
        return ctx.advantages * (1 + 0.25 * torch.arange(ctx.mask.shape[1], device=ctx.mask.device))


class AlternatingWeights(Intervention):
    def token_weights(self, trainer, pl_module, mctx):
        return 0.5 + (torch.arange(mctx.mask.shape[1], device=mctx.mask.device) % 2).float().expand_as(mctx.mask)


class SquaredLogprobPenalty(Intervention):
    def extra_loss(self, trainer, pl_module, mctx):
        return 0.3 * mctx.aggregate(mctx.logprobs ** 2)


def fit(model_dir, monkeypatch, callbacks=(), ppo_epochs=1, minibatch_size=None, micro_batch_size=None,
        **module_kwargs):
    pl.seed_everything(0, verbose=False)
    capture = Capture()
    permutations: list[torch.Tensor] = []
    randperm = torch.randperm

    def recording_randperm(n, *args, **kwargs):
        out = randperm(n, *args, **kwargs)
        if n == PROMPTS * GROUP and "generator" not in kwargs:
            permutations.append(out.clone())  # the minibatch order of one PPO epoch
        return out

    monkeypatch.setattr(torch, "randperm", recording_randperm)
    data = RolloutDataModule(source=BuiltinTask("addition", warm_start_fraction=0.0), engine=ScriptedEngine(SCRIPT),
                             verifier=CallableVerifier(graded), prompts_per_step=PROMPTS, group_size=GROUP,
                             max_new_tokens=4, temperature=TEMPERATURE, val_samples=0, verifier_workers=1)
    module = RLVRModule(model=model_dir, learning_rate=5e-2, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                        ppo_epochs=ppo_epochs, minibatch_size=minibatch_size, micro_batch_size=micro_batch_size,
                        **module_kwargs)
    rows = PROMPTS * GROUP
    updates = ppo_epochs * -(-rows // (minibatch_size or rows))
    trainer = pl.Trainer(accelerator="cpu", max_steps=updates, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, callbacks=[*callbacks, capture])
    trainer.fit(module, data)
    assert len(capture.steps) == updates and len(capture.rollouts) == 1
    minibatches = [torch.arange(rows)] if updates == 1 else [
        chunk.sort().values for order in permutations for chunk in order.split(minibatch_size or rows)]
    assert len(minibatches) == updates
    return module, capture, minibatches


def reference_gradients(model_dir, module, capture, minibatches, hooks=()):
    """Per update: autograd of the reference objective at the parameters the update was taken at (float64)."""
    hp = module.hparams
    batch = capture.rollouts[0]
    rewards = batch.rewards.tolist()
    if "on_rollout" in hooks:
        rewards = [1.0 if i % 3 == 0 else r for i, r in enumerate(rewards)]
    mode = hp.advantage if hp.advantage == "rloo" else ("grpo" if hp.normalize_advantage_by_std else "dr_grpo")
    advantages = torch.tensor(group_advantages(rewards, batch.group_ids.tolist(), mode), dtype=torch.float64)
    mask = batch.response_mask.double()
    width = mask.shape[1]
    token_advantages = advantages[:, None].expand(-1, width)
    if "shape_advantages" in hooks:
        token_advantages = token_advantages * (1 + 0.25 * torch.arange(width, dtype=torch.float64))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    params = list(model.parameters())

    def logprobs_at(weights, rows, grad=False):
        with torch.no_grad():
            for p, w in zip(params, weights):
                p.copy_(w)
        with torch.set_grad_enabled(grad):
            return completion_logprobs(model, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length,
                                       TEMPERATURE)

    initial = [p.detach().clone() for p in params]  # the checkpoint: the reference model of the KL term
    behaviour = capture.steps[0][0]  # the parameters the rollout's policy had
    everything = torch.arange(len(batch))
    old = logprobs_at(behaviour, everything)
    reference = logprobs_at(initial, everything) if hp.kl_coef > 0 else None
    gradients = []
    for (weights, _), rows in zip(capture.steps, minibatches):
        logp = logprobs_at(weights, rows, grad=True)
        m = mask[rows]
        per_token = ppo_surrogate(logp, old[rows], token_advantages[rows], hp.clip_low, hp.clip_high, hp.dual_clip)
        if "token_weights" in hooks:
            per_token = per_token * (0.5 + (torch.arange(width) % 2).double())
        loss = aggregate(per_token, m, hp.loss_aggregation, hp.loss_scale_factor)
        if "extra_loss" in hooks:
            loss = loss + 0.3 * aggregate(logp ** 2, m, hp.loss_aggregation, hp.loss_scale_factor)
        if hp.kl_coef > 0:
            loss = loss + hp.kl_coef * aggregate(kl_estimate(logp, reference[rows], hp.kl_estimator), m,
                                                 hp.loss_aggregation, hp.loss_scale_factor)
        gradients.append(torch.autograd.grad(loss, params, allow_unused=True))
    return gradients


def assert_same_updates(captured, expected):
    for k, ((_, grads), reference) in enumerate(zip(captured, expected)):
        ours = torch.cat([g.flatten().double() for g in grads])
        theirs = torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(reference, grads)])
        assert theirs.norm() > 0
        error = ((ours - theirs).norm() / theirs.norm()).item()
        assert error <= 1e-5, f"update {k}: relative gradient error {error:.2e}"


SCHEDULES = {"one_update": dict(), "2_epochs_x_2_minibatches": dict(ppo_epochs=2, minibatch_size=8)}


@pytest.mark.parametrize("micro_batch_size", [None, 3], ids=["whole", "micro3"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kl_coef", [0.0, 0.1], ids=["no_kl", "kl"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                         "seq-mean-token-sum-norm"])
def test_the_applied_gradient_is_the_reference_objectives(tiny_model_dir, monkeypatch, aggregation, kl_coef, schedule,
                                                          micro_batch_size):
    module, capture, minibatches = fit(tiny_model_dir, monkeypatch, loss_aggregation=aggregation, kl_coef=kl_coef,
                                       micro_batch_size=micro_batch_size, **SCHEDULES[schedule])
    assert_same_updates(capture.steps, reference_gradients(tiny_model_dir, module, capture, minibatches))


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3+"])
def test_every_kl_estimator_enters_the_gradient_as_written(tiny_model_dir, monkeypatch, estimator):
    module, capture, minibatches = fit(tiny_model_dir, monkeypatch, kl_coef=0.3, kl_estimator=estimator,
                                       ppo_epochs=2, minibatch_size=8)
    assert_same_updates(capture.steps, reference_gradients(tiny_model_dir, module, capture, minibatches))


@pytest.mark.parametrize("advantage", [dict(advantage="rloo"), dict(normalize_advantage_by_std=False)],
                         ids=["rloo", "dr_grpo"])
def test_the_other_advantage_estimators_enter_the_gradient_as_written(tiny_model_dir, monkeypatch, advantage):
    module, capture, minibatches = fit(tiny_model_dir, monkeypatch, ppo_epochs=2, minibatch_size=8, **advantage)
    assert_same_updates(capture.steps, reference_gradients(tiny_model_dir, module, capture, minibatches))


HOOKS = {"on_rollout": SetEveryThirdReward, "shape_advantages": PositionAdvantage,
         "token_weights": AlternatingWeights, "extra_loss": SquaredLogprobPenalty}


@pytest.mark.parametrize("hooks", [[name] for name in HOOKS] + [list(HOOKS)], ids=list(HOOKS) + ["all_four"])
def test_each_intervention_hook_changes_the_update_as_the_reference_applies_it(tiny_model_dir, monkeypatch, hooks):
    callbacks = [HOOKS[name]() for name in hooks]
    module, capture, minibatches = fit(tiny_model_dir, monkeypatch, callbacks, ppo_epochs=2, minibatch_size=8,
                                       micro_batch_size=3, kl_coef=0.1)
    assert_same_updates(capture.steps, reference_gradients(tiny_model_dir, module, capture, minibatches, hooks))


def test_the_multi_update_schedule_exercises_the_clipped_branches(tiny_model_dir, monkeypatch):
    """Otherwise the surrogate's clip-higher and dual-clip terms would be compared only where they are inactive."""
    module, capture, minibatches = fit(tiny_model_dir, monkeypatch, ppo_epochs=2, minibatch_size=8)
    batch = capture.rollouts[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    ratios = []
    with torch.no_grad():
        for weights in (capture.steps[0][0], capture.steps[-1][0]):
            for p, w in zip(model.parameters(), weights):
                p.copy_(w)
            ratios.append(completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_length,
                                              TEMPERATURE))
    ratio = (ratios[1] - ratios[0]).exp()[batch.response_mask.bool()]
    assert (ratio > 1.28).any() and (ratio < 0.8).any()
