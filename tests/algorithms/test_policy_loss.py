"""PPO clipped surrogate (clip-higher, dual-clip) against an element-by-element Python reference."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlvr.algorithms.policy_loss import ppo_clip_loss


def ref_token(lp: float, old: float, adv: float, lo: float, hi: float, dual: float | None):
    """Loss, ratio, (clipped_high, clipped_low, dual_clipped) and d loss / d lp for one token."""
    log_ratio = min(max(lp - old, -20.0), 20.0)
    r = math.exp(log_ratio)
    unclipped = -adv * r
    clipped = -adv * min(max(r, 1.0 - lo), 1.0 + hi)
    loss = max(unclipped, clipped)
    c_high = adv > 0 and r > 1.0 + hi
    c_low = adv < 0 and r < 1.0 - lo
    c_dual = False
    if dual is not None and adv < 0:
        bound = -dual * adv
        if bound < loss:
            loss = bound
            c_dual = True
    # Gradient wrt lp: d(-A r)/d lp = -A r while the unclipped branch is active, otherwise the loss
    # is a constant of lp (clipped ratio or dual bound) and the gradient is zero.
    grad = 0.0 if (c_high or c_low or c_dual) else -adv * r
    if abs(lp - old) > 20.0:
        grad = 0.0  # the log-ratio clamp cuts the gradient too
    return loss, r, (c_high, c_low, c_dual), grad


def _inputs(seed: int, b: int = 6, t: int = 9, spread: float = 1.5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3.0
    lp = old + (torch.rand(b, t, generator=g) * 2.0 - 1.0) * spread
    adv = torch.randn(b, t, generator=g)
    adv[0, :3] = 0.0  # some zero advantages
    return lp, old, adv


def _check_against_reference(lp, old, adv, lo, hi, dual):
    lp = lp.clone().requires_grad_(True)
    out = ppo_clip_loss(lp, old, adv, clip_low=lo, clip_high=hi, dual_clip=dual)
    out.loss.sum().backward()
    b, t = lp.shape
    counts = [0, 0, 0]
    for i in range(b):
        for j in range(t):
            loss, r, flags, grad = ref_token(lp[i, j].item(), old[i, j].item(), adv[i, j].item(), lo, hi, dual)
            assert out.loss[i, j].item() == pytest.approx(loss, rel=1e-5, abs=1e-6), (i, j)
            assert out.ratio[i, j].item() == pytest.approx(r, rel=1e-5), (i, j)
            assert bool(out.clipped_high[i, j]) == flags[0], (i, j)
            assert bool(out.clipped_low[i, j]) == flags[1], (i, j)
            assert bool(out.dual_clipped[i, j]) == flags[2], (i, j)
            assert lp.grad[i, j].item() == pytest.approx(grad, rel=1e-5, abs=1e-6), (i, j)
            for k in range(3):
                counts[k] += flags[k]
    return counts


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("lo", "hi"), [(0.2, 0.2), (0.2, 0.28), (0.1, 0.4)])
def test_ppo_clip_loss_matches_loop_reference_with_symmetric_and_decoupled_clip(seed, lo, hi):
    lp, old, adv = _inputs(seed)
    counts = _check_against_reference(lp, old, adv, lo, hi, None)
    assert counts[0] > 0 and counts[1] > 0, "test data must exercise both clips"
    assert counts[2] == 0


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("lo", "hi", "dual"), [(0.2, 0.2, 3.0), (0.2, 0.28, 1.5), (0.1, 0.4, 2.0)])
def test_ppo_dual_clip_bounds_negative_advantage_loss_by_minus_c_times_advantage(seed, lo, hi, dual):
    lp, old, adv = _inputs(seed, spread=2.0)
    counts = _check_against_reference(lp, old, adv, lo, hi, dual)
    assert counts[0] > 0 and counts[1] > 0 and counts[2] > 0, "test data must exercise every clip"


def test_ppo_decoupled_clip_high_hand_computed_values():
    old = torch.zeros(1, 3)
    lp = torch.log(torch.tensor([[1.25, 1.25, 0.75]]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    # ε_high = 0.28: r = 1.25 is inside the range, loss -1.25; ε_low = 0.2: r = 0.75 is clipped to 0.8.
    out = ppo_clip_loss(lp, old, adv, clip_low=0.2, clip_high=0.28)
    assert out.loss[0, 0].item() == pytest.approx(-1.25, rel=1e-6)
    assert out.loss[0, 2].item() == pytest.approx(0.8, rel=1e-6)
    assert out.clipped_high.tolist() == [[False, False, False]]
    assert out.clipped_low.tolist() == [[False, False, True]]
    # With the symmetric ε = 0.2 the positive token is clipped at 1.2.
    out = ppo_clip_loss(lp, old, adv, clip_low=0.2, clip_high=0.2)
    assert out.loss[0, 0].item() == pytest.approx(-1.2, rel=1e-6)
    assert out.clipped_high.tolist() == [[True, True, False]]


def test_ppo_dual_clip_hand_computed_value():
    # A = -2, r = 5: PPO loss max(10, 2 * 1.2) = 10, dual bound -c A = 6 with c = 3.
    lp = torch.log(torch.tensor([[5.0, 2.0]])).requires_grad_(True)
    old = torch.zeros(1, 2)
    adv = torch.tensor([[-2.0, -2.0]])
    out = ppo_clip_loss(lp, old, adv, dual_clip=3.0)
    assert out.loss.tolist()[0] == pytest.approx([6.0, 4.0], rel=1e-6)
    assert out.dual_clipped.tolist() == [[True, False]]
    out.loss.sum().backward()
    assert lp.grad[0, 0].item() == 0.0
    assert lp.grad[0, 1].item() == pytest.approx(4.0, rel=1e-6)  # d(-A r)/d lp = -A r = 4


def test_ppo_gradient_is_exactly_zero_on_clipped_tokens_and_nonzero_elsewhere():
    lp, old, adv = _inputs(3, spread=2.0)
    lp.requires_grad_(True)
    out = ppo_clip_loss(lp, old, adv, clip_low=0.2, clip_high=0.28, dual_clip=2.0)
    (grad,) = torch.autograd.grad(out.loss.sum(), lp)
    cut = out.clipped_high | out.clipped_low | out.dual_clipped
    assert cut.any() and (~cut).any()
    assert (grad[cut] == 0).all()
    live = ~cut & (adv != 0)
    assert (grad[live] != 0).all()


def test_ppo_without_dual_clip_never_reports_dual_clipped():
    lp, old, adv = _inputs(4, spread=3.0)
    out = ppo_clip_loss(lp, old, adv)
    assert out.dual_clipped.dtype == torch.bool
    assert not out.dual_clipped.any()


def test_ppo_ratio_is_detached_and_equals_exp_log_ratio():
    lp, old, adv = _inputs(5)
    lp.requires_grad_(True)
    out = ppo_clip_loss(lp, old, adv)
    assert not out.ratio.requires_grad
    torch.testing.assert_close(out.ratio, torch.exp(lp.detach() - old))


def test_ppo_extreme_log_ratio_is_clamped_and_stays_finite():
    lp = torch.tensor([[100.0, -100.0]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[-1.0, 1.0]])
    out = ppo_clip_loss(lp, old, adv)
    assert torch.isfinite(out.loss).all()
    assert out.ratio[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-5)
    assert out.ratio[0, 1].item() == pytest.approx(math.exp(-20.0), rel=1e-5)


@pytest.mark.parametrize("dual", [1.0, 0.5, 0.0, -2.0])
def test_ppo_dual_clip_not_greater_than_one_raises_value_error(dual):
    lp, old, adv = _inputs(0)
    with pytest.raises(ValueError):
        ppo_clip_loss(lp, old, adv, dual_clip=dual)
