"""``micro_batch_size`` changes memory only: every shipped intervention gives the same update with the minibatch
split into micro-batches as without, including those whose statistics are defined over "the batch" (Clip-Cov,
KL-Cov, the top-entropy mask, STEER's normaliser, OPEFO's flows, PAEC's masked mean)."""

from __future__ import annotations

import inspect

import pytest
import torch

import lightning_rlvr.callbacks as callbacks
from lightning_rlvr.callbacks import (
    EPGRPO,
    OPEFO,
    PAEC,
    STEER,
    AdaptiveEntropy,
    ClipCov,
    EntropyBonus,
    Intervention,
    KLCov,
    PerplexityShaping,
    PositionShaping,
    RCEADiagnostics,
    StageDetector,
    StageGated,
    TopEntropyTokens,
)
import lightning.pytorch as pl

from tests.test_objective import fit


class SGDLikeAdam(pl.Callback):
    """AdamW with ``eps = 1`` moves each parameter by about ``lr · g``: a continuous function of the gradient, so the
    float rounding that micro-batching changes (~1e-7) stays that small in the next update's parameters (AdamW's
    ``lr · g / |g|`` would turn it into a whole ``lr`` on any near-zero gradient component)."""

    def on_train_start(self, trainer, pl_module) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["eps"] = 1.0


def active_paec() -> PAEC:
    paec = PAEC(anchor_steps=1, coefficient=0.5)
    paec.load_state_dict({"anchor_sum": 5.0, "anchor_count": 1})  # floor 4.5 nats: far above H̄, the hinge bites
    return paec


# Arguments that make each intervention act on this small batch (defaults sized for real runs would select nothing
# or wait for a later stage); classes not listed run with their defaults.
ACTIVE = {
    ClipCov: lambda: [ClipCov(ratio=0.2, lower=-10.0, upper=10.0)],
    KLCov: lambda: [KLCov(ratio=0.2)],
    TopEntropyTokens: lambda: [TopEntropyTokens(ratio=0.3)],
    STEER: lambda: [STEER(w_min=0.3)],
    OPEFO: lambda: [OPEFO(strict_on_policy=False)],
    PAEC: lambda: [active_paec()],
    EntropyBonus: lambda: [EntropyBonus(coef=0.05)],
    AdaptiveEntropy: lambda: [AdaptiveEntropy(init_coef=0.05, max_coef=0.1, gate=False)],
    PerplexityShaping: lambda: [PerplexityShaping(alpha=0.5)],
    PositionShaping: lambda: [PositionShaping(alpha=0.5, active_steps=None, active_fraction=None)],
    RCEADiagnostics: lambda: [RCEADiagnostics(every_n_steps=1, num_resamples=20, plots=False)],
    StageGated: lambda: [StageDetector(), StageGated(ClipCov(ratio=0.2, lower=-10.0, upper=10.0), active_in="always")],
}
# They observe and log; they leave the update as it is.
OBSERVERS = {"EntropyChangeProbe", "EntropyPerformanceAnalysis", "RCEADiagnostics", "StageDetector"}
SHIPPED = sorted((obj for name in callbacks.__all__ if inspect.isclass(obj := getattr(callbacks, name))
                  and issubclass(obj, Intervention) and obj is not Intervention), key=lambda c: c.__name__)


def updates(model_dir, monkeypatch, interventions, micro_batch_size):
    """The two updates of one rollout (two minibatches of 8 rows): their gradients, flattened."""
    _, capture, _ = fit(model_dir, monkeypatch, [SGDLikeAdam(), *interventions], minibatch_size=8,
                        micro_batch_size=micro_batch_size, kl_coef=0.05)
    return [torch.cat([g.flatten() for g in grads]) for _, grads in capture.steps]


def test_every_shipped_intervention_is_covered():
    assert len(SHIPPED) >= 17 and {c.__name__ for c in SHIPPED} >= {"ClipCov", "PAEC", "STEER", "OPEFO"}


@pytest.mark.parametrize("intervention", SHIPPED, ids=lambda c: c.__name__)
def test_micro_batching_leaves_the_update_unchanged(tiny_model_dir, monkeypatch, intervention):
    make = ACTIVE.get(intervention, lambda: [intervention()])
    whole = updates(tiny_model_dir, monkeypatch, make(), None)
    for micro in (3, 5):
        split = updates(tiny_model_dir, monkeypatch, make(), micro)
        for k, (a, b) in enumerate(zip(whole, split)):
            error = ((a - b).norm() / a.norm()).item()
            assert error <= 1e-5, f"micro_batch_size={micro}, update {k}: relative difference {error:.2e}"
    if intervention.__name__ not in OBSERVERS:  # it acted: otherwise the comparison above would prove nothing
        plain = updates(tiny_model_dir, monkeypatch, [], None)
        assert max(((a - b).norm() / a.norm()).item() for a, b in zip(whole, plain)) > 1e-4


def test_the_reference_codes_per_micro_batch_statistics_are_an_explicit_option(tiny_model_dir, monkeypatch):
    """scope="micro_batch": Clip-Cov's selection per micro-batch (verl's per-device semantics), not per minibatch."""
    def clip_cov(scope):
        return [ClipCov(ratio=0.2, lower=-10.0, upper=10.0, scope=scope)]

    minibatch = updates(tiny_model_dir, monkeypatch, clip_cov("minibatch"), 3)
    per_micro = updates(tiny_model_dir, monkeypatch, clip_cov("micro_batch"), 3)
    assert ((minibatch[0] - per_micro[0]).norm() / minibatch[0].norm()).item() > 1e-3
    # Unsplit, a micro-batch is the minibatch: the two scopes agree.
    unsplit = [updates(tiny_model_dir, monkeypatch, clip_cov(scope), None) for scope in ("minibatch", "micro_batch")]
    torch.testing.assert_close(unsplit[0][0], unsplit[1][0])
    with pytest.raises(ValueError, match="scope"):
        ClipCov(scope="device")
