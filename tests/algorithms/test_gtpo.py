"""GTPO shaped token rewards and advantages against hand values and a loop reference (arXiv 2508.04349)."""

import math

import pytest
import torch

from lightning_rlvr.algorithms.gtpo import gtpo_advantages, gtpo_token_rewards


def loop_rewards(rewards, entropy, mask, groups, a1, a2, thr, eps):
    n, width = mask.shape
    out = torch.zeros(n, width)
    for i in range(n):
        for t in range(width):
            if not mask[i, t]:
                continue
            same = [k for k in range(n) if groups[k] == groups[i] and mask[k, t]]
            if rewards[i] > thr:
                pos = [k for k in same if rewards[k] > thr]
                share = (entropy[i, t] + eps) / sum(entropy[k, t] + eps for k in pos)
                out[i, t] = a1 * rewards[i] + a2 * share * len(pos)
            else:
                neg = [k for k in same if rewards[k] <= thr]
                share = (1 / (entropy[i, t] + eps)) / sum(1 / (entropy[k, t] + eps) for k in neg)
                out[i, t] = -a1 - a2 * share * len(neg)
    return out


def loop_advantages(shaped, rewards, mask, groups, thr, normalization, eps):
    n, width = mask.shape
    out = torch.zeros(n, width)
    for i in range(n):
        members = [k for k in range(n) if groups[k] == groups[i]]
        polarities = {bool(rewards[k] > thr) for k in members}
        if len(polarities) < 2:
            continue
        if normalization == "polarity":
            members = [k for k in members if bool(rewards[k] > thr) == bool(rewards[i] > thr)]
        values = [shaped[k, t].item() for k in members for t in range(width) if mask[k, t]]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        for t in range(width):
            if mask[i, t]:
                out[i, t] = (shaped[i, t] - mean) / (std + eps)
    return out


def test_shaped_rewards_by_hand():
    # One group: two correct responses, one wrong; the second correct one is a token shorter.
    rewards = torch.tensor([1.0, 1.0, 0.0])
    entropy = torch.tensor([[3.0, 1.0], [1.0, 0.0], [2.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    shaped = gtpo_token_rewards(rewards, entropy, mask, torch.zeros(3), 1.0, 0.1, eps=1e-12)
    # t=0: O+ entropies 3, 1 (d=2): 1 + 0.1·(3/4)·2 = 1.15 and 1 + 0.1·(1/4)·2 = 1.05
    # t=1: only response 0 active in O+ (d=1): 1 + 0.1·1·1 = 1.1; O- alone: −1 − 0.1 = −1.1
    expected = torch.tensor([[1.15, 1.1], [1.05, 0.0], [-1.1, -1.1]])
    torch.testing.assert_close(shaped, expected)


def test_wrong_responses_are_penalised_hardest_where_confident():
    rewards = torch.tensor([0.0, 0.0])
    entropy = torch.tensor([[4.0], [1.0]])
    shaped = gtpo_token_rewards(rewards, entropy, torch.ones(2, 1), torch.zeros(2), 1.0, 0.1, eps=1e-12)
    # inverse entropies 0.25, 1 (sum 1.25, h=2): −1 − 0.1·0.2·2 = −1.04 and −1 − 0.1·0.8·2 = −1.16
    torch.testing.assert_close(shaped, torch.tensor([[-1.04], [-1.16]]))


def test_reward_is_conserved_when_alphas_sum_to_one():
    torch.manual_seed(0)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    shaped = gtpo_token_rewards(rewards, torch.rand(5, 4) * 3, mask, torch.zeros(5), 0.9, 0.1)
    pos, neg = mask[:3], mask[3:]
    torch.testing.assert_close(shaped[:3].sum(0), pos.sum(0))
    torch.testing.assert_close(shaped[3:].sum(0), -neg.sum(0))


@pytest.mark.parametrize("normalization", ["group", "polarity"])
def test_random_batches_match_the_loop_reference(normalization):
    torch.manual_seed(1)
    n, width = 12, 5
    groups = torch.arange(n) // 4
    rewards = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 1], dtype=torch.float32)  # group 1 has no O+
    lengths = torch.randint(1, width + 1, (n,))
    mask = (torch.arange(width) < lengths.unsqueeze(-1)).float()
    entropy = torch.rand(n, width) * 2
    entropy[0, 0] = 0.0  # zero entropy stays defined through eps
    shaped = gtpo_token_rewards(rewards, entropy, mask, groups, 1.0, 0.1, 0.5, 1e-6)
    torch.testing.assert_close(shaped, loop_rewards(rewards, entropy, mask, groups, 1.0, 0.1, 0.5, 1e-6))
    adv = gtpo_advantages(shaped, rewards, mask, groups, 0.5, normalization, 1e-6)
    torch.testing.assert_close(adv, loop_advantages(shaped, rewards, mask, groups, 0.5, normalization, 1e-6))
    assert adv[4:8].abs().sum() == 0  # all-wrong group: no signal


def test_group_normalisation_keeps_the_sign_of_correctness_and_polarity_drops_it():
    rewards = torch.tensor([1.0, 0.0])
    entropy = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    mask = torch.ones(2, 2)
    shaped = gtpo_token_rewards(rewards, entropy, mask, torch.zeros(2))
    grouped = gtpo_advantages(shaped, rewards, mask, torch.zeros(2), normalization="group")
    assert (grouped[0] > 0).all() and (grouped[1] < 0).all()
    by_polarity = gtpo_advantages(shaped, rewards, mask, torch.zeros(2), normalization="polarity")
    assert torch.allclose(by_polarity.sum(-1), torch.zeros(2), atol=1e-5)


def test_single_token_and_empty_mask():
    rewards = torch.tensor([1.0, 0.0])
    one = torch.tensor([[1.0], [1.0]])
    shaped = gtpo_token_rewards(rewards, torch.ones(2, 1), one, torch.zeros(2))
    adv = gtpo_advantages(shaped, rewards, one, torch.zeros(2))
    torch.testing.assert_close(adv, torch.tensor([[1.0], [-1.0]]), atol=1e-4, rtol=0)
    empty = torch.zeros(2, 3)
    assert gtpo_advantages(gtpo_token_rewards(rewards, torch.ones(2, 3), empty, torch.zeros(2)), rewards, empty,
                           torch.zeros(2)).abs().sum() == 0
