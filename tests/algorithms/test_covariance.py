"""Clip-Cov / KL-Cov selections against loop references (Cui et al. 2505.22617, reference code semantics)."""

import torch

from lightning_rlvr.algorithms.covariance import clip_cov_selection, kl_cov_selection, token_covariance


def loop_covariance(logprobs, advantages):
    n = len(logprobs)
    mean_lp = sum(logprobs) / n
    mean_a = sum(advantages) / n
    return [(lp - mean_lp) * (a - mean_a) for lp, a in zip(logprobs, advantages)]


def test_token_covariance_is_the_centred_product():
    logprobs, advantages = [-0.1, -2.0, -0.5, -3.0], [1.5, -0.5, 1.5, -2.5]
    got = token_covariance(torch.tensor(logprobs), torch.tensor(advantages))
    torch.testing.assert_close(got, torch.tensor(loop_covariance(logprobs, advantages)))
    assert token_covariance(torch.zeros(0), torch.zeros(0)).numel() == 0


def test_kl_cov_takes_floor_of_ratio_and_at_least_one():
    cov = torch.tensor([0.1, 3.0, -1.0, 2.0, 2.0, 0.0, 5.0, 1.0, 1.0, 1.0])
    assert kl_cov_selection(cov, 0.2).nonzero().flatten().tolist() == [1, 6]   # ⌊0.2·10⌋ = 2
    assert kl_cov_selection(cov, 0.01).nonzero().flatten().tolist() == [6]     # max(1, 0)
    assert kl_cov_selection(cov, 0.3).nonzero().flatten().tolist() == [1, 3, 6]  # tie 3 vs 4 -> earlier
    assert kl_cov_selection(torch.zeros(0), 0.5).numel() == 0


def test_clip_cov_draws_only_strictly_inside_the_bounds_and_eligible():
    cov = torch.tensor([1.0, 1.5, 5.0, 4.9, 0.2, 3.0, 2.0, 7.0])
    eligible = torch.tensor([True, True, True, True, True, False, True, True])
    # candidates: 1 (1.5), 3 (4.9), 6 (2.0); 5 is PPO-clipped, 0 and 2 sit on the (exclusive) bounds
    everything = clip_cov_selection(cov, eligible, ratio=1.0, lower=1.0, upper=5.0)
    assert everything.nonzero().flatten().tolist() == [1, 3, 6]
    one = clip_cov_selection(cov, eligible, ratio=1e-4, lower=1.0, upper=5.0, generator=torch.Generator().manual_seed(3))
    assert one.sum() == 1 and one.nonzero().item() in (1, 3, 6)
    # n = ⌊0.25 · 8⌋ = 2 of the 3 candidates
    assert clip_cov_selection(cov, eligible, ratio=0.25, lower=1.0, upper=5.0).sum() == 2
    # all-equal advantages: zero covariance, nothing to detach
    flat = token_covariance(torch.randn(8), torch.ones(8))
    assert not clip_cov_selection(flat, torch.ones(8, dtype=torch.bool), 0.5, 1.0, 5.0).any()
