"""TopEntropyTokens: pg loss only on the top-ρ entropy tokens, normalised by the selected count."""

import math

import pytest
import torch

from lightning_rlvr.callbacks import TopEntropyTokens

from .helpers import micro_context, step_context


def test_loss_is_the_mean_over_the_selected_tokens():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    entropy = torch.tensor([[0.1, 2.0, 0.3, 1.5, 9.0], [0.2, 0.2, 3.0, 9.0, 9.0], [1.0, 0.0, 2.5, 0.4, 0.6]])
    step = step_context([1, 0, 1], mask, advantages=[1.0, -1.0, 0.5])
    logp = -torch.rand(3, 5)
    ctx = micro_context(step, logp, logp - 0.1, entropy=entropy)
    weights = TopEntropyTokens(ratio=0.2).token_weights(None, None, ctx)
    # 12 valid tokens, k = ⌈2.4⌉ = 3: entropies 3.0, 2.5, 2.0 (padding's 9.0 never counts)
    selected = torch.zeros(3, 5)
    selected[1, 2] = selected[2, 2] = selected[0, 1] = 1
    torch.testing.assert_close(weights, selected * 12 / 3)
    loss = ctx.aggregate(ctx.policy_loss.loss * weights)
    torch.testing.assert_close(loss, (ctx.policy_loss.loss * selected).sum() / 3)
    assert ctx.step.metrics.means()["top_entropy/threshold"] == pytest.approx(2.0)
    unnormalised = TopEntropyTokens(ratio=0.2, renormalize=False).token_weights(None, None, ctx)
    torch.testing.assert_close(unnormalised, selected)


def test_ties_single_token_and_empty_mask():
    step = step_context([1, 0], torch.ones(2, 2), advantages=[1.0, -1.0])
    tied = micro_context(step, -torch.ones(2, 2), entropy=torch.ones(2, 2))
    weights = TopEntropyTokens(ratio=0.5, renormalize=False).token_weights(None, None, tied)
    assert weights.tolist() == [[1.0, 1.0], [0.0, 0.0]]  # k = 2 of four equal: the first two
    single = micro_context(step_context([1], torch.ones(1, 1), advantages=[1.0]), -torch.ones(1, 1),
                           entropy=torch.tensor([[0.3]]))
    assert TopEntropyTokens(ratio=0.01).token_weights(None, None, single).tolist() == [[1.0]]
    empty = micro_context(step_context([1, 0], torch.zeros(2, 2)), -torch.ones(2, 2), entropy=torch.ones(2, 2))
    assert TopEntropyTokens().token_weights(None, None, empty).abs().sum() == 0


def test_selected_count_is_the_ceiling():
    n = 37
    step = step_context([1.0] * n, torch.ones(n, 1), advantages=torch.ones(n))
    ctx = micro_context(step, -torch.ones(n, 1), entropy=torch.rand(n, 1))
    weights = TopEntropyTokens(ratio=0.2, renormalize=False).token_weights(None, None, ctx)
    assert weights.sum() == math.ceil(0.2 * n)
    with pytest.raises(ValueError, match="ratio"):
        TopEntropyTokens(ratio=0.0)
