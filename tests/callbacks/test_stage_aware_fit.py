"""The stage-aware callbacks inside a real fit: gating by step window, the analysis metrics, checkpointed state."""

from __future__ import annotations

import torch

from lightning_rlvr import RLVRModule
from lightning_rlvr.callbacks import (
    EntropyPerformanceAnalysis,
    Intervention,
    PerplexityShaping,
    PositionShaping,
    StageDetector,
)
from lightning_rlvr.callbacks.base import masked_mean
from test_module import trainer

from .test_protocol import fixed, frozen_rollout


class ObservedChange(Intervention):
    """Recomputes the entropy change of the update independently of the analysis callback."""

    def __init__(self) -> None:
        self.changes: dict[int, float] = {}

    def on_update_end(self, trainer, pl_module, ctx):
        with torch.no_grad():
            out = pl_module.policy(input_ids=ctx.batch.input_ids, attention_mask=ctx.batch.attention_mask,
                                   position_ids=ctx.batch.position_ids)
        width = ctx.mask.shape[1]
        logits = out.logits[:, -(width + 1) : -1].float() / ctx.batch.temperature
        entropy = torch.distributions.Categorical(logits=logits).entropy()
        self.changes[ctx.step] = masked_mean(entropy - ctx.old_entropy, ctx.mask)


def test_stage_aware_callbacks_in_a_fit(tiny_model_dir, memory_logger, tmp_path):
    batch = frozen_rollout(tiny_model_dir)
    batch.correct = batch.rewards > 0.5
    detector, observed = StageDetector(), ObservedChange()
    callbacks = [detector, PerplexityShaping(active_fraction=(0.5, 1.0)), PositionShaping(active_steps=(1, 3), active_fraction=None),
                 EntropyPerformanceAnalysis(position_buckets=4, perplexity_buckets=2), observed]
    module = RLVRModule(model=tiny_model_dir, learning_rate=1e-2)
    fit = trainer(4, callbacks=callbacks, logger=memory_logger)
    fit.fit(module, fixed(batch))
    h = memory_logger.history
    assert [h["position_shaping/active"][s] for s in range(4)] == [0.0, 1.0, 1.0, 0.0]
    assert [h["ppl_shaping/active"][s] for s in range(4)] == [0.0, 0.0, 1.0, 1.0]  # the second half of 4 steps
    assert h["stage/plateau"][3] == 0.0  # four steps are far too few for a decision
    for s in range(4):
        total = h["analysis/delta_entropy/positive_contribution"][s] + h["analysis/delta_entropy/negative_contribution"][s]
        assert abs(total - observed.changes[s]) < 1e-5
        assert observed.changes[s] != 0
    for key in ("analysis/entropy_by_position/3", "analysis/entropy_by_ppl/1", "analysis/delta_entropy_by_position/0",
                "analysis/entropy_slope", "analysis/accuracy_slope"):
        assert key in h, key
    fit.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert checkpoint["callbacks"][detector.state_key]["values"] == detector.detector.values
    assert len(detector.detector.values) == 4
