"""Bucketed means against a plain Python loop; bucket assignments by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlvr.metrics.entropy_analysis import BucketedMean, bucketed_mean, position_buckets, rank_buckets


def test_bucketed_mean_matches_a_loop_over_updates():
    g = torch.Generator().manual_seed(0)
    metric = BucketedMean(4)
    sums, counts = [0.0] * 4, [0.0] * 4
    for _ in range(3):
        values, buckets, weights = torch.randn(20, generator=g), torch.randint(0, 3, (20,), generator=g), torch.rand(20, generator=g)
        metric.update(values, buckets, weights)
        for v, b, w in zip(values.tolist(), buckets.tolist(), weights.tolist()):
            sums[b] += v * w
            counts[b] += w
    result = metric.compute()
    for b in range(3):
        assert result["mean"][b].item() == pytest.approx(sums[b] / counts[b], rel=1e-5)
        assert result["count"][b].item() == pytest.approx(counts[b], rel=1e-5)
    assert math.isnan(result["mean"][3].item())  # an empty bucket
    torch.testing.assert_close(bucketed_mean(torch.tensor([1.0, 3.0]), torch.tensor([1, 1]), 2),
                               torch.tensor([float("nan"), 2.0]), equal_nan=True)


def test_out_of_range_buckets_are_an_error_unless_weighted_zero():
    metric = BucketedMean(2)
    metric.update(torch.tensor([1.0, 2.0]), torch.tensor([0, 5]), torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="bucket"):
        metric.update(torch.tensor([1.0]), torch.tensor([2]))


def test_position_buckets_use_the_centred_relative_position():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0] * 5])
    # length 3: (t + 1/2)/3 = 1/6, 1/2, 5/6 -> deciles 1, 5, 8; length 5: 0.1, 0.3, ... -> 1, 3, 5, 7, 9
    assert position_buckets(mask, 10).tolist() == [[1, 5, 8, 0, 0], [1, 3, 5, 7, 9]]
    assert position_buckets(mask, 2).tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]]


def test_rank_buckets_have_equal_counts_and_order():
    values = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0, 0.0])
    assert rank_buckets(values, 3).tolist() == [2, 0, 2, 1, 1, 0]
