"""PAEC's mask and floor penalty, and the nucleus statistics, against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlvr.algorithms.position_calibration import decision_sensitivity_mask, entropy_floor_penalty
from lightning_rlvr.ops import nucleus_entropy_and_gap


def nucleus_by_hand(probabilities: list[float], top_p: float) -> tuple[float, float]:
    """Sort, keep tokens until the mass before them reaches top_p, renormalise, entropy; log p1 − log p2."""
    ranked = sorted(probabilities, reverse=True)
    kept, mass = [], 0.0
    for p in ranked:
        if mass >= top_p:
            break
        kept.append(p)
        mass += p
    total = sum(kept)
    entropy = -sum(p / total * math.log(p / total) for p in kept)
    return entropy, math.log(ranked[0]) - math.log(ranked[1])


@pytest.mark.parametrize("top_p", [0.5, 0.9, 1.0])
def test_nucleus_entropy_and_gap_match_a_sorted_loop(top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 2
    entropy, gap = nucleus_entropy_and_gap(logits, temperature=0.7, top_p=top_p, chunk_size=4)
    probabilities = torch.softmax(logits.double() / 0.7, -1)
    for index in torch.cartesian_prod(torch.arange(3), torch.arange(5)).tolist():
        h, d = nucleus_by_hand(probabilities[tuple(index)].tolist(), top_p)
        assert entropy[tuple(index)].item() == pytest.approx(h, abs=1e-5)
        assert gap[tuple(index)].item() == pytest.approx(d, abs=1e-4)


def test_nucleus_of_the_full_mass_is_the_full_entropy_and_a_peak_has_zero():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [20.0, 0.0, 0.0, 0.0]])
    entropy, gap = nucleus_entropy_and_gap(logits, top_p=1.0)
    assert entropy[0].item() == pytest.approx(math.log(4), abs=1e-6) and gap[0].item() == 0
    entropy, gap = nucleus_entropy_and_gap(logits, top_p=0.9)
    assert entropy[1].item() == 0 and gap[1].item() == pytest.approx(20.0, abs=1e-4)
    truncated, _ = nucleus_entropy_and_gap(torch.zeros(1, 1000), top_p=0.9, max_candidates=16)
    assert truncated.item() == pytest.approx(math.log(16), abs=1e-5)  # only the candidates are ranked


def test_mask_is_the_product_of_two_sigmoids():
    nucleus = torch.tensor([0.2, 1.0, 1.0, 0.2])
    gap = torch.tensor([0.1, 0.1, 3.0, 3.0])
    g = decision_sensitivity_mask(nucleus, gap, entropy_threshold=0.6, gap_threshold=1.0, entropy_temperature=0.1,
                                  gap_temperature=0.5)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = [sig((h - 0.6) / 0.1) * sig((1.0 - d) / 0.5) for h, d in zip(nucleus.tolist(), gap.tolist())]
    torch.testing.assert_close(g, torch.tensor(expected))
    assert g.argmax().item() == 1  # high entropy and competing top two: the decision-sensitive position
    with pytest.raises(ValueError, match="temperatures"):
        decision_sensitivity_mask(nucleus, gap, 0.6, 1.0, entropy_temperature=0.0)


def test_floor_penalty_is_zero_above_the_floor_and_quadratic_below():
    h = torch.tensor([0.5, 0.9, 1.0, 1.2], requires_grad=True)
    penalty = entropy_floor_penalty(h, 1.0)
    torch.testing.assert_close(penalty.detach(), torch.tensor([0.25, 0.01, 0.0, 0.0]))
    penalty.sum().backward()
    torch.testing.assert_close(h.grad, torch.tensor([-1.0, -0.2, 0.0, 0.0]))  # d/dH (1 − H)² = −2(1 − H)
