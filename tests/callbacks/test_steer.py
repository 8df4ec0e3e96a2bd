"""STEER's token weights through the callback against a per-token loop of the reference code's rules."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlvr.callbacks import STEER
from tests.callbacks.helpers import micro_context, step_context

MASK = [[1, 1, 1, 0], [1, 1, 1, 1]]


def inputs():
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(2, 4, generator=g) * 3
    old_logprobs = logprobs + 0.1 * torch.randn(2, 4, generator=g)
    old_entropy = 0.5 + torch.rand(2, 4, generator=g)
    return logprobs, old_logprobs, old_entropy


def reference_weights(mode, w_min, w_max, advantages, logprobs, old_logprobs, old_entropy, mask):
    """The released compute_token_weights, one token at a time with the math module."""
    magnitudes = {}
    for i in range(len(mask)):
        for t in range(len(mask[i])):
            if mask[i][t]:
                x = min(max(math.exp(logprobs[i][t]), 1e-8), 1 - 1e-8)
                old_p = min(max(math.exp(old_logprobs[i][t]), 1e-8), 1.0)
                magnitudes[i, t] = abs(advantages[i] / old_p * x * (1 - x) * (math.log(x) + old_entropy[i][t]))
    lo, hi = min(magnitudes.values()), max(magnitudes.values())
    out = [[0.0] * len(row) for row in mask]
    for (i, t), m in magnitudes.items():
        if mode == "exp":
            k = -math.log(w_min) / max(hi, 0.02)
            out[i][t] = min(max(math.exp(-k * m), w_min), 1.0)
        else:
            out[i][t] = min(max(w_max - (m - lo) * (w_max - w_min) / (hi - lo), w_min), w_max)
    return torch.tensor(out)


@pytest.mark.parametrize("mode", ["exp", "linear"])
def test_weights_match_the_reference_rule_per_token(mode):
    logprobs, old_logprobs, old_entropy = inputs()
    advantages = [1.2, -0.8]
    step = step_context([1.0, 0.0], MASK, advantages=advantages)
    mctx = micro_context(step, logprobs, old_logprobs, entropy=torch.zeros(2, 4), old_entropy=old_entropy)
    weights = STEER(mode=mode, w_min=0.8, w_max=1.2).token_weights(None, None, mctx)
    expected = reference_weights(mode, 0.8, 1.2, advantages, logprobs.tolist(), old_logprobs.tolist(),
                                 old_entropy.tolist(), MASK)
    torch.testing.assert_close(weights, expected, rtol=1e-5, atol=1e-6)
    metrics = step.metrics.means()
    valid = torch.tensor(MASK, dtype=torch.bool)
    assert metrics["steer/weight_min"] == pytest.approx(expected[valid].min().item(), rel=1e-5)
    assert metrics["steer/weight_max"] == pytest.approx(expected[valid].max().item(), rel=1e-5)
    assert metrics["steer/weight_mean"] == pytest.approx(expected[valid].mean().item(), rel=1e-5)
    if mode == "exp":  # the largest |Ω| (here above the 0.02 floor) gets exactly λ_min
        assert metrics["steer/weight_min"] == pytest.approx(0.8, rel=1e-6)


def test_old_entropy_not_current_entropy_enters_the_code_omega():
    logprobs, old_logprobs, old_entropy = inputs()
    step = step_context([1.0, 0.0], MASK, advantages=[1.2, -0.8])
    a = STEER().token_weights(None, None, micro_context(step, logprobs, old_logprobs, entropy=torch.zeros(2, 4),
                                                        old_entropy=old_entropy))
    b = STEER().token_weights(None, None, micro_context(step, logprobs, old_logprobs, entropy=torch.ones(2, 4) * 9,
                                                        old_entropy=old_entropy))
    torch.testing.assert_close(a, b)


def test_exact_omega_asks_for_flow_stats_and_uses_sbar():
    logprobs, old_logprobs, entropy = inputs()
    steer = STEER(mode="linear", omega="exact")
    assert steer.needs.flow_stats and not STEER().needs.flow_stats
    step = step_context([1.0, 0.0], MASK, advantages=[1.0, -1.0])
    sbar = torch.full((2, 4), 0.05)
    weights = steer.token_weights(None, None, micro_context(step, logprobs, old_logprobs, entropy=entropy, sbar=sbar))
    ratio = torch.exp(logprobs - old_logprobs)
    omega = torch.tensor([[1.0], [-1.0]]) * ratio * (logprobs.exp() * (logprobs + entropy) - sbar)
    valid = torch.tensor(MASK, dtype=torch.bool)
    m = omega.abs()
    lo, hi = m[valid].min(), m[valid].max()
    expected = torch.where(valid, (1.2 - (m - lo) * 0.4 / (hi - lo)).clamp(0.8, 1.2), torch.zeros_like(m))
    torch.testing.assert_close(weights, expected, rtol=1e-5, atol=1e-6)


def test_all_equal_omega_and_no_valid_token():
    step = step_context([1.0], [[1, 1]], advantages=[1.0])
    same = micro_context(step, torch.full((1, 2), -1.0), entropy=torch.zeros(1, 2), old_entropy=torch.full((1, 2), 2.0))
    torch.testing.assert_close(STEER(mode="linear").token_weights(None, None, same), torch.ones(1, 2))
    torch.testing.assert_close(STEER(mode="exp").token_weights(None, None, same), torch.full((1, 2), 0.8))
    empty = step_context([1.0], [[0, 0]], advantages=[1.0])
    none = micro_context(empty, torch.zeros(1, 2), entropy=torch.zeros(1, 2))
    torch.testing.assert_close(STEER().token_weights(None, None, none), torch.ones(1, 2))


@pytest.mark.parametrize("kwargs, match", [({"mode": "cubic"}, "mode"), ({"omega": "x"}, "omega"),
                                           ({"w_min": 1.0}, "w_min"), ({"mode": "linear", "w_min": 1.3}, "w_max"),
                                           ({"omega_floor": 0.0}, "omega_floor")])
def test_invalid_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        STEER(**kwargs)
