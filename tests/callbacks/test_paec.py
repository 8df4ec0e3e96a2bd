"""PAEC: the anchored floor penalty's value and gradient against autograd on the direct formula, the anchor, a fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_rlvr import RLVRModule
from lightning_rlvr.callbacks import HAPO, PAEC, Needs
from test_module import trainer

from .helpers import micro_context, step_context
from .test_protocol import fixed, frozen_rollout

MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


def case():
    g = torch.Generator().manual_seed(2)
    step = step_context([1.0, 0.0, 1.0], MASK, advantages=[1.0, -1.0, 0.5])
    entropy = (0.2 + torch.rand(3, 4, generator=g) * 1.5).requires_grad_(True)
    mctx = micro_context(step, -torch.rand(3, 4, generator=g), entropy=entropy)
    mctx.nucleus_entropy = torch.rand(3, 4, generator=g) * 2
    mctx.top2_gap = torch.rand(3, 4, generator=g) * 3
    return mctx


def mask_by_hand(mctx, quantile=0.8, t_h=0.1, t_d=0.5):
    valid = mctx.mask > 0
    h_top, gap = mctx.nucleus_entropy[valid].numpy(), mctx.top2_gap[valid].numpy()
    tau_h = np.quantile(h_top, quantile, method="lower")
    tau_d = np.quantile(gap, 1 - quantile, method="lower")
    g = 1 / (1 + np.exp(-(mctx.nucleus_entropy.numpy() - tau_h) / t_h)) / (1 + np.exp(-(tau_d - mctx.top2_gap.numpy()) / t_d))
    return torch.tensor(g, dtype=torch.float32) * mctx.mask


def ready(paec: PAEC, anchor: float) -> PAEC:
    paec.anchor_sum, paec.anchor_count = anchor * paec.anchor_steps, paec.anchor_steps
    return paec


@pytest.mark.parametrize("mask", ["soft", "none"])
def test_aggregate_hinge_value_and_gradient_equal_autograd_on_the_formula(mask):
    mctx = case()
    g = mask_by_hand(mctx) if mask == "soft" else mctx.mask
    reference = mctx.entropy.detach().clone().requires_grad_(True)
    selected = (g * reference).sum() / g.sum()
    floor = 1.2 * selected.item() / 0.9  # the anchor is set so that H̄ is below the floor
    expected = 0.05 * torch.relu(floor - selected) ** 2
    expected.backward()
    paec = ready(PAEC(mask=mask), anchor=floor / 0.9)
    term = paec.extra_loss(None, None, mctx)
    term.backward()
    assert term.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(mctx.entropy.grad, reference.grad, rtol=1e-5, atol=1e-8)
    metrics = mctx.step.metrics.means()
    assert metrics["paec/below_floor"] == 1 and metrics["paec/selected_entropy"] == pytest.approx(selected.item(), rel=1e-5)


def test_hinge_is_silent_above_the_floor():
    mctx = case()
    paec = ready(PAEC(), anchor=0.01)
    term = paec.extra_loss(None, None, mctx)
    term.backward()
    assert term.item() == 0 and (mctx.entropy.grad == 0).all()
    assert mctx.step.metrics.means()["paec/below_floor"] == 0


def test_per_token_hinge_by_hand():
    mctx = case()
    g = mask_by_hand(mctx)
    paec = ready(PAEC(hinge="per_token", coefficient=0.1), anchor=1.0)
    term = paec.extra_loss(None, None, mctx)
    floor = 0.9
    expected = 0.1 * (g * torch.relu(floor - mctx.entropy.detach()) ** 2).sum() / g.sum()
    assert term.item() == pytest.approx(expected.item(), rel=1e-5)


def test_anchor_is_the_mean_selected_entropy_of_the_first_k_steps_and_no_penalty_before():
    paec = PAEC(anchor_steps=2)
    seen = []
    for _ in range(3):
        mctx = case()
        mctx.entropy = mctx.entropy.detach() * (1 + len(seen))  # a different entropy each step
        g = mask_by_hand(mctx)
        seen.append(((g * mctx.entropy).sum() / g.sum()).item())
        term = paec.extra_loss(None, None, mctx)
        assert (term is None) == (len(seen) <= 2)
        paec.on_update_end(None, None, mctx.step)
    assert paec.anchor == pytest.approx((seen[0] + seen[1]) / 2, rel=1e-6)
    restored = PAEC(anchor_steps=2)
    restored.load_state_dict(paec.state_dict())
    assert restored.anchor == paec.anchor


def test_arguments_and_needs():
    assert PAEC().needs == Needs(entropy_grad=True, nucleus_top_p=0.9, minibatch_stats=True)
    assert PAEC(mask="none").needs.nucleus_top_p is None
    with pytest.raises(ValueError, match="different top_p"):
        _ = PAEC(top_p=0.9).needs | PAEC(top_p=0.5).needs
    assert (PAEC().needs | HAPO().needs).nucleus_top_p == 0.9
    for kwargs in ({"coefficient": -1}, {"floor_ratio": 0}, {"mask_quantile": 1}, {"top_p": 0}, {"anchor_steps": 0},
                   {"hinge": "x"}, {"mask": "x"}, {"gap_temperature": 0}):
        with pytest.raises(ValueError):
            PAEC(**kwargs)


def test_paec_in_a_fit_anchors_then_penalises(tiny_model_dir, memory_logger):
    batch = frozen_rollout(tiny_model_dir)
    paec = PAEC(anchor_steps=2, floor_ratio=2.0)  # a floor above the entropy: the hinge is active after step 2
    trainer(4, callbacks=[paec], logger=memory_logger).fit(RLVRModule(model=tiny_model_dir, learning_rate=1e-3),
                                                           fixed(batch))
    h = memory_logger.history
    assert "paec/penalty" not in h or set(h["paec/penalty"]) == {2, 3}
    assert h["paec/below_floor"][3] == 1 and h["paec/penalty"][3] > 0
    assert h["loss/interventions"][3] == pytest.approx(h["paec/penalty"][3], rel=1e-5)
    assert paec.anchor == pytest.approx((h["paec/selected_entropy"][0] + h["paec/selected_entropy"][1]) / 2, rel=1e-5)
