"""HAPO's capacity multipliers and quadrants against hand values: sign and mass preservation, the cap."""

from __future__ import annotations

import pytest
import torch

from lightning_rlvr.algorithms.hindsight_credit import capacity_multipliers, entropy_quadrants

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
ENTROPY = torch.tensor([[0.1, 0.2, 0.9, 5.0], [1.0, 1.0, 1.0, 1.0]])


def test_multipliers_by_hand():
    m = capacity_multipliers(ENTROPY, MASK, strength=0.5, max_multiplier=10.0)
    mean = (0.1 + 0.2 + 0.9) / 3  # the padded 5.0 does not count
    expected_row0 = [0.5 + 0.5 * h / mean for h in (0.1, 0.2, 0.9)] + [0.0]
    torch.testing.assert_close(m[0], torch.tensor(expected_row0))
    torch.testing.assert_close(m[1], torch.ones(4))  # uniform entropy: GRPO
    torch.testing.assert_close(capacity_multipliers(ENTROPY, MASK, strength=0.0), MASK)


@pytest.mark.parametrize("strength, cap", [(0.5, 10.0), (0.9, 1.5), (0.99, 1.2)])
def test_sign_and_mass_are_preserved_and_the_cap_holds(strength, cap):
    g = torch.Generator().manual_seed(3)
    entropy = torch.rand(6, 9, generator=g) ** 3 * 4
    mask = (torch.arange(9) < torch.randint(1, 10, (6, 1), generator=g)).float()
    advantages = torch.randn(6, 1, generator=g).expand(6, 9)
    m = capacity_multipliers(entropy, mask, strength, cap)
    shaped = advantages * m
    valid = mask > 0
    assert (torch.sign(shaped[valid]) == torch.sign(advantages[valid])).all()
    assert (m[valid] >= 1 - strength - 1e-6).all() and (m[valid] <= cap + 1e-5).all()
    torch.testing.assert_close((shaped * mask).sum(-1), (advantages * mask).sum(-1), rtol=1e-5, atol=1e-5)


def test_cap_shrinks_the_excess_by_one_factor_per_row():
    entropy, mask = torch.tensor([[0.0, 0.0, 3.0]]), torch.ones(1, 3)
    # uncapped m = 0.5 + 0.5·H/1 = (0.5, 0.5, 2.0); cap 1.5 halves the excess (−.5, −.5, 1) → (.75, .75, 1.5)
    torch.testing.assert_close(capacity_multipliers(entropy, mask, 0.5, 1.5), torch.tensor([[0.75, 0.75, 1.5]]))


def test_quadrants():
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0])
    entropy = torch.tensor([2.0, 0.1, 2.0, 0.1, 2.0])
    assert entropy_quadrants(advantages, entropy, 1.0).tolist() == [0, 1, 2, 3, -1]
