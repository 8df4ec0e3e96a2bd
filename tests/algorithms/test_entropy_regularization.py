"""Entropy-coefficient controllers and AER difficulty weights."""

import torch

from lightning_rlvr.algorithms.entropy_regularization import (
    difficulty_weights,
    proportional_controller_step,
    sign_controller_step,
)


def test_sign_controller_steps_toward_the_target_and_clips():
    assert sign_controller_step(0.0, measured=0.1, target=0.2, delta=1e-4, low=0.0, high=5e-3) == 1e-4
    assert sign_controller_step(0.0, measured=0.3, target=0.2, delta=1e-4, low=0.0, high=5e-3) == 0.0
    assert sign_controller_step(5e-3, measured=0.1, target=0.2, delta=1e-4, low=0.0, high=5e-3) == 5e-3


def test_proportional_controller_moves_by_gain_times_error():
    assert abs(proportional_controller_step(1e-3, 0.2, 0.5, 1e-2, 0.0, 1.0) - (1e-3 + 3e-3)) < 1e-12
    assert proportional_controller_step(1e-3, 0.9, 0.5, 1e-2, 0.0, 1.0) == 0.0  # clipped at the floor


def test_difficulty_weights_by_hand():
    # groups: acc 1/4 (failure 3/4), acc 1 (failure 0), acc 0 (failure 1); mean failure 7/12
    correct = torch.tensor([1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)
    groups = torch.arange(12) // 4
    weights = difficulty_weights(correct, groups)
    expected = torch.tensor([0.75 / (7 / 12)] * 4 + [0.0] * 4 + [1 / (7 / 12)] * 4)
    torch.testing.assert_close(weights, expected)
    assert difficulty_weights(torch.ones(4, dtype=torch.bool), torch.zeros(4)).abs().sum() == 0
