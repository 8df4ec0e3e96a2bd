"""AdaptiveEntropy: the Skywork-OR1 controller step by step, the gate, and the AER options."""

import pytest
import torch

from lightning_rlvr.callbacks import AdaptiveEntropy

from .helpers import micro_context, step_context


def finished_step(nll: float, entropy: float = 1.0, correct=(1, 0, 0, 0)):
    mask = torch.ones(len(correct), 3)
    return step_context(list(correct), mask, old_logprobs=torch.full_like(mask, -nll),
                        old_entropy=torch.full_like(mask, entropy))


def test_skywork_controller_follows_the_reference_loop():
    cb = AdaptiveEntropy(target=0.2, init_coef=0.0, step_size=1e-4, max_coef=3e-4)
    measured = [0.5, 0.1, 0.1, 0.1, 0.1, 0.3, 0.1]
    coef, enabled, realized = 0.0, True, []
    for h in measured:
        step = finished_step(h)
        cb.on_update_end(None, None, step)
        realized.append(step.metrics.means()["adaptive_entropy/coef"])
        expected_realized = coef * enabled
        coef = min(max(coef + 1e-4 if h < 0.2 else coef - 1e-4, 0.0), 3e-4)
        enabled = h < 0.2
        assert realized[-1] == pytest.approx(expected_realized)
        assert cb.coef == pytest.approx(coef) and cb.enabled == enabled
    assert max(realized) == pytest.approx(3e-4)  # clipped at max_coef


def test_the_bonus_is_applied_with_the_realized_coefficient():
    cb = AdaptiveEntropy(target=0.2, init_coef=2e-3)
    mask = torch.ones(2, 2)
    entropy = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    ctx = micro_context(step_context([1, 0], mask), -torch.ones(2, 2), entropy=entropy)
    assert cb.extra_loss(None, None, ctx).item() == pytest.approx(-2e-3 * 2.5)
    cb.enabled = False  # entropy above target: gated off
    assert cb.extra_loss(None, None, ctx) is None


def test_aer_anchors_the_target_on_the_first_step_and_weights_by_difficulty():
    cb = AdaptiveEntropy.aer(target=0.5, step_size=1e-2, max_coef=1.0)
    cb.on_update_end(None, None, finished_step(nll=9.0, entropy=2.0))
    assert cb.initial_entropy == 2.0 and cb.target_entropy() == 1.0
    assert cb.coef == 0.0  # error 1.0 − 2.0 < 0: clipped at the floor
    cb.on_update_end(None, None, finished_step(nll=9.0, entropy=0.6))
    assert cb.coef == pytest.approx(1e-2 * (1.0 - 0.6))
    # two prompts: group 0 all solved (f = 0), group 1 half solved (f = 0.5 / 0.25 = 2)
    mask = torch.ones(4, 1)
    step = step_context([1, 1, 1, 0], mask, group_ids=[0, 0, 1, 1])
    entropy = torch.tensor([[1.0], [1.0], [3.0], [5.0]])
    term = cb.extra_loss(None, None, micro_context(step, -torch.ones(4, 1), entropy=entropy))
    assert term.item() == pytest.approx(-cb.coef * (2 * 3.0 + 2 * 5.0) / 4)


def test_state_round_trip_and_validation():
    cb = AdaptiveEntropy.aer()
    cb.on_update_end(None, None, finished_step(nll=1.0, entropy=1.5))
    restored = AdaptiveEntropy.aer()
    restored.load_state_dict(cb.state_dict())
    assert (restored.coef, restored.enabled, restored.initial_entropy) == (cb.coef, cb.enabled, cb.initial_entropy)
    assert AdaptiveEntropy(target=0.2).state_key != AdaptiveEntropy(target=0.3).state_key
    with pytest.raises(ValueError, match="init_coef"):
        AdaptiveEntropy(init_coef=1.0, max_coef=0.1)
    with pytest.raises(ValueError, match="controller"):
        AdaptiveEntropy(controller="pid")
