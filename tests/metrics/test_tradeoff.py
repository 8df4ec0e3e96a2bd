"""Cui et al.'s entropy-performance fit R = −a·exp(H) + b against numpy's least squares and an exact curve."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_rlvr.metrics.tradeoff import exponential_tradeoff_fit


def test_an_exact_curve_is_recovered_with_r2_one_and_its_ceiling():
    entropy = [0.05, 0.2, 0.4, 0.7, 1.0]
    fit = exponential_tradeoff_fit(entropy, [-0.3 * math.exp(h) + 1.1 for h in entropy])
    assert (fit["a"], fit["b"], fit["r2"], fit["ceiling"], fit["n"]) == pytest.approx((0.3, 1.1, 1.0, 0.8, 5))


def test_noisy_points_match_numpy_polyfit_on_exp_h_and_nan_points_are_dropped():
    rng = np.random.default_rng(0)
    entropy = rng.uniform(0.05, 1.2, 40)
    performance = -0.25 * np.exp(entropy) + 0.9 + rng.normal(0, 0.05, 40)
    slope, intercept = np.polyfit(np.exp(entropy), performance, 1)
    residual = performance - (slope * np.exp(entropy) + intercept)
    r2 = 1 - (residual**2).sum() / ((performance - performance.mean()) ** 2).sum()
    fit = exponential_tradeoff_fit([*entropy, math.nan, 0.3], [*performance, 0.5, math.nan])
    assert (fit["a"], fit["b"], fit["r2"], fit["n"]) == pytest.approx((-slope, intercept, r2, 40))


def test_too_few_points_give_nan_and_mismatched_lengths_fail():
    assert math.isnan(exponential_tradeoff_fit([0.5], [0.3])["a"])
    assert math.isnan(exponential_tradeoff_fit([0.5, 0.5], [0.3, 0.4])["a"])  # one distinct entropy
    with pytest.raises(ValueError, match="2 entropies but 1"):
        exponential_tradeoff_fit([0.1, 0.2], [0.3])
