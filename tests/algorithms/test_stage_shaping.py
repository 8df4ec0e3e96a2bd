"""PPL and position shaping (arXiv 2508.02260, the authors' rules) against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_rlvr.algorithms.stage_shaping import (
    group_iqr_zscores,
    perplexity_weights,
    position_bonus,
    relative_positions,
    rescale_to_mass,
    response_log_perplexity,
)


def test_response_log_perplexity_is_the_masked_mean_nll():
    logprobs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(response_log_perplexity(logprobs, mask), torch.tensor([1.5, 0.5]))


def test_iqr_zscores_by_hand_with_an_outlier():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0, 7.0, 7.0, 7.0, 7.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    z, inlier = group_iqr_zscores(values, groups)
    # group 0: Q1 = 1.75, Q3 = 27.25 (linear interpolation), fences [-36.5, 65.5] -> 100 is out;
    # mean 2 and population std sqrt(2/3) of {1, 2, 3}, applied to all four values
    q1, q3 = np.percentile([1, 2, 3, 100], [25, 75])
    assert (q1, q3) == (1.75, 27.25)
    std = math.sqrt(2 / 3)
    torch.testing.assert_close(z[:4], torch.tensor([-1 / std, 0.0, 1 / std, 98 / std]))
    assert inlier.tolist() == [True, True, True, False, True, True, True, True]
    # group 1: std 0 -> 1, z = 0
    torch.testing.assert_close(z[4:], torch.zeros(4))


def test_perplexity_weights_favour_low_ppl_and_clip():
    z = torch.tensor([-30.0, -5.0, 0.0, 5.0, 30.0])
    torch.testing.assert_close(perplexity_weights(z, 0.01), torch.tensor([1.2, 1.05, 1.0, 0.95, 0.8]))
    torch.testing.assert_close(perplexity_weights(z, 0.01, favour="high"), torch.tensor([0.8, 0.95, 1.0, 1.05, 1.2]))
    with pytest.raises(ValueError, match="favour"):
        perplexity_weights(z, favour="middle")


def test_relative_positions_are_the_authors_cumsum_form():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(relative_positions(mask),
                               torch.tensor([[0.0, 0.25, 0.5, 0.75, 0.0], [0.0, 0.5, 0.0, 0.0, 0.0]]))


def test_position_bonus_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0] * 4, [-0.1] * 4, [0.0] * 4])
    shaped = position_bonus(adv, mask, alpha=0.1, steepness=15.0)

    def bonus(u):
        return 0.1 / (1 + math.exp(-15 * (u - 0.5)))

    expected_row0 = [1 + bonus(u) for u in (0, 0.25, 0.5, 0.75)]
    expected_row1 = [-0.1 - min(bonus(u), 0.05) for u in (0, 0.25, 0.5, 0.75)]  # capped at |A|/2
    torch.testing.assert_close(shaped[0], torch.tensor(expected_row0))
    torch.testing.assert_close(shaped[1], torch.tensor(expected_row1))
    assert shaped[1, 3] == pytest.approx(-0.15)
    torch.testing.assert_close(shaped[2], torch.zeros(4))  # zero advantages get no bonus


def test_position_bonus_preserves_every_sign_and_only_grows_magnitudes():
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(50, 12, generator=g) * torch.rand(50, 1, generator=g)
    mask = (torch.arange(12) < torch.randint(1, 13, (50, 1), generator=g)).float()
    shaped = position_bonus(adv, mask)
    assert torch.equal(torch.sign(shaped), torch.sign(adv))
    assert (shaped.abs() >= adv.abs()).all() and (shaped.abs() <= 1.5 * adv.abs() + 1e-7).all()
    off = mask == 0
    assert torch.equal(shaped[off], adv[off])


def test_rescale_to_mass_preserves_the_mass_of_each_segment():
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(8, 5, generator=g)
    mask = (torch.rand(8, 5, generator=g) > 0.2).float()
    shaped = adv * torch.rand(8, 5, generator=g) * 2
    segments = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    out = rescale_to_mass(shaped, adv, mask, segments)
    for s in range(4):
        rows = segments == s
        assert (out[rows].abs() * mask[rows]).sum().item() == pytest.approx((adv[rows].abs() * mask[rows]).sum().item(),
                                                                             rel=1e-5)
    assert torch.equal(torch.sign(out), torch.sign(shaped))
    # proportions inside a segment are the shaped ones
    torch.testing.assert_close(out[0] / out[1, 0], shaped[0] / shaped[1, 0])
