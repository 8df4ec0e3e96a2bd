"""Per-token KL estimators k1 / abs / k2 / k3 / k3+ against the math-module formulas."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlvr.algorithms.kl import kl_penalty


def ref_k3(x: float) -> float:
    neg = min(max(-x, -20.0), 20.0)
    return min(max(math.exp(neg) - neg - 1.0, -10.0), 10.0)


REFERENCES = {
    "k1": lambda x: x,
    "abs": lambda x: abs(x),
    "k2": lambda x: 0.5 * x * x,
    "k3": ref_k3,
    "k3+": ref_k3,
}


def _inputs(seed: int, shape=(4, 7)):
    g = torch.Generator().manual_seed(seed)
    ref = -torch.rand(shape, generator=g) * 4.0
    lp = ref + torch.randn(shape, generator=g) * 0.8
    return lp, ref


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3", "k3+"])
@pytest.mark.parametrize("seed", [0, 1])
def test_kl_estimator_value_matches_math_formula_per_token(estimator, seed):
    lp, ref = _inputs(seed)
    out = kl_penalty(lp, ref, estimator)
    assert out.shape == lp.shape
    f = REFERENCES[estimator]
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            x = lp[i, j].item() - ref[i, j].item()
            assert out[i, j].item() == pytest.approx(f(x), rel=1e-5, abs=1e-6), (estimator, i, j)


def test_kl_default_estimator_is_k3():
    lp, ref = _inputs(2)
    torch.testing.assert_close(kl_penalty(lp, ref), kl_penalty(lp, ref, "k3"))
    x = (lp - ref)[0, 0].item()
    assert kl_penalty(lp, ref)[0, 0].item() == pytest.approx(math.exp(-x) + x - 1.0, rel=1e-5, abs=1e-6)


def test_k3_is_nonnegative_and_zero_at_equal_logprobs():
    lp, ref = _inputs(3)
    assert (kl_penalty(lp, ref, "k3") >= 0).all()
    assert kl_penalty(ref, ref, "k3").abs().max().item() == 0.0


def test_k3_is_clamped_to_ten_for_extreme_log_ratios():
    lp = torch.tensor([30.0, -30.0, 12.0, -2.0])
    ref = torch.zeros(4)
    out = kl_penalty(lp, ref, "k3")
    # x = 30 -> exp(-20) + 20 - 1 = 19 -> 10;  x = -30 -> exp(20) - 21 -> 10;  x = 12 -> 11 -> 10.
    assert out[:3].tolist() == [10.0, 10.0, 10.0]
    assert out[3].item() == pytest.approx(math.exp(2.0) - 3.0, rel=1e-6)
    assert torch.isfinite(out).all()


def test_k3_gradient_is_one_minus_exp_minus_x():
    lp, ref = _inputs(4)
    lp.requires_grad_(True)
    (grad,) = torch.autograd.grad(kl_penalty(lp, ref, "k3").sum(), lp)
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            x = lp[i, j].item() - ref[i, j].item()
            assert grad[i, j].item() == pytest.approx(1.0 - math.exp(-x), rel=1e-5, abs=1e-6)


def test_k3_plus_has_k3_value_and_k2_gradient_wrt_both_inputs():
    lp, ref = _inputs(5)
    lp.requires_grad_(True)
    ref.requires_grad_(True)
    out = kl_penalty(lp, ref, "k3+")
    g_up = torch.randn(lp.shape, generator=torch.Generator().manual_seed(9))
    g_lp, g_ref = torch.autograd.grad((out * g_up).sum(), (lp, ref))
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            x = lp[i, j].item() - ref[i, j].item()
            assert out[i, j].item() == pytest.approx(ref_k3(x), rel=1e-5, abs=1e-6)
            # d(x^2 / 2)/d lp = x, d/d ref = -x (the k2 gradient), not 1 - exp(-x) (k3's).
            assert g_lp[i, j].item() == pytest.approx(g_up[i, j].item() * x, rel=1e-5, abs=1e-6)
            assert g_ref[i, j].item() == pytest.approx(-g_up[i, j].item() * x, rel=1e-5, abs=1e-6)
    (g_k3,) = torch.autograd.grad(kl_penalty(lp, ref, "k3").sum(), lp)
    assert not torch.allclose(g_k3, (lp - ref).detach(), atol=1e-3)  # the two gradients really differ


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2"])
def test_simple_estimators_have_their_analytic_gradient(estimator):
    lp, ref = _inputs(6)
    lp.requires_grad_(True)
    (grad,) = torch.autograd.grad(kl_penalty(lp, ref, estimator).sum(), lp)
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            x = lp[i, j].item() - ref[i, j].item()
            expected = {"k1": 1.0, "abs": math.copysign(1.0, x), "k2": x}[estimator]
            assert grad[i, j].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("estimator", ["k4", "mse", "low_var_kl", "K3", ""])
def test_unknown_kl_estimator_raises_value_error(estimator):
    lp, ref = _inputs(0)
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, estimator)  # type: ignore[arg-type]


def test_k3_keeps_its_value_for_a_policy_one_small_step_from_the_reference():
    """In float32, e^{-x} + x - 1 computed literally cancels to 0 below |x| ~ 5e-4; the estimator must not."""
    x = torch.tensor([1e-5, -3e-5, 1e-4, 4e-4, -1e-3])
    expected = (torch.exp(-x.double()) + x.double() - 1).float()  # float64 has no cancellation here
    torch.testing.assert_close(kl_penalty(x, torch.zeros_like(x), "k3"), expected, rtol=1e-4, atol=0)
