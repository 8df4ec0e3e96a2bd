"""EntropyChangeProbe: does first-order theory predict the entropy change each update causes?

A diagnostic (it changes nothing in training). On every ``every_n_steps``-th rollout step it compares,
on the same tokens (the valid tokens of ``sample_rows`` rows), two predictions of the step's entropy change
with the change that happened:

- **covariance** (Cui et al., arXiv 2505.22617, Theorem 2): ``ΔH ∝ −Cov(log π_old, A)`` over those tokens
  (``probe/cov_pred`` is the covariance itself; its prediction is ``−cov_pred``);
- **flow** (ALGORITHMS.md §2.2, E3; arXiv 2510.10150 / 2602.03392): the token-mean of
  ``c_t = −A_t (S(a_t) − S̄_t)``, ``S(a) = π_a(log π_a + H)``, ``S̄ = Σ_j π_j S(j)``, at the behaviour policy
  where the step starts (``r = 1``, no clip active), in units of the step size;
- **observed**: ``H_after − H_before`` per token, ``H_after`` recomputed with the updated policy on the same tokens
  and ``H_before`` the behaviour entropy of the rollout from the same forward (recomputed on the sampled rows
  before the update when the behaviour stats came from the decoding loop).

Per step it logs ``probe/cov_pred``, ``probe/flow_pred``, ``probe/observed``, the same split by verified
outcome (``probe/successful/...``, ``probe/failed/...``), and the token-level agreement of ``c_t`` with the
per-token change (``probe/token_sign_agreement``, ``probe/token_pearson``; over tokens with a nonzero
prediction, i.e. outside zero-advantage groups). Over the last ``window``
measured steps: sign agreement, Pearson and Spearman correlation of each prediction with the observed
change (``probe/window/{sign_agreement,pearson,spearman}_{flow,cov}``), the fitted effective step size
``η_eff = argmin_η ‖obs − η·flow‖²`` (``probe/window/eta_eff``), and the flow's sign agreement / Pearson
within successful and within failed responses, and ``probe/window/observed_negative_share`` — the score of a
constant "entropy goes down" forecast, the bar a sign agreement has to clear (entropy mostly falls in RLVR).
``probe/run/sign_agreement_{flow,cov}`` count every
measured step of the run (checkpointed). A zero prediction or change matches only a zero.

Scope of the predictions: the update is the module's whole step (all minibatches and PPO epochs), with
Adam's preconditioning and shared parameters, while E3 assumes one plain gradient step on each
position's own logits; token weights of other interventions (e.g. STEER, Clip-Cov) are not included.
The probe measures how far that model carries.

Cost: one no-grad forward over ``sample_rows`` rows per measured step (two when the rollout engine supplied the
behaviour stats: the trainer then skipped its pass over the whole batch; rows evenly spaced over the batch,
so every prompt group is represented), plus ``S̄`` in the existing log-prob passes (two extra vocabulary
reductions; :class:`~lightning_rlvr.callbacks.base.Needs` ``flow_stats``). ``probe/seconds`` logs the
probe's own wall time per measured step. All statistics are over the valid tokens of every rank.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_rlvr.algorithms.entropy_change import predicted_entropy_flow
from lightning_rlvr.callbacks.base import Intervention, Needs, StepContext, entropy_before_update
from lightning_rlvr.distributed import gather_cat
from lightning_rlvr.metrics.entropy_change import fitted_step_size, pearson, sign_agreement, spearman

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["EntropyChangeProbe"]

_SERIES = ("cov", "flow", "observed", "successful_flow", "successful_observed", "failed_flow", "failed_observed")


def _sign(value: float) -> int:
    return (value > 0) - (value < 0)


def _mean(values: Tensor) -> float:
    return values.double().mean().item() if values.numel() else math.nan


class EntropyChangeProbe(Intervention):
    """Predicted (covariance, first-order flow) vs observed entropy change of every update.

    Args:
        every_n_steps: measure every this many rollout steps.
        sample_rows: rows of the batch (per rank) on which the change is recomputed after the update;
            ``None`` = all rows.
        window: measured steps over which correlations, sign agreement and ``η_eff`` are computed.

    Example::

        >>> from lightning_rlvr.callbacks import EntropyChangeProbe
        >>> EntropyChangeProbe(sample_rows=32).state_key
        "EntropyChangeProbe{'every_n_steps': 1, 'sample_rows': 32, 'window': 50}"
    """

    metric_prefix = "probe"
    needs = Needs(flow_stats=True)

    def __init__(self, every_n_steps: int = 1, sample_rows: int | None = 64, window: int = 50) -> None:
        if every_n_steps < 1:
            raise ValueError(f"EntropyChangeProbe: every_n_steps must be >= 1, got {every_n_steps}")
        if sample_rows is not None and sample_rows < 1:
            raise ValueError(f"EntropyChangeProbe: sample_rows must be >= 1 or None, got {sample_rows}")
        if window < 2:
            raise ValueError(f"EntropyChangeProbe: window must be >= 2, got {window}")
        self.every_n_steps, self.sample_rows, self.window = every_n_steps, sample_rows, window
        self.history: dict[str, list[float]] = {name: [] for name in _SERIES}
        self.run_steps = self.run_flow_agree = self.run_cov_agree = 0
        #: ``[step, cov, flow, observed]`` of every probed step of the run (for the predicted-vs-observed plot).
        self.trajectory: list[list[float]] = []
        self._before: Tensor | None = None  # H_before of the sampled rows, recomputed before this step's update
        self._before_seconds = 0.0

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(every_n_steps=self.every_n_steps, sample_rows=self.sample_rows, window=self.window)

    def _rows(self, n: int, device: torch.device) -> Tensor:
        k = min(self.sample_rows or n, n)
        return torch.linspace(0, n - 1, k, dtype=torch.float64, device=device).round().long().unique()

    @override
    def shape_advantages(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> Tensor | None:
        start = time.perf_counter()
        self._before = None if ctx.step % self.every_n_steps else entropy_before_update(
            pl_module, ctx, self._rows(len(ctx.batch), ctx.mask.device))
        self._before_seconds = time.perf_counter() - start
        return None

    @override
    def on_update_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> None:
        if ctx.step % self.every_n_steps or ctx.old_sbar is None or ctx.updates_applied == 0:
            return  # nothing changed (every update skipped as non-finite): nothing to compare
        start = time.perf_counter() - self._before_seconds
        rows = self._rows(len(ctx.batch), ctx.mask.device)
        batch = ctx.batch.select(rows)
        valid = ctx.mask[rows] > 0
        before = ctx.old_entropy[rows] if self._before is None else self._before
        self._before = None
        flow = predicted_entropy_flow(ctx.advantages[rows], ctx.old_logprobs[rows], before, ctx.old_sbar[rows])
        observed = pl_module.recompute_token_stats(batch).entropy - before
        success = batch.correct.unsqueeze(-1).expand_as(valid)
        # Every rank's valid tokens, in rank order: the statistics below are then those of the whole batch.
        flow, _ = gather_cat(flow[valid].float())
        observed, _ = gather_cat(observed[valid].float())
        logprobs, _ = gather_cat(ctx.old_logprobs[rows][valid].float())
        advantages, _ = gather_cat(ctx.advantages[rows][valid].float())
        success, _ = gather_cat(success[valid].float())
        if flow.numel() == 0:
            return
        success = success > 0.5
        cov = ((logprobs - logprobs.mean()) * (advantages - advantages.mean())).double().mean().item()
        step_values = {
            "cov": cov, "flow": _mean(flow), "observed": _mean(observed),
            "successful_flow": _mean(flow[success]), "successful_observed": _mean(observed[success]),
            "failed_flow": _mean(flow[~success]), "failed_observed": _mean(observed[~success]),
        }
        for name, value in step_values.items():
            self.history[name] = (self.history[name] + [value])[-self.window :]
        self.trajectory.append([float(ctx.step), cov, step_values["flow"], step_values["observed"]])
        self.run_steps += 1
        self.run_flow_agree += _sign(step_values["flow"]) == _sign(step_values["observed"])
        self.run_cov_agree += _sign(-cov) == _sign(step_values["observed"])
        self._log_step(ctx, step_values, flow, observed)
        self._log_window(ctx)
        ctx.log(self.log_name("seconds"), time.perf_counter() - start)

    def _log_step(self, ctx: StepContext, values: dict[str, float], flow: Tensor, observed: Tensor) -> None:
        ctx.log(self.log_name("cov_pred"), values["cov"])
        ctx.log(self.log_name("flow_pred"), values["flow"])
        ctx.log(self.log_name("observed"), values["observed"])
        for polarity in ("successful", "failed"):
            ctx.log(self.log_name(f"{polarity}/flow_pred"), values[f"{polarity}_flow"])
            ctx.log(self.log_name(f"{polarity}/observed"), values[f"{polarity}_observed"])
        # Tokens of zero-advantage groups have no predicted change at all: they would count as sign misses.
        moved = flow != 0
        ctx.log(self.log_name("token_sign_agreement"), sign_agreement(flow[moved], observed[moved]))
        ctx.log(self.log_name("token_pearson"), pearson(flow[moved], observed[moved]))
        ctx.log(self.log_name("run/sign_agreement_flow"), self.run_flow_agree / self.run_steps)
        ctx.log(self.log_name("run/sign_agreement_cov"), self.run_cov_agree / self.run_steps)

    def _log_window(self, ctx: StepContext) -> None:
        h = {name: torch.tensor(values, dtype=torch.float64) for name, values in self.history.items()}
        observed = h["observed"]
        for name, predicted in (("flow", h["flow"]), ("cov", -h["cov"])):
            ctx.log(self.log_name(f"window/sign_agreement_{name}"), sign_agreement(predicted, observed))
            ctx.log(self.log_name(f"window/pearson_{name}"), pearson(predicted, observed))
            ctx.log(self.log_name(f"window/spearman_{name}"), spearman(predicted, observed))
        ctx.log(self.log_name("window/eta_eff"), fitted_step_size(h["flow"], observed))
        # What a constant "entropy goes down" forecast would score: the bar for the sign agreements above.
        ctx.log(self.log_name("window/observed_negative_share"), (observed < 0).double().mean().item())
        for polarity in ("successful", "failed"):
            predicted, seen = h[f"{polarity}_flow"], h[f"{polarity}_observed"]
            ctx.log(self.log_name(f"window/{polarity}/sign_agreement"), sign_agreement(predicted, seen))
            ctx.log(self.log_name(f"window/{polarity}/pearson"), pearson(predicted, seen))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": {k: list(v) for k, v in self.history.items()}, "run_steps": self.run_steps,
                "run_flow_agree": self.run_flow_agree, "run_cov_agree": self.run_cov_agree,
                "trajectory": [list(row) for row in self.trajectory]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {name: [float(v) for v in state_dict["history"].get(name, [])] for name in _SERIES}
        self.run_steps = int(state_dict["run_steps"])
        self.run_flow_agree = int(state_dict["run_flow_agree"])
        self.run_cov_agree = int(state_dict["run_cov_agree"])
        self.trajectory = [[float(v) for v in row] for row in state_dict.get("trajectory", [])]
