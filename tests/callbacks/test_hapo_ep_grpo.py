"""HAPO and EP-GRPO as callbacks: shaped advantages against the formulas computed by hand, metrics, fits."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlvr import RLVRModule
from lightning_rlvr.callbacks import EPGRPO, HAPO
from test_module import trainer

from .helpers import step_context
from .test_protocol import fixed, frozen_rollout

MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]


def case(advantages=(1.0, -1.0, 0.5, 0.0)):
    g = torch.Generator().manual_seed(5)
    step = step_context([1.0, 0.0, 1.0, 0.0], MASK, advantages=list(advantages), group_ids=[0, 0, 1, 1])
    step.old_entropy = 0.1 + torch.rand(4, 4, generator=g) * 2
    step.old_logprobs = -torch.rand(4, 4, generator=g) * 2
    step.old_sbar = 0.05 * torch.rand(4, 4, generator=g)
    step.ref_logprobs = step.old_logprobs + 0.3 * torch.randn(4, 4, generator=g)
    return step


def test_hapo_reallocates_within_each_response_keeping_sign_and_total():
    step = case()
    shaped = HAPO(strength=0.5, max_multiplier=100.0).shape_advantages(None, None, step)
    for i, row in enumerate(MASK):
        n = sum(row)
        h = step.old_entropy[i, :n]
        expected = step.advantages[i, 0] * (0.5 + 0.5 * h / h.mean())
        torch.testing.assert_close(shaped[i, :n], expected)
        assert (shaped[i, n:] == 0).all()
    m = step.metrics.means()
    assert m["hapo/mass_ratio"] == pytest.approx(1.0, rel=1e-5)
    assert sum(m[f"hapo/share_{q}"] for q in ("pos_high", "pos_low", "neg_high", "neg_low")) == pytest.approx(
        9 / 13)  # the 4 tokens of the zero-advantage row are in no quadrant: 9 of 13 valid tokens
    assert sum(m[f"hapo/credit_{q}"] for q in ("pos_high", "pos_low", "neg_high", "neg_low")) == pytest.approx(1.0)
    # predicted flow of the positive/high quadrant, by hand: −A'(π(log π + H) − S̄) summed / valid tokens
    valid = torch.tensor(MASK) > 0
    threshold = torch.kthvalue(step.old_entropy[valid], int(0.8 * 12) + 1).values
    pi = step.old_logprobs.exp()
    flow = -shaped * (pi * (step.old_logprobs + step.old_entropy) - step.old_sbar)
    in_q = valid & (step.advantages > 0) & (step.old_entropy >= threshold)
    assert m["hapo/flow_pos_high"] == pytest.approx((flow[in_q].sum() / 13).item(), rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("normalize", ["center", "zscore"])
def test_ep_grpo_by_hand(normalize):
    step = case()
    ep = EPGRPO(gate_strength=0.5, process_weight=0.1, divergence_temperature=0.5, progress_bins=2,
                normalize=normalize)
    shaped = ep.shape_advantages(None, None, step)
    # By hand: gate, signed tanh, cumulative-entropy progress bins of 2, centre (z-score) per (group, bin).
    raw = torch.zeros(4, 4)
    cell = torch.zeros(4, 4, dtype=torch.long)
    for i, row in enumerate(MASK):
        n = sum(row)
        h = step.old_entropy[i, :n]
        gate = (1 + 0.5 * (h / h.mean() - 1)).clamp(0.5, 2)
        a = step.advantages[i, 0].item()
        d = torch.tanh((step.old_logprobs[i, :n] - step.ref_logprobs[i, :n]) / 0.5)
        p = d * (math.copysign(1, a) if a != 0 else (1 if step.batch.correct[i] else -1))
        raw[i, :n] = gate * (a + 0.1 * p)
        progress = h.cumsum(0) / h.sum()
        cell[i, :n] = (torch.ceil(progress * 2).long() - 1).clamp(0, 1) + 2 * [0, 0, 1, 1][i]
    expected = torch.zeros(4, 4)
    valid = torch.tensor(MASK) > 0
    for c in cell[valid].unique():
        in_c = valid & (cell == c)
        x = raw[in_c]
        centred = x - x.mean()
        expected[in_c] = centred / (x.std(unbiased=False) + 1e-6) if normalize == "zscore" else centred
    torch.testing.assert_close(shaped, expected, rtol=1e-4, atol=1e-4)
    m = step.metrics.means()
    assert m["ep_grpo/zero_variance_groups"] == 0  # both groups have a non-zero advantage somewhere


def test_ep_grpo_keeps_a_gradient_in_a_zero_variance_group():
    step = case(advantages=(0.0, 0.0, 0.5, -0.5))
    shaped = EPGRPO(normalize="none").shape_advantages(None, None, step)
    assert shaped[:2].abs().sum() > 0  # the tanh(d) signal, since π_old ≠ π_ref
    # signed by the outcome: row 0 succeeded (+tanh d), row 1 failed (−tanh d); gate > 0 keeps the sign
    d = torch.tanh((step.old_logprobs - step.ref_logprobs) / 0.5)
    valid = torch.tensor(MASK) > 0
    assert (torch.sign(shaped[0][valid[0]]) == torch.sign(d[0][valid[0]])).all()
    assert (torch.sign(shaped[1][valid[1]]) == -torch.sign(d[1][valid[1]])).all()
    m = step.metrics.means()
    assert m["ep_grpo/zero_variance_groups"] == 0.5 and m["ep_grpo/zero_variance_with_gradient"] == 1.0


@pytest.mark.parametrize("callback", [HAPO(), EPGRPO()], ids=["hapo", "ep_grpo"])
def test_in_a_fit(tiny_model_dir, memory_logger, callback):
    batch = frozen_rollout(tiny_model_dir)
    trainer(2, callbacks=[callback], logger=memory_logger).fit(RLVRModule(model=tiny_model_dir, learning_rate=1e-3),
                                                               fixed(batch))
    h = memory_logger.history
    key = "hapo/mass_ratio" if isinstance(callback, HAPO) else "ep_grpo/gate_mean"
    assert set(h[key]) == {0, 1} and all(math.isfinite(v) for v in h[key].values())


def test_invalid_arguments():
    for cls, kwargs in ((HAPO, {"strength": 1.0}), (HAPO, {"max_multiplier": 1.0}), (HAPO, {"quadrant_quantile": 2}),
                        (EPGRPO, {"gate_low": 0}), (EPGRPO, {"process_weight": -1}), (EPGRPO, {"progress_bins": 0}),
                        (EPGRPO, {"divergence_temperature": 0}), (EPGRPO, {"normalize": True})):
        with pytest.raises(ValueError):
            cls(**kwargs)
