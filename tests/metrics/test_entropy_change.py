"""Agreement statistics against scipy.stats and numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from lightning_rlvr.metrics.entropy_change import (
    average_ranks,
    fitted_step_size,
    pearson,
    sign_agreement,
    spearman,
)


def series(seed: int, n: int = 40, ties: bool = False):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    y = 0.6 * x + rng.normal(scale=0.8, size=n)
    if ties:
        x, y = np.round(x, 1), np.round(y, 0)
    return x, y


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("ties", [False, True])
def test_correlations_match_scipy(seed, ties):
    x, y = series(seed, ties=ties)
    assert pearson(torch.tensor(x), torch.tensor(y)) == pytest.approx(stats.pearsonr(x, y).statistic, rel=1e-10)
    assert spearman(torch.tensor(x), torch.tensor(y)) == pytest.approx(stats.spearmanr(x, y).statistic, rel=1e-10)
    np.testing.assert_allclose(average_ranks(torch.tensor(x)).numpy(), stats.rankdata(x) - 1)


def test_sign_agreement_and_step_size_by_hand():
    predicted, observed = torch.tensor([1.0, -2.0, 0.5, 0.0, -1.0]), torch.tensor([2.0, -1.0, -0.1, 0.0, 0.3])
    assert sign_agreement(predicted, observed) == pytest.approx(3 / 5)  # agree, agree, no, zero=zero, no
    x, y = series(7)
    (eta,), *_ = np.linalg.lstsq(x[:, None], y, rcond=None)
    assert fitted_step_size(torch.tensor(x), torch.tensor(y)) == pytest.approx(eta, rel=1e-10)


def test_undefined_statistics_are_nan_and_non_finite_points_are_dropped():
    assert math.isnan(pearson(torch.ones(5), torch.arange(5.0)))  # constant series
    assert math.isnan(spearman(torch.tensor([1.0]), torch.tensor([2.0])))
    assert math.isnan(sign_agreement(torch.tensor([]), torch.tensor([])))
    assert math.isnan(fitted_step_size(torch.zeros(3), torch.ones(3)))
    x, y = series(1)
    with_nan = torch.tensor(np.append(x, np.nan)), torch.tensor(np.append(y, 1.0))
    assert pearson(*with_nan) == pytest.approx(stats.pearsonr(x, y).statistic, rel=1e-10)
    with pytest.raises(ValueError, match="differ in length"):
        pearson(torch.ones(3), torch.ones(4))


def test_the_figures_sign_agreement_counts_a_zero_prediction_as_the_logged_metric_does():
    """A zero prediction matches only a zero change (the logged probe/window/sign_agreement_*), never a fall."""
    from lightning_rlvr.plots import entropy_change_figure

    covariance, flow, observed = [0.0, -1.0, 1.0, 2.0], [0.0, 1.0, -1.0, 0.5], [-0.3, 0.2, -0.1, -0.4]
    titles = [ax.get_title() for ax in entropy_change_figure(covariance, flow, observed).axes]
    # -covariance = [0, 1, -1, -2] agrees at rows 1, 2, 3; flow at rows 1, 2; a zero forecast at row 0 is no "down".
    assert titles == ["−covariance: sign agreement 0.75", "flow: sign agreement 0.50"]  # counting 0 as "down": 1.00, 0.75
