"""OPEFO's flow-balancing weights against hand computations, its strict on-policy check, and a fit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_rlvr import RLVRModule
from lightning_rlvr.callbacks import OPEFO
from test_module import trainer

from .helpers import micro_context, step_context
from .test_protocol import fixed, frozen_rollout

MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


def case(advantages=(1.0, -0.5, 0.0)):
    g = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(3, 4, generator=g) * 3
    entropy = 0.2 + torch.rand(3, 4, generator=g) * 1.5
    sbar = 0.01 + 0.1 * torch.rand(3, 4, generator=g)
    step = step_context([1.0, 0.0, 1.0], MASK, advantages=list(advantages))
    return step, micro_context(step, logprobs, entropy=entropy, sbar=sbar), logprobs, entropy, sbar


def by_hand_flow(advantages, logprobs, entropy, sbar):
    """c = −A (π(log π + H) − S̄) per valid token (on-policy, r = 1), loops over the rows."""
    out = torch.zeros_like(logprobs)
    for i, row in enumerate(MASK):
        for t, valid in enumerate(row):
            if valid:
                pi = logprobs[i, t].exp()
                out[i, t] = -advantages[i] * (pi * (logprobs[i, t] + entropy[i, t]) - sbar[i, t])
    return out


def balancing_coefficient_by_hand(flow):
    up, down = flow[flow > 0].sum(), -flow[flow < 0].sum()
    return ((down - up) / (down + up)).item()


def test_adaptive_weights_balance_the_predicted_flow_to_zero():
    advantages = (1.0, -0.5, 0.0)
    step, mctx, logprobs, entropy, sbar = case(advantages)
    weights = OPEFO().token_weights(None, None, mctx)
    flow = by_hand_flow(advantages, logprobs, entropy, sbar)
    lam = balancing_coefficient_by_hand(flow)
    expected = torch.where(flow > 0, 1 + lam, torch.where(flow < 0, 1 - lam, 1.0))
    torch.testing.assert_close(weights, expected, rtol=1e-5, atol=1e-6)
    assert (weights[2] == 1).all()  # a zero-advantage row has no predicted flow: untouched
    assert (weights > 0).all()  # |λ*| < 1: every token keeps the sign of its update
    metrics = step.metrics.means()
    assert metrics["opefo/lambda"] == pytest.approx(lam, rel=1e-5)
    assert metrics["opefo/net_flow_weighted"] == pytest.approx(0.0, abs=1e-6)
    n_up, n_down = (flow > 0).sum().item(), (flow < 0).sum().item()
    assert metrics["opefo/increasing_fraction"] == pytest.approx(n_up / (n_up + n_down))


@pytest.mark.parametrize("sides", ["both", "increasing", "decreasing"])
def test_static_coefficient_and_one_sided_ablations(sides):
    advantages = (1.0, -0.5, 0.0)
    _, mctx, logprobs, entropy, sbar = case(advantages)
    weights = OPEFO(coefficient="static", static_lambda=0.1, sides=sides).token_weights(None, None, mctx)
    flow = by_hand_flow(advantages, logprobs, entropy, sbar)
    up_weight = 1.1 if sides in ("both", "increasing") else 1.0
    down_weight = 0.9 if sides in ("both", "decreasing") else 1.0
    expected = torch.where(flow > 0, up_weight, torch.where(flow < 0, down_weight, 1.0))
    torch.testing.assert_close(weights, expected)


def test_onlyza_flow_needs_no_sbar_and_uses_the_sampled_logit_estimate():
    advantages = (1.0, -0.5, 0.0)
    step, mctx, logprobs, entropy, _ = case(advantages)
    mctx.sbar = None
    opefo = OPEFO(flow="onlyza")
    assert not opefo.needs.flow_stats and OPEFO().needs.flow_stats
    weights = opefo.token_weights(None, None, mctx)
    pi = logprobs.exp()
    flow = -torch.tensor(advantages).unsqueeze(-1) * pi * (1 - pi) * (logprobs + entropy) * step.mask
    lam = balancing_coefficient_by_hand(flow)
    torch.testing.assert_close(weights, torch.where(flow > 0, 1 + lam, torch.where(flow < 0, 1 - lam, 1.0)),
                               rtol=1e-5, atol=1e-6)


def test_clipped_tokens_have_no_flow_off_policy():
    advantages = (1.0, -0.5, 0.0)
    step, _, logprobs, entropy, sbar = case(advantages)
    old = logprobs - 0.5  # ratio e^0.5 > 1.2: every A > 0 token is clipped
    mctx = micro_context(step, logprobs, old, entropy=entropy, sbar=sbar)
    weights = OPEFO(strict_on_policy=False).token_weights(None, None, mctx)
    assert (weights[0] == 1).all()  # row 0 (A > 0) is clipped everywhere: weight 1
    assert (weights[1, :2] != 1).all()  # A < 0 is not clipped by a ratio above 1


def fake_fit(ppo_epochs=1, minibatch_size=None):
    module = SimpleNamespace(hparams={"ppo_epochs": ppo_epochs, "minibatch_size": minibatch_size})
    return SimpleNamespace(datamodule=SimpleNamespace(prompts_per_step=16, group_size=8)), module


def test_strict_on_policy_refuses_several_updates_per_rollout():
    OPEFO().on_fit_start(*fake_fit())
    OPEFO().on_fit_start(*fake_fit(minibatch_size=128))
    for kwargs in ({"ppo_epochs": 2}, {"minibatch_size": 64}):
        with pytest.raises(ValueError, match="one optimizer step per rollout"):
            OPEFO().on_fit_start(*fake_fit(**kwargs))
        OPEFO(strict_on_policy=False).on_fit_start(*fake_fit(**kwargs))


@pytest.mark.parametrize("kwargs, match", [({"flow": "x"}, "flow"), ({"coefficient": "x"}, "coefficient"),
                                           ({"static_lambda": 1.0}, "static_lambda"), ({"sides": "x"}, "sides")])
def test_invalid_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OPEFO(**kwargs)


def test_opefo_in_a_fit_balances_every_step(tiny_model_dir, memory_logger):
    batch = frozen_rollout(tiny_model_dir)
    fit = trainer(3, callbacks=[OPEFO()], logger=memory_logger)
    fit.fit(RLVRModule(model=tiny_model_dir, learning_rate=1e-2), fixed(batch))
    h = memory_logger.history
    for s in range(3):
        assert abs(h["opefo/net_flow_weighted"][s]) < 1e-6 * max(h["opefo/flow_up"][s], 1e-3)
        assert -1 < h["opefo/lambda"][s] < 1


@pytest.mark.parametrize("micro_batch_size", [None, 3], ids=["whole", "micro_batches"])
def test_with_an_engine_correction_the_applied_updates_net_flow_is_zero(micro_batch_size, monkeypatch, memory_logger):
    """At a policy lag of 1 each token's loss also carries its importance weight ``min(π_old/π_engine, C)`` (C = 1.02: some are capped): OPEFO
    balances the flow of the update as applied. Measured on the gradient of the loss the trainer backpropagates:
    a token whose log-prob gets gradient ``G`` moves the entropy by ``G (S(a) − S̄)`` to first order (E3), and these
    sum to zero over each step's tokens."""
    from test_module import reverse_data

    from lightning_rlvr.callbacks import SupervisedWarmStart
    from lightning_rlvr.rollout import HFEngine

    torch.manual_seed(0)
    module = RLVRModule(model="builtin:tiny", learning_rate=1e-2, engine_is_cap=1.02, micro_batch_size=micro_batch_size)
    forwards = []
    scored = module.token_stats

    def keep_the_training_forward(model, batch, *args, **kwargs):
        stats = scored(model, batch, *args, **kwargs)
        if stats.logprobs.requires_grad:
            stats.logprobs.retain_grad()
            forwards.append((module.policy_version, stats, batch.response_mask))
        return stats

    monkeypatch.setattr(module, "token_stats", keep_the_training_forward)
    data = reverse_data(engine=HFEngine(weights="copy"), max_policy_lag=1)
    trainer(4, callbacks=[SupervisedWarmStart(steps=100), OPEFO(strict_on_policy=False)],
            logger=memory_logger).fit(module, data)
    assert max(memory_logger.history["policy/tis_clipfrac"][s] for s in range(1, 4)) > 0  # the correction acted
    balanced = 0
    for version in range(1, 4):  # the lagged steps
        net = magnitude = 0.0
        for _, stats, mask in (f for f in forwards if f[0] == version):
            logprobs = stats.logprobs.detach()
            score = logprobs.exp() * (logprobs + stats.entropy.detach())  # S(a) = π_a (log π_a + H)
            flow = stats.logprobs.grad * (score - stats.sbar) * mask
            net, magnitude = net + flow.sum().item(), magnitude + flow.abs().sum().item()
        assert abs(net) <= 1e-4 * magnitude, (version, net, magnitude)
        balanced += magnitude > 0  # a step whose groups all scored alike has no gradient
    assert balanced >= 2
