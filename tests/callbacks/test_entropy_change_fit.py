"""STEER and the EntropyChangeProbe inside a real fit, checked against an independent Categorical recompute."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlvr import RLVRModule
from lightning_rlvr.callbacks import STEER, EntropyChangeProbe, Intervention
from test_module import trainer

from .helpers import step_context
from .test_protocol import fixed, frozen_rollout
from .test_stage_aware_fit import ObservedChange


def completion_distribution(pl_module, batch) -> torch.distributions.Categorical:
    with torch.no_grad():
        out = pl_module.policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               position_ids=batch.position_ids)
    width = batch.response_mask.shape[1]
    return torch.distributions.Categorical(logits=out.logits[:, -(width + 1) : -1].double() / batch.temperature)


class PredictionBeforeUpdate(Intervention):
    """The flow and covariance predictions from the behaviour policy, before the update, with Categorical."""

    def __init__(self) -> None:
        self.flow: dict[int, float] = {}
        self.cov: dict[int, float] = {}

    def shape_advantages(self, trainer, pl_module, ctx):
        dist = completion_distribution(pl_module, ctx.batch)
        probs, entropy = dist.probs, dist.entropy()
        logp = dist.log_prob(ctx.batch.completion_ids)
        score = logp.exp() * (logp + entropy)
        sbar = (probs * probs * (probs.log() + entropy.unsqueeze(-1))).sum(-1)
        valid = ctx.mask > 0
        a = ctx.advantages.double()
        self.flow[ctx.step] = (-a * (score - sbar))[valid].mean().item()
        lv, av = logp[valid], a[valid]
        self.cov[ctx.step] = ((lv - lv.mean()) * (av - av.mean())).mean().item()


@pytest.mark.parametrize("minibatch_size", [None, 4])  # one on-policy update / two updates after an old pass
def test_probe_predictions_and_observed_change_match_an_independent_recompute(
        tiny_model_dir, memory_logger, tmp_path, minibatch_size):
    batch = frozen_rollout(tiny_model_dir)
    batch.correct = batch.rewards > 0.5
    before, probe, observed = PredictionBeforeUpdate(), EntropyChangeProbe(sample_rows=None, window=3), ObservedChange()
    module = RLVRModule(model=tiny_model_dir, learning_rate=1e-2, minibatch_size=minibatch_size)
    updates = 1 if minibatch_size is None else -(-len(batch) // minibatch_size)
    fit = trainer(4 * updates, callbacks=[before, STEER(omega="exact"), probe, observed], logger=memory_logger)
    fit.fit(module, fixed(batch))
    h = memory_logger.history
    steps = sorted(h["probe/flow_pred"])  # max_steps counts optimizer steps
    assert steps == list(range(4))
    for s in steps:
        assert h["probe/flow_pred"][s] == pytest.approx(before.flow[s], rel=1e-4, abs=1e-7)
        assert h["probe/cov_pred"][s] == pytest.approx(before.cov[s], rel=1e-4, abs=1e-7)
        assert h["probe/observed"][s] == pytest.approx(observed.changes[s], rel=1e-4, abs=1e-6)
        assert observed.changes[s] != 0 and h["probe/seconds"][s] > 0
        assert 0.8 - 1e-6 <= h["steer/weight_min"][s] <= h["steer/weight_mean"][s] <= h["steer/weight_max"][s] <= 1
    for key in ("probe/window/sign_agreement_flow", "probe/window/spearman_cov", "probe/window/eta_eff",
                "probe/successful/observed", "probe/window/failed/pearson", "probe/token_sign_agreement"):
        assert key in h, key
    last_window = steps[-3:]
    negative = sum(h["probe/observed"][s] < 0 for s in last_window) / len(last_window)
    assert h["probe/window/observed_negative_share"][steps[-1]] == pytest.approx(negative)
    agree = sum((h["probe/flow_pred"][s] > 0) == (h["probe/observed"][s] > 0) for s in steps) / len(steps)
    assert h["probe/run/sign_agreement_flow"][steps[-1]] == pytest.approx(agree)
    fit.save_checkpoint(tmp_path / "last.ckpt")
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"][probe.state_key]
    assert state["run_steps"] == len(steps) and len(state["history"]["flow"]) == min(3, len(steps))
    resumed = EntropyChangeProbe(sample_rows=None, window=3)
    resumed.load_state_dict(state)
    assert resumed.history == probe.history and resumed.run_flow_agree == probe.run_flow_agree


class SteerReferenceCheck(Intervention):
    """After STEER in the list: its weights against the reference rule from an independent old-policy entropy."""

    def __init__(self) -> None:
        self.checked = 0

    def shape_advantages(self, trainer, pl_module, ctx):
        self.old_entropy = completion_distribution(pl_module, ctx.batch).entropy().float()

    def token_weights(self, trainer, pl_module, mctx):
        x = mctx.logprobs.detach().exp().clamp(1e-8, 1 - 1e-8)
        old_p = mctx.old_logprobs.exp().clamp(1e-8, 1.0)
        omega = (mctx.advantages / old_p * x * (1 - x) * (x.log() + self.old_entropy[mctx.index])).abs()
        valid = mctx.mask > 0
        k = -math.log(0.8) / max(omega[valid].max().item(), 0.02)
        expected = torch.where(valid, torch.exp(-k * omega).clamp(0.8, 1.0), torch.zeros_like(omega))
        torch.testing.assert_close(mctx.weights, expected, rtol=1e-4, atol=1e-5)
        self.checked += 1


@pytest.mark.parametrize("minibatch_size", [None, 4])
def test_steer_reference_omega_uses_the_behaviour_entropy_in_a_fit(tiny_model_dir, minibatch_size):
    batch = frozen_rollout(tiny_model_dir)
    check = SteerReferenceCheck()
    module = RLVRModule(model=tiny_model_dir, learning_rate=1e-2, minibatch_size=minibatch_size)
    trainer(3, callbacks=[STEER(), check]).fit(module, fixed(batch))
    assert check.checked >= 3


def test_probe_on_a_row_subsample_and_every_n_steps(tiny_model_dir, memory_logger):
    batch = frozen_rollout(tiny_model_dir)
    batch.correct = batch.rewards > 0.5
    probe = EntropyChangeProbe(sample_rows=3, every_n_steps=2)
    rows = probe._rows(len(batch), torch.device("cpu")).tolist()
    assert len(rows) == 3 and rows[0] == 0 and rows[-1] == len(batch) - 1 and abs(rows[1] - (len(batch) - 1) / 2) <= 0.5
    assert probe._rows(5, torch.device("cpu")).tolist() == [0, 2, 4]
    fit = trainer(4, callbacks=[probe], logger=memory_logger)
    fit.fit(RLVRModule(model=tiny_model_dir, learning_rate=1e-2), fixed(batch))
    assert sorted(memory_logger.history["probe/observed"]) == [0, 2]


def test_invalid_probe_arguments_are_rejected():
    for kwargs in ({"every_n_steps": 0}, {"sample_rows": 0}, {"window": 1}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            EntropyChangeProbe(**kwargs)


def test_probe_skips_a_step_whose_updates_were_all_skipped():
    step = step_context([1.0, 0.0], [[1, 1], [1, 0]], advantages=[1.0, -1.0], old_logprobs=torch.zeros(2, 2),
                        old_entropy=torch.zeros(2, 2))
    step.old_sbar, step.updates_applied = torch.zeros(2, 2), 0
    EntropyChangeProbe().on_update_end(None, None, step)  # would need pl_module to recompute: it must not
    assert step.metrics.means() == {}


def test_observed_change_is_exactly_zero_when_an_update_changes_nothing_with_engine_behaviour_stats(
        tiny_model_dir, memory_logger):
    """Two minibatches: the behaviour entropy comes from HFEngine's decoding loop, which differs from the trainer's
    full forward by rounding. An untrained policy scores 0 on every completion (all advantages 0, a zero update),
    so H_before and H_after must come from the same forward: the observed change is exactly 0, not rounding."""
    from test_module import reverse_data

    seen = []

    class Spy(Intervention):
        def on_rollout(self, trainer, pl_module, batch):
            seen.append((batch.behaviour_entropy is not None, batch.rewards.abs().sum().item()))

    module = RLVRModule(model=tiny_model_dir, minibatch_size=16)
    from lightning_rlvr.callbacks import EntropyPerformanceAnalysis

    fit = trainer(6, callbacks=[Spy(), EntropyChangeProbe(sample_rows=None), EntropyPerformanceAnalysis()],
                  logger=memory_logger)
    fit.fit(module, reverse_data())
    assert seen == [(True, 0.0)] * 3
    h = memory_logger.history
    assert sorted(h["probe/observed"]) == [0, 1, 2]
    assert all(h["probe/observed"][s] == 0.0 and h["probe/flow_pred"][s] == 0.0 for s in range(3))
    changes = [v for key, series in h.items() if key.startswith("analysis/delta_entropy_by_position/")
               for v in series.values() if not math.isnan(v)]
    assert changes and all(v == 0.0 for v in changes)
