"""ClipCov selects exactly the tokens of the reference procedure (PRIME-RL compute_policy_loss_clip_cov)."""

import pytest
import torch

from lightning_rlvr.algorithms import aggregate_loss
from lightning_rlvr.callbacks import ClipCov

from .helpers import micro_context, step_context


def reference_correction(logp, old, adv, mask, ratio, lb, ub, clip_low, clip_high, generator):
    """The reference code's steps, on (B, T) tensors: the tokens it detaches get correction 0."""
    ratio_t = torch.exp(logp - old)
    pg1 = -adv * ratio_t
    pg2 = -adv * torch.clamp(ratio_t, 1 - clip_low, 1 + clip_high)
    clip_by_origin = (pg2 > pg1) & (mask > 0)
    n = mask.sum()
    cov = (adv - (adv * mask).sum() / n) * (logp - (logp * mask).sum() / n)
    cov[mask == 0] = -torch.inf
    cov[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio * mask.sum().item()), 1)
    idx = torch.nonzero((cov < ub) & (cov > lb) & (mask > 0))
    if len(idx) > 0:
        perm = torch.randperm(len(idx), generator=generator)
        idx = idx[perm[: min(clip_num, len(idx))]]
    corr = torch.ones_like(adv)
    corr[idx[:, 0], idx[:, 1]] = 0
    return corr, pg1, pg2


def random_case(seed, rows=8, width=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width) < lengths.unsqueeze(-1)).float()
    adv = torch.randn(rows, generator=g) * 2
    logp = -torch.rand(rows, width, generator=g) * 4
    old = logp + torch.randn(rows, width, generator=g) * 0.3  # some tokens are PPO-clipped
    return logp, old, adv, mask


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ratio", [2e-4, 0.1, 0.5])
def test_selection_equals_the_reference_with_the_same_seed(seed, ratio):
    logp, old, adv, mask = random_case(seed)
    step = step_context([0.0] * len(adv), mask, advantages=adv)
    ctx = micro_context(step, logp, old)
    weights = ClipCov(ratio=ratio, seed=seed).token_weights(None, None, ctx)
    expected, pg1, pg2 = reference_correction(logp, old, step.advantages, mask, ratio, 1.0, 5.0, 0.2, 0.2,
                                              torch.Generator().manual_seed(seed))
    assert torch.equal(weights, expected)
    assert (weights == 0).any()
    # and the loss the module builds from it is the reference's token-mean loss
    torch.testing.assert_close(ctx.aggregate(ctx.policy_loss.loss * weights),
                               aggregate_loss(torch.maximum(pg1, pg2) * expected, mask))


def test_the_generator_state_survives_a_state_dict_round_trip():
    logp, old, adv, mask = random_case(0)
    step = step_context([0.0] * len(adv), mask, advantages=adv)
    first = ClipCov(ratio=0.5, seed=3)
    first.token_weights(None, None, micro_context(step, logp, old))
    saved = first.state_dict()
    expected = first.token_weights(None, None, micro_context(step, logp, old))
    restored = ClipCov(ratio=0.5, seed=3)
    restored.load_state_dict(saved)
    assert torch.equal(restored.token_weights(None, None, micro_context(step, logp, old)), expected)


def test_edge_cases_select_nothing():
    # empty mask
    step = step_context([1.0, 0.0], torch.zeros(2, 3), advantages=[1.0, -1.0])
    assert torch.equal(ClipCov(ratio=0.5).token_weights(None, None, micro_context(step, -torch.rand(2, 3))),
                       torch.ones(2, 3))
    # all-equal rewards: zero advantages, zero covariance, below the lower bound
    logp, old, _, mask = random_case(1)
    step = step_context([1.0] * 8, mask, advantages=torch.zeros(8))
    assert (ClipCov(ratio=0.5).token_weights(None, None, micro_context(step, logp, old)) == 1).all()
    # a single token has zero covariance with itself
    step = step_context([1.0], torch.ones(1, 1), advantages=[3.0])
    assert ClipCov(ratio=1.0).token_weights(None, None, micro_context(step, torch.tensor([[-2.0]]))).item() == 1.0


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError, match="ratio"):
        ClipCov(ratio=0.0)
    with pytest.raises(ValueError, match="lower < upper"):
        ClipCov(lower=5.0, upper=1.0)
