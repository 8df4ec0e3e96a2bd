"""DAPO dynamic-sampling filter and overlong reward shaping against explicit Python references."""

from __future__ import annotations

import pytest
import torch

from lightning_rlvr.algorithms.sampling import informative_groups, overlong_penalty


def ref_informative(rewards: list[float], group_ids: list[int], keep_singletons: bool) -> list[bool]:
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    keep = [False] * len(rewards)
    for idx in members.values():
        vals = [rewards[i] for i in idx]
        informative = any(v != vals[0] for v in vals)
        k = informative or (keep_singletons and len(idx) == 1)
        for i in idx:
            keep[i] = k
    return keep


def ref_overlong(length: int, max_length: int, buffer: int, factor: float) -> float:
    start = max_length - buffer
    if length <= start:
        return 0.0
    return -(length - start) / buffer * factor


# ----------------------------------------------------------------------------- informative_groups
# Interleaved groups: 10 -> [1, 0, 1] (mixed), 20 -> [1, 1] (all equal), 30 -> [0.5] (singleton),
# 40 -> [0, 0, 0] (all equal), 50 -> [0.25, 0.75] (mixed), -1 -> [2.0] (singleton).
REWARDS = [1.0, 1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25, 0.0, 0.75, 2.0]
GIDS = [10, 20, 10, 30, 40, 20, 10, 40, 50, 40, 50, -1]


@pytest.mark.parametrize("keep_singletons", [True, False])
def test_informative_groups_matches_loop_reference_for_interleaved_groups(keep_singletons):
    out = informative_groups(torch.tensor(REWARDS), torch.tensor(GIDS), keep_singletons=keep_singletons)
    assert out.dtype == torch.bool
    assert out.tolist() == ref_informative(REWARDS, GIDS, keep_singletons)


def test_informative_groups_drops_all_equal_groups_and_keeps_mixed_ones():
    out = informative_groups(torch.tensor(REWARDS), torch.tensor(GIDS), keep_singletons=False)
    by_group = {g: out[i].item() for i, g in enumerate(GIDS)}
    assert by_group == {10: True, 20: False, 30: False, 40: False, 50: True, -1: False}


def test_informative_groups_keeps_singletons_by_default_and_drops_them_when_asked():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    gids = torch.tensor([0, 1, 1, 2])  # 0 and 2 are singletons, 1 is all-equal
    assert informative_groups(rewards, gids).tolist() == [True, False, False, True]
    assert informative_groups(rewards, gids, keep_singletons=False).tolist() == [False, False, False, False]


def test_informative_groups_tiny_reward_difference_counts_as_informative():
    rewards = torch.tensor([0.5, 0.5 + 1e-6, 3.0, 3.0])
    gids = torch.tensor([0, 0, 1, 1])
    assert informative_groups(rewards, gids).tolist() == [True, True, False, False]


def test_informative_groups_handles_negative_and_integer_rewards():
    rewards = torch.tensor([-3, -3, -1, -2, 5])
    gids = torch.tensor([0, 0, 1, 1, 2])
    assert informative_groups(rewards, gids, keep_singletons=False).tolist() == [False, False, True, True, False]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_informative_groups_random_binary_rewards_match_reference(seed):
    g = torch.Generator().manual_seed(seed)
    gids = torch.randint(0, 7, (40,), generator=g)
    rewards = torch.randint(0, 2, (40,), generator=g).float()
    for keep in (True, False):
        out = informative_groups(rewards, gids, keep_singletons=keep)
        assert out.tolist() == ref_informative(rewards.tolist(), gids.tolist(), keep)


# ----------------------------------------------------------------------------- overlong_penalty
@pytest.mark.parametrize(("max_length", "buffer", "factor"), [(20, 8, 1.0), (16, 16, 0.5), (30, 5, 2.0)])
def test_overlong_penalty_matches_piecewise_formula_up_to_max_length(max_length, buffer, factor):
    lengths = list(range(0, max_length + 1))
    out = overlong_penalty(torch.tensor(lengths), max_length, buffer, penalty_factor=factor)
    assert out.dtype == torch.float32
    for n, v in zip(lengths, out.tolist()):
        assert v == pytest.approx(ref_overlong(n, max_length, buffer, factor), abs=1e-6), n


def test_overlong_penalty_is_zero_until_buffer_start_and_minus_factor_at_max_length():
    out = overlong_penalty(torch.tensor([0, 50, 60, 61, 65, 70]), max_length=70, buffer=10, penalty_factor=1.5)
    assert out.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.15, -0.75, -1.5], abs=1e-6)
    assert (out <= 0).all()


def test_overlong_penalty_is_never_positive_for_short_responses():
    out = overlong_penalty(torch.tensor([0, 1, 2, 3]), max_length=100, buffer=10)
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("buffer", [0, -5])
def test_overlong_penalty_nonpositive_buffer_disables_shaping(buffer):
    lengths = torch.tensor([0, 10, 100, 1000])
    out = overlong_penalty(lengths, max_length=100, buffer=buffer)
    assert out.dtype == torch.float32
    assert out.shape == lengths.shape
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_overlong_penalty_buffer_larger_than_max_length_raises_value_error():
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1, 2]), max_length=10, buffer=11)


def test_overlong_penalty_buffer_equal_to_max_length_is_allowed():
    out = overlong_penalty(torch.tensor([0, 5, 10]), max_length=10, buffer=10)
    assert out.tolist() == pytest.approx([0.0, -0.5, -1.0])
