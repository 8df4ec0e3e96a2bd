"""GRPO / Dr.GRPO / RLOO outcome advantages against explicit per-group Python loops."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lightning_rlvr.algorithms.advantages import group_mean_std, grpo_advantages, rloo_advantages


# ----------------------------------------------------------------------------- references
def _groups(group_ids: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        out.setdefault(g, []).append(i)
    return out


def ref_grpo(rewards: list[float], group_ids: list[int], normalize_by_std: bool, eps: float = 1e-6) -> list[float]:
    adv = [0.0] * len(rewards)
    for members in _groups(group_ids).values():
        n = len(members)
        mean = sum(rewards[i] for i in members) / n
        if n > 1:
            var = sum((rewards[i] - mean) ** 2 for i in members) / (n - 1)
            std = math.sqrt(var)
        else:
            std = 1.0
        for i in members:
            c = rewards[i] - mean
            adv[i] = c / (std + eps) if normalize_by_std else c
    return adv


def ref_rloo(rewards: list[float], group_ids: list[int]) -> list[float]:
    adv = [0.0] * len(rewards)
    for members in _groups(group_ids).values():
        n = len(members)
        for i in members:
            if n == 1:
                adv[i] = 0.0
                continue
            others = [rewards[j] for j in members if j != i]
            adv[i] = rewards[i] - sum(others) / len(others)
    return adv


# Interleaved (non-contiguous) groups of sizes 4 (id 7), 3 (id 2), 2 (id 11), 4 (id 5) and two
# singletons (ids -3 and 42), with arbitrary, also negative, ids.
GROUP_IDS = [7, 2, 7, -3, 2, 11, 7, 42, 2, 11, 7, 5, 5, 5, 5]


def _random_rewards(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(-2.0, 3.0) for _ in range(n)]


def _close(actual: torch.Tensor, expected: list[float], tol: float = 1e-5) -> None:
    assert actual.shape == (len(expected),)
    for a, e in zip(actual.tolist(), expected):
        assert a == pytest.approx(e, rel=tol, abs=tol)


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_advantage_is_centered_reward_over_unbiased_std_plus_eps_for_noncontiguous_uneven_groups(seed):
    rewards = _random_rewards(len(GROUP_IDS), seed)
    out = grpo_advantages(torch.tensor(rewards), torch.tensor(GROUP_IDS), normalize_by_std=True)
    assert out.dtype == torch.float32
    _close(out, ref_grpo(rewards, GROUP_IDS, normalize_by_std=True))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dr_grpo_advantage_is_reward_minus_group_mean_without_std(seed):
    rewards = _random_rewards(len(GROUP_IDS), seed)
    out = grpo_advantages(torch.tensor(rewards), torch.tensor(GROUP_IDS), normalize_by_std=False)
    _close(out, ref_grpo(rewards, GROUP_IDS, normalize_by_std=False))


def test_grpo_uses_unbiased_n_minus_1_std_not_biased_std():
    # Group {0, 1}: mean 0.5, unbiased std sqrt(0.5), biased std 0.5 (which would give ±1).
    out = grpo_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]))
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert out.tolist() == pytest.approx([-expected, expected], rel=1e-6)
    assert abs(out[1].item() - 1.0) > 0.1


def test_grpo_custom_eps_is_added_to_std():
    out = grpo_advantages(torch.tensor([0.0, 2.0]), torch.tensor([1, 1]), eps=0.5)
    std = math.sqrt(2.0)
    assert out.tolist() == pytest.approx([-1.0 / (std + 0.5), 1.0 / (std + 0.5)], rel=1e-6)


@pytest.mark.parametrize("normalize_by_std", [True, False])
def test_grpo_singleton_groups_get_zero_advantage(normalize_by_std):
    rewards = torch.tensor([3.0, 1.0, 0.0, -5.0, 2.0])
    gids = torch.tensor([0, 1, 1, 2, 3])  # groups 0, 2, 3 are singletons
    out = grpo_advantages(rewards, gids, normalize_by_std=normalize_by_std)
    assert out[0].item() == 0.0 and out[3].item() == 0.0 and out[4].item() == 0.0
    assert out[1].item() != 0.0


def test_grpo_constant_reward_group_gives_zero_not_nan():
    out = grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 0, 1, 1]))
    assert torch.isfinite(out).all()
    assert out[:3].tolist() == [0.0, 0.0, 0.0]


def test_grpo_accepts_integer_and_bool_rewards():
    gids = torch.tensor([0, 0, 0, 1, 1])
    ints = torch.tensor([1, 0, 0, 1, 0])
    expected = ref_grpo([1.0, 0.0, 0.0, 1.0, 0.0], gids.tolist(), True)
    _close(grpo_advantages(ints, gids), expected)
    _close(grpo_advantages(ints.bool(), gids), expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rloo_advantage_is_reward_minus_mean_of_other_group_members(seed):
    rewards = _random_rewards(len(GROUP_IDS), seed)
    out = rloo_advantages(torch.tensor(rewards), torch.tensor(GROUP_IDS))
    _close(out, ref_rloo(rewards, GROUP_IDS))


def test_rloo_singleton_groups_get_zero_advantage():
    out = rloo_advantages(torch.tensor([5.0, 1.0, 2.0, -4.0]), torch.tensor([9, 3, 3, 8]))
    assert out[0].item() == 0.0 and out[3].item() == 0.0
    assert out[1:3].tolist() == pytest.approx([-1.0, 1.0])


def test_rloo_hand_computed_group_of_three():
    # r = (1, 2, 6): A_0 = 1 - 4 = -3, A_1 = 2 - 3.5 = -1.5, A_2 = 6 - 1.5 = 4.5
    out = rloo_advantages(torch.tensor([1.0, 2.0, 6.0]), torch.tensor([0, 0, 0]))
    assert out.tolist() == pytest.approx([-3.0, -1.5, 4.5], rel=1e-6)


def test_group_mean_std_reports_per_completion_mean_unbiased_std_and_size_with_std_one_for_singletons():
    rewards = _random_rewards(len(GROUP_IDS), 3)
    mean, std, count = group_mean_std(torch.tensor(rewards), torch.tensor(GROUP_IDS))
    groups = _groups(GROUP_IDS)
    for i, g in enumerate(GROUP_IDS):
        members = groups[g]
        n = len(members)
        m = sum(rewards[j] for j in members) / n
        s = math.sqrt(sum((rewards[j] - m) ** 2 for j in members) / (n - 1)) if n > 1 else 1.0
        assert mean[i].item() == pytest.approx(m, rel=1e-5, abs=1e-6)
        assert std[i].item() == pytest.approx(s, rel=1e-5, abs=1e-6)
        assert count[i].item() == n


@pytest.mark.parametrize("value", [1 / 3, 0.7, 1e-8, -2.1, 12345.678])
def test_an_all_equal_group_gets_exactly_zero_advantage_in_every_mode(value):
    # Rewards float32 cannot hold exactly: sum/size in float32 misses the value (8 x 1/3 gave +0.029 each after
    # the std division). A second, informative group sits beside it, interleaved, so the batch is not trivial.
    for size in range(2, 65):
        order = torch.randperm(size + 3, generator=torch.Generator().manual_seed(size))
        group_ids = torch.tensor([0] * size + [1, 1, 1])[order]
        rewards = torch.tensor([value] * size + [0.0, 1.0, 0.5])[order]
        equal = group_ids == 0
        for advantages in (grpo_advantages(rewards, group_ids),
                           grpo_advantages(rewards, group_ids, normalize_by_std=False),
                           rloo_advantages(rewards, group_ids)):
            assert advantages[equal].eq(0.0).all(), (size, advantages[equal])
            assert advantages[~equal].abs().max() > 0.1
        _, std, _ = group_mean_std(rewards, group_ids)
        assert std[equal].eq(0.0).all()


def test_the_plain_float32_mean_would_not_give_zero_for_thirds():
    # The reason the test above exists: the naive float32 computation leaves a non-zero advantage.
    rewards = torch.full((8,), 1 / 3)
    naive = rewards - rewards.sum() / 8
    assert naive.abs().max() > 0


def test_group_statistics_stay_float32_under_a_bfloat16_default_dtype():
    # Lightning's bf16-true precision sets the default dtype to bfloat16 inside training_step, where advantages and
    # DAPO's group filter run: nothing may be created (and accumulated) in the default dtype.
    from lightning_rlvr.algorithms.sampling import informative_groups

    rewards = torch.tensor([0.1, 0.7, 0.3, 0.3, 0.3, 1 / 3, 0.9, 0.2])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    expected = (grpo_advantages(rewards, group_ids), rloo_advantages(rewards, group_ids),
                informative_groups(rewards, group_ids))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        actual = (grpo_advantages(rewards, group_ids), rloo_advantages(rewards, group_ids),
                  informative_groups(rewards, group_ids))
    finally:
        torch.set_default_dtype(default)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype
        assert torch.equal(a, e)
