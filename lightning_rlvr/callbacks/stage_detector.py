"""StageDetector: is training in the *rising* or the *plateau* stage (arXiv 2508.02260)? [derived]

Deng et al. split RLVR training by its entropy dynamics into a rising stage (entropy falls fast,
accuracy rises fast) and a plateau stage; the released code has no detector (a fixed step window turns
its position method on). This callback decides online, from the per-step token-mean entropy of the
rollout and (by default) the mean verifier score, with
:class:`~lightning_rlvr.algorithms.stage_detection.OnlineStageDetector`: a least-squares two-segment fit
of the whole entropy history, a flatness rule, a confirmation window and an absorbing plateau — see that
module for every choice and why.

Why reward too (default ``reward_flatness=0.5``): on the embedded task from a weak start, entropy falls
0.98 → 0.70 in ~300 steps, pauses for ~400 steps while accuracy *keeps rising*, then falls to ~0.13.
Entropy alone calls the pause a plateau; the paper's plateau is also slow performance gains, so the
detector additionally asks the score's slope after the break to be at most half its slope before —
*with confidence* (default ``reward_confidence=2``: the slope before minus two standard errors is
positive, the slope after plus two standard errors is at most half of it). Without the margin the noisy
per-step score (sd ≈ 0.02–0.04 at 128 samples) passed the test ~60 steps into that pause (seed 1 of
``benchmarks/stage_aware.py``: a false transition at step 335, entropy 0.78); with it the same curve's
transition is found at 1748, where its entropy bends (0.23), and seeds 0 and 2 are unchanged within 30
steps. ``reward_flatness=None`` decides from entropy alone.

Other callbacks read :attr:`stage` / :attr:`plateau` (the stage of the *next* step: it is updated in
``on_update_end``) — gate them with ``active_in="plateau"``
(:class:`~lightning_rlvr.callbacks.stage_gate.ActivationGate`, :class:`~lightning_rlvr.callbacks.StageGated`).

Metrics: ``stage/plateau`` (0/1), ``stage/transition_step`` (the break step, ``nan`` before), and the
current fit's ``stage/fit_break``, ``stage/slope_before``, ``stage/slope_after``. The whole history is
checkpointed, so a resumed run decides exactly as an uninterrupted one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from typing_extensions import override

from lightning_rlvr.algorithms.stage_detection import OnlineStageDetector
from lightning_rlvr.callbacks.base import Intervention, StepContext, masked_mean

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["StageDetector"]

Stage = Literal["rising", "plateau"]


class StageDetector(Intervention):
    """Online rising/plateau stage of training from the entropy (and score) curve.

    Args:
        min_segment: fewest steps in each stage of the two-segment fit; no decision before ``2·min_segment``.
        flatness: κ: the plateau when the fitted slope after the break is ``≥ κ ×`` the slope before.
        min_drop: the rising stage must lower entropy by at least this fraction of its starting level.
        patience: consecutive steps the fit must say "plateau" before the stage switches (no flip-flop).
        reward_flatness: the mean score's slope after the break must be ``≤ reward_flatness ×`` its slope
            before (and that one positive); ``None`` = entropy only.
        reward_confidence: z, the standard errors of the two score slopes that the reward test must clear
            (``b - z·se_b > 0``, ``a + z·se_a ≤ reward_flatness · b``); 0 compares point estimates.

    Example::

        >>> from lightning_rlvr.callbacks import StageDetector
        >>> StageDetector().stage
        'rising'
    """

    metric_prefix = "stage"

    def __init__(self, min_segment: int = 50, flatness: float = 0.25, min_drop: float = 0.2, patience: int = 20,
                 reward_flatness: float | None = 0.5, reward_confidence: float = 2.0) -> None:
        try:
            self.detector = OnlineStageDetector(min_segment, flatness, min_drop, patience, reward_flatness,
                                                reward_confidence)
        except ValueError as err:
            raise ValueError(f"StageDetector: {err}") from None

    @property
    @override
    def state_key(self) -> str:
        d = self.detector
        # reward_confidence joined the arguments later: at its default the key stays the one older
        # checkpoints were saved under.
        extra = {} if d.reward_confidence == 2.0 else {"reward_confidence": d.reward_confidence}
        return self._state_key(min_segment=d.min_segment, flatness=d.flatness, min_drop=d.min_drop,
                               patience=d.patience, reward_flatness=d.reward_flatness, **extra)

    @property
    def plateau(self) -> bool:
        """Whether the plateau stage has been detected (absorbing)."""
        return self.detector.plateau

    @property
    def stage(self) -> Stage:
        return "plateau" if self.plateau else "rising"

    @property
    def transition_step(self) -> int | None:
        """Rollout step where the plateau began (the fit's break), ``None`` while rising."""
        return self.detector.transition

    @property
    def confirmed_step(self) -> int | None:
        """Rollout step at which the plateau was confirmed (``transition_step`` + detection delay)."""
        return self.detector.confirmed_at

    @override
    def on_update_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> None:
        entropy = masked_mean(ctx.old_entropy, ctx.mask)
        rows = ctx.mask.new_ones(len(ctx.batch), 1)
        score = masked_mean(ctx.batch.scores.unsqueeze(-1), rows)
        self.detector.update(entropy, score, ctx.step)
        ctx.log(self.log_name("plateau"), float(self.plateau))
        transition = self.transition_step
        ctx.log(self.log_name("transition_step"), math.nan if transition is None else float(transition))
        fit = self.detector.last_fit
        if fit is not None and not self.plateau:
            ctx.log(self.log_name("fit_break"), float(self.detector.steps[fit.tau]))
            ctx.log(self.log_name("slope_before"), fit.slope_before)
            ctx.log(self.log_name("slope_after"), fit.slope_after)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.detector.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.detector.load_state_dict(state_dict)
