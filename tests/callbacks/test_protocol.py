"""The intervention protocol inside RLVRModule: list order, needs, on_rollout, checkpointed state."""

from __future__ import annotations

import pytest
import torch

from lightning_rlvr import BuiltinTask, RLVRModule
from lightning_rlvr.callbacks import GTPO, AdaptiveEntropy, ClipCov, EntropyBonus, Intervention, Needs, TopEntropyTokens
from test_module import FixedRollout, frozen_rollout, trainer


def fixed(batch):
    return FixedRollout(batch, source=BuiltinTask("reverse", num_digits=3), val_samples=0)


class Recorder(Intervention):
    """Records what it sees at each hook (optionally asking for something)."""

    def __init__(self, name: str, needs: Needs = Needs()) -> None:
        self.name = name
        self.needs = needs
        self.seen: dict[str, object] = {}

    @property
    def state_key(self) -> str:
        return self._state_key(name=self.name)

    def shape_advantages(self, trainer, pl_module, ctx):
        self.seen["advantages"] = ctx.advantages.clone()
        self.seen["old_entropy"] = None if ctx.old_entropy is None else ctx.old_entropy.clone()

    def token_weights(self, trainer, pl_module, ctx):
        self.seen["weights"] = ctx.weights.clone()
        self.seen["entropy_requires_grad"] = ctx.entropy.requires_grad
        self.seen["ref"] = ctx.ref_logprobs

    def extra_loss(self, trainer, pl_module, ctx):
        self.seen["extra_keys"] = list(ctx.extra_losses)

    def on_update_end(self, trainer, pl_module, ctx):
        self.seen["old_logprobs_after"] = ctx.old_logprobs.clone()


def test_each_intervention_sees_the_previous_ones_in_list_order(tiny_model_dir, memory_logger):
    batch = frozen_rollout(tiny_model_dir)
    recorders = [Recorder(f"r{i}") for i in range(4)]
    gtpo, top, bonus = GTPO(), TopEntropyTokens(ratio=0.3, renormalize=False), EntropyBonus(coef=0.01)
    callbacks = [recorders[0], gtpo, recorders[1], top, recorders[2], bonus, recorders[3]]
    module = RLVRModule(model=tiny_model_dir)
    trainer(1, callbacks=callbacks, logger=memory_logger).fit(module, fixed(batch))
    r0, r1, r2, r3 = (r.seen for r in recorders)

    # advantages: r0 sees the outcome advantages, r1 GTPO's, computed from the old entropy GTPO asked for
    mask = batch.response_mask
    outcome = module.advantages(batch).unsqueeze(-1).expand_as(mask)
    torch.testing.assert_close(r0["advantages"], outcome)
    assert r0["old_entropy"] is not None  # forced by GTPO.needs although this is one on-policy update
    from lightning_rlvr.algorithms.gtpo import gtpo_advantages, gtpo_token_rewards
    shaped = gtpo_token_rewards(batch.rewards, r0["old_entropy"], mask, batch.group_ids)
    torch.testing.assert_close(r1["advantages"], gtpo_advantages(shaped, batch.rewards, mask, batch.group_ids))
    assert not torch.allclose(r1["advantages"], r0["advantages"])
    # weights: ones until TopEntropyTokens, its 0/1 mask afterwards
    assert (r0["weights"] == 1).all() and (r1["weights"] == 1).all()
    assert set(r2["weights"].unique().tolist()) == {0.0, 1.0}
    assert r2["weights"].sum() == pytest.approx(max(1, -(-0.3 * mask.sum().item() // 1)))
    # extra losses: r3 sees the bonus, r2 does not; the bonus needed entropy with gradient for everyone
    assert r2["extra_keys"] == [] and r3["extra_keys"] == [bonus.state_key]
    assert r0["entropy_requires_grad"]
    assert r0["ref"] is None
    assert "top_entropy/threshold" in memory_logger.history and "entropy_bonus/loss" in memory_logger.history
    assert "loss/interventions" in memory_logger.history


def test_without_needs_the_single_update_skips_old_stats_but_fills_them_after(tiny_model_dir):
    recorder = Recorder("plain")
    module = RLVRModule(model=tiny_model_dir)
    batch = frozen_rollout(tiny_model_dir)
    trainer(1, callbacks=[recorder]).fit(module, fixed(batch))
    assert recorder.seen["old_entropy"] is None
    assert not recorder.seen["entropy_requires_grad"]
    fresh = RLVRModule(model=tiny_model_dir)
    fresh.configure_model()
    expected = fresh.token_stats(fresh.policy, batch).logprobs * batch.response_mask
    torch.testing.assert_close(recorder.seen["old_logprobs_after"] * batch.response_mask, expected,
                               atol=1e-5, rtol=1e-5)


def test_a_callback_needing_reference_logprobs_loads_the_reference(tiny_model_dir):
    recorder = Recorder("ref", Needs(ref_logprobs=True))
    module = RLVRModule(model=tiny_model_dir, kl_coef=0.0)
    trainer(1, callbacks=[recorder]).fit(module, fixed(frozen_rollout(tiny_model_dir)))
    assert module.ref_model is not None and recorder.seen["ref"] is not None


def test_on_rollout_changes_the_rewards_the_step_learns_from(tiny_model_dir, memory_logger):
    class EqualRewards(Intervention):
        def on_rollout(self, trainer, pl_module, batch):
            batch.rewards = torch.ones_like(batch.rewards)
            return batch

    recorder = Recorder("after")
    module = RLVRModule(model=tiny_model_dir)
    trainer(1, callbacks=[EqualRewards(), recorder]).fit(module, fixed(frozen_rollout(tiny_model_dir)))
    assert recorder.seen["advantages"].abs().max() == 0  # all-equal rewards: no GRPO signal


def test_checkpoint_round_trip_restores_every_stateful_intervention(tiny_model_dir, tmp_path):
    def stack():
        return [ClipCov(ratio=0.5, seed=1), AdaptiveEntropy(target=10.0, step_size=1e-3),
                AdaptiveEntropy.aer(target=0.9)]

    batch = frozen_rollout(tiny_model_dir)
    first = stack()
    fit = trainer(3, callbacks=first, default_root_dir=tmp_path)
    fit.fit(RLVRModule(model=tiny_model_dir), fixed(batch))
    assert first[1].coef == pytest.approx(3e-3) and first[2].initial_entropy is not None
    path = tmp_path / "interventions.ckpt"
    fit.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["callbacks"]
    assert all(cb.state_key in saved for cb in first) and len({cb.state_key for cb in first}) == 3

    second = stack()
    resumed = trainer(3, callbacks=second, default_root_dir=tmp_path)  # max_steps reached: restore only
    resumed.fit(RLVRModule(model=tiny_model_dir), fixed(batch), ckpt_path=path)
    assert torch.equal(second[0].generator.get_state(), first[0].generator.get_state())
    for a, b in zip(first[1:], second[1:]):
        assert (a.coef, a.enabled, a.initial_entropy) == (b.coef, b.enabled, b.initial_entropy)
