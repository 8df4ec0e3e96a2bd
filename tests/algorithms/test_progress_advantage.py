"""EP-GRPO's gate, process signal, progress bins and normalisation against hand values and numpy loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_rlvr.algorithms.progress_advantage import (
    cumulative_entropy_progress,
    divergence_signal,
    entropy_gate,
    progress_bins,
    progress_normalize,
)


def test_gate_by_hand():
    entropy = torch.tensor([[0.0, 1.0, 5.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    gate = entropy_gate(entropy, mask, strength=0.5, low=0.5, high=2.0)
    mean = 2.0
    expected = [min(max(1 + 0.5 * (h / mean - 1), 0.5), 2.0) for h in (0.0, 1.0, 5.0)] + [0.0]
    torch.testing.assert_close(gate, torch.tensor([expected]))


def test_divergence_signal_is_signed_by_the_advantage_or_else_by_the_verifier_outcome():
    old = torch.tensor([[-1.0, -2.0]] * 4)
    ref = torch.tensor([[-1.5, -1.0]] * 4)
    advantages = torch.tensor([2.0, -0.5, 0.0, 0.0])
    raw = [math.tanh(0.5 / 0.5), math.tanh(-1.0 / 0.5)]
    negated = [-x for x in raw]
    correct = torch.tensor([False, True, True, False])  # only used where the advantage is 0
    p = divergence_signal(old, ref, advantages, temperature=0.5, correct=correct)
    torch.testing.assert_close(p, torch.tensor([raw, negated, raw, negated]))
    unsigned = divergence_signal(old, ref, advantages, temperature=0.5)
    torch.testing.assert_close(unsigned, torch.tensor([raw, negated, raw, raw]))


def test_progress_and_bins():
    entropy = torch.tensor([[1.0, 3.0, 0.0, 4.0, 7.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0]])
    progress = cumulative_entropy_progress(entropy, mask)
    torch.testing.assert_close(progress, torch.tensor([[0.125, 0.5, 0.5, 1.0, 0.0], [0.5, 1.0, 0.0, 0.0, 0.0]]))
    assert progress_bins(progress, 4)[0, :4].tolist() == [0, 1, 1, 3]
    assert progress_bins(torch.tensor([0.0, 0.1, 0.1001, 1.0]), 10).tolist() == [0, 0, 1, 9]


@pytest.mark.parametrize("scale", [True, False], ids=["zscore", "center"])
def test_normalize_matches_a_numpy_loop_over_question_and_bin(scale):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(6, 7, generator=g)
    mask = (torch.arange(7) < torch.tensor([[7], [5], [3], [7], [1], [6]])).float()
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    bins = torch.randint(0, 3, (6, 7), generator=g)
    out = progress_normalize(values, mask, groups, bins, num_bins=3, scale=scale)
    expected = np.zeros((6, 7))
    for q in (0, 1):
        for b in range(3):
            cell = (groups.numpy()[:, None] == q) & (bins.numpy() == b) & (mask.numpy() > 0)
            x = values.numpy()[cell]
            if x.size:
                expected[cell] = (x - x.mean()) / (x.std() + 1e-6) if scale else x - x.mean()
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_invalid_arguments():
    with pytest.raises(ValueError):
        entropy_gate(torch.ones(1, 2), torch.ones(1, 2), low=1.5)
    with pytest.raises(ValueError):
        divergence_signal(torch.ones(1, 2), torch.ones(1, 2), torch.ones(1), temperature=0)
    with pytest.raises(ValueError):
        progress_bins(torch.ones(2), 0)
