"""pass@k against the direct formula 1 - C(n-c, k) / C(n, k)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from lightning_rlvr.metrics import pass_at_k


def ref_pass_at_k(n: int, c: int, k: int) -> float:
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def test_matches_direct_formula_for_all_small_cases():
    for n in range(1, 13):
        for k in range(1, n + 1):
            correct = torch.arange(n + 1)
            out = pass_at_k(n, correct, k)
            expected = torch.tensor([ref_pass_at_k(n, c, k) for c in range(n + 1)])
            torch.testing.assert_close(out, expected.float(), rtol=1e-6, atol=1e-6, msg=f"n={n} k={k}")


@pytest.mark.parametrize("n,c,k", [(200, 3, 100), (100, 1, 10), (64, 32, 8), (1000, 5, 1)])
def test_matches_direct_formula_for_larger_n(n, c, k):
    out = pass_at_k(n, torch.tensor([c]), k)
    assert out.item() == pytest.approx(ref_pass_at_k(n, c, k), rel=1e-6, abs=1e-7)


def test_no_correct_sample_gives_zero():
    assert pass_at_k(10, torch.tensor([0, 0]), 5).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("k", [1, 4, 8])
def test_all_correct_gives_one(k):
    assert pass_at_k(8, torch.tensor([8]), k).item() == 1.0


def test_too_few_incorrect_samples_for_k_gives_one():
    # n - c < k: every draw of k contains a correct sample
    assert pass_at_k(8, torch.tensor([5]), 4).item() == 1.0


def test_k_equal_one_is_fraction_correct():
    correct = torch.tensor([0, 1, 3, 7, 10])
    torch.testing.assert_close(pass_at_k(10, correct, 1), correct.float() / 10)


def test_output_shape_and_dtype_and_float_input():
    out = pass_at_k(6, torch.tensor([1.0, 2.0, 6.0]), 2)
    assert out.shape == (3,) and out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([ref_pass_at_k(6, c, 2) for c in (1, 2, 6)]))
    assert pass_at_k(4, torch.tensor([], dtype=torch.long), 2).shape == (0,)


def test_monotone_in_k_and_c():
    n = 16
    table = [[pass_at_k(n, torch.tensor([c]), k).item() for k in range(1, n + 1)] for c in range(n + 1)]
    for c in range(n + 1):
        assert all(a <= b + 1e-7 for a, b in zip(table[c], table[c][1:]))
    for k in range(n):
        assert all(table[c][k] <= table[c + 1][k] + 1e-7 for c in range(n))


@pytest.mark.parametrize("k", [0, -1, 11])
def test_invalid_k_raises(k):
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(10, torch.tensor([3]), k)
