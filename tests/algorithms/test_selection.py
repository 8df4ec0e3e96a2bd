"""Token selection: stable top-k, ceil fraction, the reference's nonzero-then-randperm draw."""

import math

import pytest
import torch

from lightning_rlvr.algorithms.selection import random_subset_mask, top_fraction_mask, top_k_mask


def test_top_k_matches_a_sorted_loop_and_breaks_ties_by_position():
    values = torch.tensor([0.5, 2.0, 1.0, 2.0, 1.0, 1.0, -3.0])
    for k in range(len(values) + 2):
        ranked = sorted(range(len(values)), key=lambda i: (-values[i].item(), i))[:k]
        expected = torch.zeros(len(values), dtype=torch.bool)
        expected[ranked] = True
        assert torch.equal(top_k_mask(values, k), expected), k


def test_top_k_of_an_empty_vector_is_empty():
    assert top_k_mask(torch.zeros(0), 3).shape == (0,)


def test_top_fraction_keeps_the_ceiling_and_at_least_one():
    values = torch.arange(10.0)
    assert top_fraction_mask(values, 0.2).nonzero().flatten().tolist() == [8, 9]
    assert top_fraction_mask(values, 0.21).sum() == math.ceil(0.21 * 10) == 3
    assert top_fraction_mask(torch.tensor([4.0]), 0.01).tolist() == [True]  # single token
    assert top_fraction_mask(torch.zeros(0), 0.2).numel() == 0


def test_random_subset_is_the_randperm_prefix_over_candidates_in_order():
    candidates = torch.tensor([False, True, True, False, True, True, True])
    positions = [1, 2, 4, 5, 6]
    for n in (1, 3, 10):
        chosen = random_subset_mask(candidates, n, torch.Generator().manual_seed(7))
        perm = torch.randperm(len(positions), generator=torch.Generator().manual_seed(7))
        expected = torch.zeros(7, dtype=torch.bool)
        expected[[positions[i] for i in perm[: min(n, len(positions))].tolist()]] = True
        assert torch.equal(chosen, expected)
    assert not random_subset_mask(torch.zeros(4, dtype=torch.bool), 2).any()


def test_selection_rejects_non_vectors():
    with pytest.raises(ValueError, match="1-D"):
        top_k_mask(torch.zeros(2, 2), 1)
