"""What batch-level interventions see of the engine importance weights (async-review.md, F2 and F3): the view's
surrogate is the PPO loss before them, the same whether the minibatch is one micro-batch or several; the weights
themselves come alongside, and tokens a mask mode dropped are not valid (so no selection spends its budget there)."""

from __future__ import annotations

import pytest
import torch
from test_module import reverse_data, trainer

from lightning_rlvr import RLVRModule
from lightning_rlvr.callbacks import ClipCov, Intervention, SupervisedWarmStart
from lightning_rlvr.callbacks.base import Needs
from lightning_rlvr.rollout import HFEngine

CAP = 1.02  # small, so that the engine correction acts on a one-step-old rollout


class ViewSpy(Intervention):
    """Records each step's rollout and the minibatch view its micro-batches share."""

    def __init__(self) -> None:
        self.needs = Needs(minibatch_stats=True)
        self.rollouts: dict[int, object] = {}
        self.views: dict[int, object] = {}

    def on_rollout(self, trainer, pl_module, batch):
        self.rollouts[pl_module.policy_version] = batch

    def token_weights(self, trainer, pl_module, ctx):
        view, _ = ctx.statistics_view()
        self.views[pl_module.policy_version] = view


def lagged_views(micro_batch_size, mode="token_truncate", callbacks=()):
    torch.manual_seed(0)
    spy = ViewSpy()
    module = RLVRModule(model="builtin:tiny", learning_rate=1e-2, engine_is_cap=CAP, engine_is_mode=mode,
                        micro_batch_size=micro_batch_size)
    data = reverse_data(engine=HFEngine(weights="copy"), max_policy_lag=1)
    trainer(5, callbacks=[SupervisedWarmStart(steps=100), *callbacks, spy]).fit(module, data)
    return spy, module


@pytest.mark.parametrize("micro_batch_size", [None, 5], ids=["one_micro_batch", "micro_batches"])
def test_the_view_carries_the_surrogate_before_the_importance_weights_and_the_weights_beside_it(micro_batch_size):
    spy, module = lagged_views(micro_batch_size)
    clip_low, clip_high = module.hparams.clip_low, module.hparams.clip_high
    capped = 0
    for version in range(1, 5):  # rollouts of the previous step's policy
        view, rollout = spy.views[version], spy.rollouts[version]
        mask = view.mask > 0
        ratio = torch.exp(view.logprobs - view.old_logprobs)
        surrogate = torch.maximum(-view.advantages * ratio,
                                  -view.advantages * ratio.clamp(1 - clip_low, 1 + clip_high))
        torch.testing.assert_close(view.policy_loss.loss[mask], surrogate[mask], rtol=1e-5, atol=1e-6)
        by_hand = torch.clamp(torch.exp(view.old_logprobs - rollout.engine_logprobs), max=CAP) * mask
        torch.testing.assert_close(view.engine_weights, by_hand, rtol=1e-5, atol=1e-6)
        capped += int((view.engine_weights[mask] == CAP).sum())
    assert capped > 0  # the cap acted


def test_tokens_a_mask_mode_drops_are_not_valid_and_clip_cov_selects_none_of_them():
    spy, _ = lagged_views(None, mode="token_mask", callbacks=[ClipCov(ratio=0.5, lower=-1e9, upper=1e9)])
    n_dropped = 0
    for version in range(1, 5):
        view = spy.views[version]
        dropped = (view.mask > 0) & (view.engine_weights == 0)
        n_dropped += int(dropped.sum())  # ratios outside [1/C, C]
        assert not (view.valid & dropped).any() and (view.valid | dropped).eq(view.mask > 0).all()
        detached = view._results  # Clip-Cov's selection, cached on the view it shares with the spy
        selections = [v for v in detached.values() if torch.is_tensor(v) and v.shape == view.mask.shape]
        assert selections and all(not (s.bool() & dropped).any() for s in selections)
    assert n_dropped > 0
