"""KLCov adds the |log-ratio| penalty on exactly the top-k covariance tokens (reference semantics)."""

import pytest
import torch

from lightning_rlvr.callbacks import KLCov

from .helpers import micro_context, step_context


def reference_term(logp, old, adv, mask, ratio, coef):
    """Loop reference: flatten valid tokens row-major, rank by covariance (ties: earlier), penalise top k."""
    tokens = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    lp = [logp[i, t].item() for i, t in tokens]
    a = [adv[i, t].item() for i, t in tokens]
    n = len(tokens)
    cov = [(x - sum(lp) / n) * (y - sum(a) / n) for x, y in zip(lp, a)]
    k = max(1, int(n * ratio))
    chosen = sorted(range(n), key=lambda j: (-cov[j], j))[:k]
    selected = torch.zeros_like(mask)
    for j in chosen:
        selected[tokens[j]] = 1.0
    return (coef * (logp - old).abs() * selected).sum() / n, selected


@pytest.mark.parametrize("ratio", [0.01, 0.2, 0.6])
def test_penalty_value_and_gradient_match_the_reference(ratio):
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    adv = torch.tensor([1.5, -0.5, -1.0])
    old = -torch.rand(3, 4, generator=g) * 3
    logp = (old + 0.2 * torch.randn(3, 4, generator=g)).requires_grad_()
    step = step_context([1, 0, 0], mask, advantages=adv)
    ctx = micro_context(step, logp, old)
    term = KLCov(ratio=ratio, coef=0.7).extra_loss(None, None, ctx)
    logp_ref = logp.detach().clone().requires_grad_()
    expected, _ = reference_term(logp_ref, old, step.advantages, mask, ratio, 0.7)
    torch.testing.assert_close(term, expected)
    term.backward()
    expected.backward()
    torch.testing.assert_close(logp.grad, logp_ref.grad)


def test_ties_go_to_the_earlier_token():
    # identical tokens: equal covariance everywhere, so the first k in row-major order are penalised
    mask = torch.ones(2, 3)
    logp = torch.tensor([[-1.0, -2.0, -1.0], [-2.0, -1.0, -2.0]])
    step = step_context([1, 0], mask, advantages=[1.0, -1.0])
    ctx = micro_context(step, logp, logp - 0.5)
    # cov = (lp + 1.5)(A): row 0 → +0.5, −0.5, +0.5; row 1 → +0.5, −0.5, +0.5 (ties among the four +0.5)
    term = KLCov(ratio=0.34, coef=1.0).extra_loss(None, None, ctx)  # k = 2 → tokens (0,0) and (0,2)
    assert term.item() == pytest.approx(2 * 0.5 / 6)
    assert ctx.step.metrics.means()["kl_cov/selected_fraction"] == pytest.approx(2 / 6)


def test_on_policy_the_penalty_has_no_gradient_and_empty_masks_give_zero():
    step = step_context([1, 0], torch.ones(2, 2), advantages=[1.0, -1.0])
    logp = torch.tensor([[-1.0, -0.5], [-2.0, -0.1]], requires_grad=True)
    term = KLCov(ratio=1.0).extra_loss(None, None, micro_context(step, logp))  # old = current
    term.backward()
    assert term.item() == 0.0 and logp.grad.abs().sum() == 0
    empty = step_context([1, 0], torch.zeros(2, 2), advantages=[1.0, -1.0])
    assert KLCov().extra_loss(None, None, micro_context(empty, logp.detach(), logp.detach() - 1)).item() == 0.0


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError, match="coef"):
        KLCov(coef=0.0)
    with pytest.raises(ValueError, match="ratio"):
        KLCov(ratio=2.0)
