"""Engine importance weights (TIS / masked IS, token and sequence level) against per-token Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlvr.algorithms.engine_correction import ENGINE_IS_MODES, engine_importance_weights


def reference(old, engine, mask, cap, mode):
    """The weights and affected flags written out token by token from the definitions."""
    weights, affected = [], []
    for o_row, e_row, m_row in zip(old, engine, mask):
        sequence = math.exp(sum(o - e for o, e, m in zip(o_row, e_row, m_row) if m))
        w_row, a_row = [], []
        for o, e, m in zip(o_row, e_row, m_row):
            if not m:
                w_row.append(0.0)
                a_row.append(False)
                continue
            ratio = sequence if mode.startswith("sequence") else math.exp(o - e)
            if mode.endswith("truncate"):
                w_row.append(min(ratio, cap))
                a_row.append(ratio > cap)
            else:
                keep = 1 / cap <= ratio <= cap
                w_row.append(ratio if keep else 0.0)
                a_row.append(not keep)
        weights.append(w_row)
        affected.append(a_row)
    return weights, affected


@pytest.mark.parametrize("mode", ENGINE_IS_MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_and_affected_tokens_match_the_definitions(mode, seed):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 7, generator=generator) * 3
    engine = old + torch.randn(6, 7, generator=generator) * 0.5  # ratios spread on both sides of [1/C, C]
    lengths = torch.tensor([7, 5, 1, 3, 7, 2])
    mask = (torch.arange(7)[None] < lengths[:, None]).float()
    engine = torch.where(mask.bool(), engine, torch.full_like(engine, -torch.inf))  # padding may hold anything
    weights, affected = engine_importance_weights(old, engine, mask, 1.5, mode)
    expected_w, expected_a = reference(old.tolist(), engine.tolist(), mask.tolist(), 1.5, mode)
    torch.testing.assert_close(weights, torch.tensor(expected_w), rtol=1e-5, atol=1e-6)
    assert affected.tolist() == expected_a
    assert 0 < affected.sum() < mask.sum()  # both kinds of tokens occur in this draw
    assert not weights.requires_grad


def test_sequence_weights_are_one_value_per_response_and_do_not_overflow():
    old = torch.zeros(2, 400)
    engine = torch.full((2, 400), -1.0)  # ratio e per token: e^400 for the response
    mask = torch.ones(2, 400)
    weights, affected = engine_importance_weights(old, engine, mask, 2.0, "sequence_truncate")
    assert weights.eq(2.0).all() and affected.all()
    weights, affected = engine_importance_weights(old, engine, mask, 2.0, "sequence_mask")
    assert weights.eq(0.0).all() and affected.all() and torch.isfinite(weights).all()


def test_invalid_arguments_are_refused():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="mode"):
        engine_importance_weights(x, x, x, 2.0, "token_clip")
    with pytest.raises(ValueError, match="cap"):
        engine_importance_weights(x, x, x, 1.0)
