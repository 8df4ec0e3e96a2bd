"""Switch an intervention on only in a training stage and/or a step window.

:class:`ActivationGate` is what the stage-aware shapings use for their ``active_in`` / ``active_steps``
arguments; :class:`StageGated` wraps *any* intervention with the same gate
(``StageGated(ClipCov(...), active_in="plateau")``). The stage is read from the trainer's one
:class:`~lightning_rlvr.callbacks.StageDetector` through its public ``stage`` only.

Semantics:

- ``active_steps=(start, stop)``: active for rollout steps ``start ≤ step < stop`` (0-based: the first
  rollout step is 0). The authors' position window ``200 < global_steps < 300`` of verl (whose first
  step is 1) is ``(200, 299)``.
- ``active_fraction=(a, b)``: the same window as fractions of the run, ``round(a·N) ≤ step < round(b·N)`` with
  ``N`` the fit's planned rollout steps (:meth:`~lightning_rlvr.RLVRModule.planned_rollout_steps`, resolved at
  ``setup``). The authors' window sits at 1/3–1/2 of their 600-step runs, where their plateau begins; carried to a
  run of another length as absolute steps, it lands elsewhere (4–7 % of a 4,500-step run: the rising stage).
  ``active_steps`` and ``active_fraction`` exclude each other.
- ``active_in="rising" | "plateau"``: active while the detector reports that stage; the detector updates
  after each step's optimizer steps, so step ``k`` uses the stage decided after step ``k − 1``.
- Both given: active when both hold. The decision is taken once per step and cached, so every hook of
  one step sees the same answer even if the detector switches during that step.
- An inactive gated intervention is frozen: none of its hooks run (an adaptive coefficient does not move).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from typing_extensions import override

from lightning_rlvr.callbacks.base import Intervention, MicroBatchContext, StepContext
from lightning_rlvr.callbacks.stage_detector import StageDetector

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import Tensor

    from lightning_rlvr.data.batch import RolloutBatch

__all__ = ["ActivationGate", "StageGated"]

ActiveIn = Literal["always", "rising", "plateau"]


class ActivationGate:
    """When an intervention is on: a training stage and/or a window of rollout steps.

    Args:
        owner: name used in error messages.
        active_in: ``"always"``, ``"rising"`` or ``"plateau"`` (the last two need a ``StageDetector``).
        active_steps: ``(start, stop)``, active for ``start ≤ step < stop``; ``None`` = every step.
        active_fraction: ``(a, b)`` with ``0 ≤ a < b ≤ 1``, the window as fractions of the run's rollout steps.
    """

    def __init__(self, owner: str, active_in: ActiveIn = "always", active_steps: tuple[int, int] | None = None,
                 active_fraction: tuple[float, float] | None = None) -> None:
        if active_in not in ("always", "rising", "plateau"):
            raise ValueError(f"{owner}: active_in must be 'always', 'rising' or 'plateau', got {active_in!r}")
        if active_steps is not None:
            active_steps = tuple(int(s) for s in active_steps)
            if len(active_steps) != 2 or not 0 <= active_steps[0] < active_steps[1]:
                raise ValueError(f"{owner}: active_steps must be (start, stop) with 0 <= start < stop, "
                                 f"got {active_steps}")
        if active_fraction is not None:
            if active_steps is not None:
                raise ValueError(f"{owner}: give active_steps or active_fraction, not both (got {active_steps} and "
                                 f"{tuple(active_fraction)}; pass active_fraction=None for absolute steps)")
            active_fraction = tuple(float(f) for f in active_fraction)
            if len(active_fraction) != 2 or not 0 <= active_fraction[0] < active_fraction[1] <= 1:
                raise ValueError(f"{owner}: active_fraction must be (a, b) with 0 <= a < b <= 1, got {active_fraction}")
        self.owner, self.active_in, self.active_steps = owner, active_in, active_steps
        self.active_fraction = active_fraction
        self._cached: tuple[int, bool] | None = None
        #: ``active_fraction`` resolved to rollout steps at :meth:`resolve`.
        self.resolved_steps: tuple[int, int] | None = active_steps

    def describe(self) -> dict[str, Any]:
        out = {"active_in": self.active_in, "active_steps": self.active_steps}
        if self.active_fraction is not None:  # only then, so the checkpoint keys of step windows are unchanged
            out["active_fraction"] = self.active_fraction
        return out

    def resolve(self, trainer: pl.Trainer) -> None:
        """Check the stage detector is there and turn ``active_fraction`` into rollout steps (call at ``setup``)."""
        self.detector(trainer)
        if self.active_fraction is not None:
            total = trainer.lightning_module.planned_rollout_steps()
            start, stop = (round(f * total) for f in self.active_fraction)
            self.resolved_steps = (start, max(stop, start + 1))

    def detector(self, trainer: pl.Trainer) -> StageDetector | None:
        """The trainer's stage detector (required when ``active_in`` names a stage)."""
        if self.active_in == "always":
            return None
        detectors = [cb for cb in trainer.callbacks if isinstance(cb, StageDetector)]
        if len(detectors) != 1:
            raise RuntimeError(
                f"{self.owner}: active_in={self.active_in!r} needs exactly one StageDetector in the trainer's "
                f"callbacks, found {len(detectors)}"
            )
        return detectors[0]

    def active(self, trainer: pl.Trainer, step: int) -> bool:
        """Whether the intervention is on at rollout ``step`` (decided once per step)."""
        if self._cached is not None and self._cached[0] == step:
            return self._cached[1]
        on = True
        if self.active_fraction is not None and self.resolved_steps is None:
            raise RuntimeError(f"{self.owner}: active_fraction was not resolved to steps (call resolve at setup)")
        if self.resolved_steps is not None:
            on = self.resolved_steps[0] <= step < self.resolved_steps[1]
        detector = self.detector(trainer)
        if detector is not None:
            on = on and detector.stage == self.active_in
        self._cached = (step, on)
        return on

    def active_logged(self, trainer: pl.Trainer, ctx: StepContext, metric: str) -> bool:
        """:meth:`active` for ``ctx.step``, also logged as ``metric`` (0/1)."""
        on = self.active(trainer, ctx.step)
        ctx.log(metric, float(on))
        return on


class StageGated(Intervention):
    """Run the wrapped intervention only in a stage and/or step window (see the module docstring).

    Forwards the five intervention hooks, ``needs``, the checkpointed state and ``setup`` / ``on_fit_start``
    (the only Lightning hooks the shipped interventions use); the wrapped callback's metrics keep their
    names, and ``<its prefix>/active`` (0/1) is logged every step.

    Args:
        intervention: the intervention to gate.
        active_in: ``"always"``, ``"rising"`` or ``"plateau"``.
        active_steps: ``(start, stop)`` rollout-step window or ``None``.
        active_fraction: ``(a, b)`` window as fractions of the run's rollout steps, or ``None``.

    Example::

        >>> from lightning_rlvr.callbacks import ClipCov, StageGated
        >>> StageGated(ClipCov(), active_in="plateau").needs == ClipCov().needs
        True
    """

    def __init__(self, intervention: Intervention, active_in: ActiveIn = "plateau",
                 active_steps: tuple[int, int] | None = None, active_fraction: tuple[float, float] | None = None) -> None:
        if not isinstance(intervention, Intervention):
            raise TypeError(f"StageGated: expected an Intervention, got {type(intervention).__name__}")
        self.inner = intervention
        self.gate = ActivationGate(f"StageGated({type(intervention).__name__})", active_in, active_steps,
                                   active_fraction)
        self.needs = intervention.needs
        self.metric_prefix = intervention.metric_prefix or type(intervention).__name__.lower()

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(inner=self.inner.state_key, **self.gate.describe())

    def _on(self, trainer: pl.Trainer, step: int) -> bool:
        return self.gate.active(trainer, step)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.gate.resolve(trainer)  # fail before training when the detector is missing
        self.inner.setup(trainer, pl_module, stage)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.inner.on_fit_start(trainer, pl_module)

    @override
    def on_rollout(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: RolloutBatch) -> RolloutBatch | None:
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        return self.inner.on_rollout(trainer, pl_module, batch) if self._on(trainer, step) else None

    @override
    def shape_advantages(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> Tensor | None:
        on = self.gate.active_logged(trainer, ctx, self.log_name("active"))
        return self.inner.shape_advantages(trainer, pl_module, ctx) if on else None

    @override
    def token_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: MicroBatchContext) -> Tensor | None:
        return self.inner.token_weights(trainer, pl_module, ctx) if self._on(trainer, ctx.step.step) else None

    @override
    def extra_loss(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: MicroBatchContext) -> Tensor | None:
        return self.inner.extra_loss(trainer, pl_module, ctx) if self._on(trainer, ctx.step.step) else None

    @override
    def on_update_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> None:
        if self._on(trainer, ctx.step):
            self.inner.on_update_end(trainer, pl_module, ctx)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
