"""PolarityFilter against the authors' positive_only / negative_only loss written out by hand."""

from __future__ import annotations

import pytest
import torch

from lightning_rlvr.algorithms import aggregate_loss
from lightning_rlvr.callbacks import PolarityFilter

from .helpers import micro_context, step_context


def case():
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    advantages = torch.tensor([[0.7, 0.7, 0.7, 0.7], [-0.4, -0.4, -0.4, -0.4], [0.0, 0.0, 0.0, 0.0],
                               [-1.2, -1.2, -1.2, -1.2]])
    advantages[2, 1] = -0.3  # a shaped token of the other sign inside a zero-advantage row
    step = step_context([1.0, 0.0, 0.0, 0.0], mask, advantages=advantages)
    old = torch.randn(4, 4) - 1.0
    logprobs = (old + 0.3 * torch.randn(4, 4)).requires_grad_(True)
    return step, old, logprobs


def authors_loss(logprobs, old, advantages, mask, keep):
    """``compute_policy_loss`` with ``use_token_level_loss``: the clipped surrogate's masked mean over kept tokens."""
    ratio = torch.exp(logprobs - old)
    losses = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 0.8, 1.2))
    kept = mask * keep
    return (losses * kept).sum() / kept.sum()


@pytest.mark.parametrize("train_on", ["positive", "negative"])
def test_the_weighted_token_mean_is_the_authors_masked_mean(train_on):
    step, old, logprobs = case()
    mctx = micro_context(step, logprobs, old_logprobs=old)
    filt = PolarityFilter(train_on)
    weights = filt.token_weights(None, None, mctx)
    ours = aggregate_loss(mctx.policy_loss.loss * weights, mctx.mask, "token-mean")
    keep = (step.advantages > 0 if train_on == "positive" else step.advantages < 0).float()
    expected = authors_loss(logprobs, old, step.advantages, step.mask, keep)
    torch.testing.assert_close(ours, expected)
    grad_ours, = torch.autograd.grad(ours, logprobs)
    grad_expected, = torch.autograd.grad(expected, logprobs)
    torch.testing.assert_close(grad_ours, grad_expected)
    # kept tokens: 3 positive (row 0); negative: row 1 (2), row 2's shaped token (1), row 3 (1) = 4 of 10
    assert step.metrics.means()["polarity_filter/kept_fraction"] == pytest.approx(0.3 if train_on == "positive" else 0.4)


def test_without_renormalisation_it_is_the_plain_mask():
    step, old, logprobs = case()
    weights = PolarityFilter("negative", renormalise=False).token_weights(None, None,
                                                                           micro_context(step, logprobs, old_logprobs=old))
    assert torch.equal(weights, ((step.advantages < 0) & (step.mask > 0)).float())


def test_nothing_of_that_sign_trains_nothing():
    step = step_context([1.0, 1.0], torch.ones(2, 3), advantages=torch.tensor([0.5, 0.2]))
    mctx = micro_context(step, torch.zeros(2, 3, requires_grad=True))
    weights = PolarityFilter("negative").token_weights(None, None, mctx)
    assert torch.equal(weights, torch.zeros(2, 3))
    assert step.metrics.means()["polarity_filter/kept_fraction"] == 0.0


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="train_on"):
        PolarityFilter("both")
    with pytest.raises(ValueError, match="scope"):
        PolarityFilter(scope="device")
    assert PolarityFilter(scope="micro_batch").needs.minibatch_stats is False
    assert PolarityFilter().needs.minibatch_stats is True
