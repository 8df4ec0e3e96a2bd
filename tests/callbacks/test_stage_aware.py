"""StageDetector, the stage gate, PerplexityShaping and PositionShaping as callbacks (hooks called directly)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_rlvr.algorithms.stage_shaping import group_iqr_zscores, response_log_perplexity
from lightning_rlvr.callbacks import (
    ActivationGate,
    ClipCov,
    PerplexityShaping,
    PositionShaping,
    StageDetector,
    StageGated,
    TopEntropyTokens,
)

from .helpers import micro_context, step_context


def trainer_with(*callbacks):
    return SimpleNamespace(callbacks=list(callbacks))


def plateau_detector(transition: int = 10) -> StageDetector:
    detector = StageDetector()
    detector.detector.transition = transition
    return detector


def ppl_case():
    """Two groups of four; group 0's log-perplexities are 0.5, 1, 1.5, 2 (mean 1.25, pop. std √0.3125)."""
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 8)
    nll = torch.tensor([0.5, 1.0, 1.5, 2.0, 1.0, 1.0, 1.0, 1.0])
    old_logprobs = -nll.unsqueeze(-1).expand(8, 3).clone()
    rewards = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    return step_context(rewards, mask, advantages=adv, group_ids=groups, old_logprobs=old_logprobs), nll


def test_perplexity_shaping_by_hand_low_ppl_amplified_for_both_signs():
    ctx, nll = ppl_case()
    shaped = PerplexityShaping(alpha=0.1).shape_advantages(trainer_with(), None, ctx)
    z0 = (torch.tensor([0.5, 1.0, 1.5, 2.0]) - 1.25) / 0.3125 ** 0.5
    w0 = (1 - 0.1 * z0).clamp(0.8, 1.2)
    expected = torch.cat([w0 * ctx.advantages[:4, 0], ctx.advantages[4:, 0]])  # group 1: std 0 -> z 0, w 1
    torch.testing.assert_close(shaped[:, 0], expected)
    assert torch.equal(torch.sign(shaped), torch.sign(ctx.advantages))
    assert shaped[0, 0] > 1 and shaped[3, 0] > -1  # lowest PPL amplified (positive), highest attenuated (negative)
    assert ctx.metrics.means()["ppl_shaping/weight_max"] == pytest.approx(w0.max().item())


def test_perplexity_shaping_preserve_mass_keeps_each_groups_signed_mass():
    ctx, _ = ppl_case()
    shaped = PerplexityShaping(alpha=0.1, preserve_mass=True).shape_advantages(trainer_with(), None, ctx)
    for rows in (slice(0, 4), slice(4, 8)):
        a, s, m = ctx.advantages[rows], shaped[rows], ctx.mask[rows]
        for sign in (1, -1):
            pick = (torch.sign(a) == sign) * m
            assert (s * pick).sum().item() == pytest.approx((a * pick).sum().item(), rel=1e-5)
    assert not torch.allclose(shaped, ctx.advantages)  # mass kept, but moved between responses


def test_position_shaping_absolute_window_is_the_authors_steps_201_to_299():
    shaping = PositionShaping(active_steps=(200, 299), active_fraction=None)
    trainer = trainer_with()
    for step, active in ((199, False), (200, True), (298, True), (299, False)):
        shaping.gate._cached = None
        assert shaping.gate.active(trainer, step) is active


def planned_trainer(rollout_steps: int, *callbacks):
    module = SimpleNamespace(planned_rollout_steps=lambda: rollout_steps)
    return SimpleNamespace(callbacks=list(callbacks), lightning_module=module)


@pytest.mark.parametrize(("total", "first", "last"), [(600, 200, 299), (4500, 1500, 2249), (800, 267, 399)])
def test_position_shaping_default_window_is_a_third_to_a_half_of_the_run(total, first, last):
    """The authors' window 200 < verl step < 300 of 600 carried to any length: round(N/3) <= step < round(N/2)."""
    shaping = PositionShaping()
    with pytest.raises(RuntimeError, match="not resolved"):
        shaping.gate.active(trainer_with(), 0)
    trainer = planned_trainer(total)
    shaping.setup(trainer, None, "fit")
    for step, active in ((first - 1, False), (first, True), (last, True), (last + 1, False)):
        shaping.gate._cached = None
        assert shaping.gate.active(trainer, step) is active


def test_fraction_and_absolute_windows_exclude_each_other():
    with pytest.raises(ValueError, match="not both"):
        PositionShaping(active_steps=(200, 299))
    with pytest.raises(ValueError, match="0 <= a < b <= 1"):
        PerplexityShaping(active_fraction=(0.5, 1.5))
    gated = StageGated(ClipCov(), active_in="always", active_fraction=(0.0, 0.1))
    gated.setup(planned_trainer(50), None, "fit")
    assert gated.gate.resolved_steps == (0, 5)


def test_planned_rollout_steps_counts_optimizer_steps_per_rollout():
    """1600 optimizer steps at 16 prompts x 8 samples in minibatches of 48, two epochs: 2 x ceil(128/48) = 6 per
    rollout -> ceil(1600 / 6) = 267 rollout steps."""
    from lightning_rlvr import RLVRModule

    module = RLVRModule(model="builtin:tiny", minibatch_size=48, ppo_epochs=2)
    module._trainer = SimpleNamespace(max_steps=1600, datamodule=SimpleNamespace(prompts_per_step=16, group_size=8))
    assert module.planned_rollout_steps() == 267
    module._trainer.max_steps = -1
    with pytest.raises(RuntimeError, match="run length is unknown"):
        module.planned_rollout_steps()


def test_position_shaping_entropy_quantile_restricts_the_bonus():
    mask = torch.ones(2, 4)
    entropy = torch.tensor([[0.1, 2.0, 0.2, 3.0], [0.3, 0.4, 5.0, 0.5]])
    ctx = step_context([1.0, 0.0], mask, advantages=torch.tensor([1.0, -1.0]), old_entropy=entropy)
    shaped = PositionShaping(active_steps=None, active_fraction=None, entropy_quantile=0.75).shape_advantages(trainer_with(), None, ctx)
    # 8 tokens, lower order statistic at index int(0.75 * 7) = 5 of the sorted entropies -> 2.0: three tokens
    changed = shaped != ctx.advantages
    assert changed.tolist() == [[False, True, False, True], [False, False, True, False]]
    assert ctx.metrics.means()["position_shaping/selected_fraction"] == pytest.approx(3 / 8)
    assert PositionShaping(entropy_quantile=0.8).needs.old_stats and not PositionShaping().needs.old_stats


def test_position_shaping_preserve_mass_moves_credit_to_the_end():
    ctx = step_context([1.0], torch.ones(1, 4), advantages=torch.tensor([0.5]))
    shaped = PositionShaping(active_steps=None, active_fraction=None, preserve_mass=True).shape_advantages(trainer_with(), None, ctx)
    assert shaped.sum().item() == pytest.approx(2.0)
    assert (shaped[0, 1:] > shaped[0, :-1]).all()
    assert ctx.metrics.means()["position_shaping/mass_ratio"] == pytest.approx(1.0)


def test_gate_on_the_detected_stage_and_missing_detector():
    ctx, _ = ppl_case()
    shaping = PerplexityShaping(active_in="plateau")
    assert shaping.shape_advantages(trainer_with(StageDetector()), None, ctx) is None
    ctx.step = 1
    assert shaping.shape_advantages(trainer_with(plateau_detector()), None, ctx) is not None
    assert ctx.metrics.means()["ppl_shaping/active"] == 0.5
    with pytest.raises(RuntimeError, match="exactly one StageDetector"):
        shaping.setup(trainer_with(), None, "fit")
    with pytest.raises(RuntimeError, match="found 2"):
        PositionShaping(active_in="rising").setup(trainer_with(StageDetector(), StageDetector()), None, "fit")


def test_gate_decides_once_per_step():
    detector = StageDetector()
    gate = ActivationGate("test", active_in="plateau")
    trainer = trainer_with(detector)
    assert not gate.active(trainer, 7)
    detector.detector.transition = 3  # the detector switches during step 7 (its on_update_end)
    assert not gate.active(trainer, 7)
    assert gate.active(trainer, 8)


def test_stage_gated_wraps_any_intervention():
    mask = torch.ones(2, 3)
    entropy = torch.tensor([[0.1, 0.9, 0.3], [0.2, 0.8, 0.4]])
    step = step_context([1.0, 0.0], mask, advantages=torch.tensor([1.0, -1.0]))
    ctx = micro_context(step, torch.zeros(2, 3), entropy=entropy)
    inner = TopEntropyTokens(ratio=0.5)
    gated = StageGated(inner, active_in="plateau")
    assert gated.token_weights(trainer_with(StageDetector()), None, ctx) is None
    step.step = 1
    torch.testing.assert_close(gated.token_weights(trainer_with(plateau_detector()), None, ctx),
                               inner.token_weights(None, None, ctx))
    clip = ClipCov(seed=3)
    wrapped = StageGated(clip)
    assert wrapped.needs == clip.needs and wrapped.state_dict().keys() == clip.state_dict().keys()
    assert "ClipCov" in wrapped.state_key
    with pytest.raises(TypeError):
        StageGated(object())


def test_stage_detector_callback_updates_and_checkpoints():
    detector = StageDetector(min_segment=10, patience=3, reward_flatness=None)
    mask = torch.ones(4, 2)
    for step in range(60):
        level = 1.0 - 0.02 * min(step, 20)
        ctx = step_context([1.0, 0.0, 0.0, 0.0], mask, old_entropy=torch.full((4, 2), level))
        ctx.step = step
        detector.on_update_end(None, None, ctx)
    assert detector.stage == "plateau" and detector.transition_step == 20
    assert ctx.metrics.means()["stage/plateau"] == 1.0
    assert ctx.metrics.means()["stage/transition_step"] == 20.0
    restored = StageDetector(min_segment=10, patience=3, reward_flatness=None)
    restored.load_state_dict(detector.state_dict())
    assert restored.plateau and restored.confirmed_step == detector.confirmed_step


@pytest.mark.parametrize(("cls", "kwargs", "match"), [
    (PerplexityShaping, {"alpha": 0}, "alpha"), (PerplexityShaping, {"weight_range": (1.1, 1.2)}, "weight_range"),
    (PerplexityShaping, {"favour": "mid"}, "favour"), (PerplexityShaping, {"active_in": "late"}, "active_in"),
    (PositionShaping, {"cap": 1.0}, "cap"), (PositionShaping, {"active_steps": (5, 5)}, "active_steps"),
    (PositionShaping, {"entropy_quantile": 1.0}, "entropy_quantile"), (StageDetector, {"patience": 0}, "patience"),
])
def test_invalid_arguments_fail_at_construction(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_ppl_helpers_agree_with_the_callback_inputs():
    ctx, nll = ppl_case()
    torch.testing.assert_close(response_log_perplexity(ctx.old_logprobs, ctx.mask), nll)
    z, _ = group_iqr_zscores(nll, ctx.batch.group_ids)
    assert z[4:].abs().max() == 0


def test_detector_state_key_is_unchanged_at_the_default_reward_confidence():
    """Checkpoints saved before reward_confidence existed still find the detector's state."""
    assert "reward_confidence" not in StageDetector().state_key
    assert StageDetector(reward_confidence=1.0).state_key != StageDetector().state_key
