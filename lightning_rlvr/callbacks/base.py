"""The intervention protocol: a Callback whose hooks :class:`~lightning_rlvr.module.RLVRModule` calls inside a step.

Lightning has no hook that may change a loss (``on_before_backward`` is notify-only), so the module
calls these hooks itself, at fixed points of every training step, on each callback of
``trainer.callbacks`` that subclasses :class:`Intervention`, **in list order**:

=====================  ==========================================  ====================================
hook                   when                                        may change
=====================  ==========================================  ====================================
``on_rollout``         after generation + verification             the batch (rewards, which rows stay)
``shape_advantages``   once per step, after outcome advantages     ``ctx.advantages`` (per token)
``token_weights``      every micro-batch, after the PPO surrogate  per-token weights of the pg loss
``extra_loss``         every micro-batch                           an additive loss term
``on_update_end``      after all optimizer steps of the rollout    the callback's own state
=====================  ==========================================  ====================================

Each hook sees what the previous callbacks did: ``shape_advantages`` reads and returns
``ctx.advantages``; ``token_weights`` returns a factor multiplied into ``mctx.weights`` (the next
callback sees the product); ``extra_loss`` terms are summed (``mctx.extra_losses`` lists those so far).
The per-token policy-gradient loss that is aggregated is ``mctx.policy_loss.loss * mctx.engine_weights *
mctx.weights`` (the engine importance weights only with ``RLVRModule(engine_is_cap=...)``).

A callback states what it needs in :attr:`Intervention.needs` so that the module computes only what
some callback uses: entropy with gradient (entropy bonuses), old-policy log-probs and entropy before
the advantages are shaped (normally skipped on a single on-policy update), reference log-probs (loads
the frozen reference model even without a KL term).

Statistics that a method defines over "the batch" (means, quantiles, top-k, random subsets, maxima) are
taken over the valid tokens of the whole **minibatch on all ranks**, whatever ``micro_batch_size`` is, so
micro-batching changes memory only: :meth:`MicroBatchContext.statistics_view` gives the minibatch's detached
statistics (:class:`MinibatchView`; an intervention declaring ``Needs(minibatch_stats=True)`` makes the module
run one no-grad pass over the minibatch before its micro-batches when it is split, and reuse the training
forward when it is not), :meth:`MinibatchView.gather_valid` concatenates every rank's valid tokens (rank order,
then row-major), so one process and N processes select the same tokens, and :meth:`MinibatchView.once` computes
a selection once per minibatch for all its micro-batches. The verl-based reference implementations take their
statistics per device micro-batch; the interventions that follow them offer that as ``scope="micro_batch"``.

Metrics: ``ctx.log("clip_cov/selected_fraction", x)`` (or ``mctx.log``); values logged several times
in a step (once per micro-batch) are averaged, then logged with the step's other metrics. Under DDP the
step's metrics are averaged over ranks in one all-reduce, so every rank must log the same names (decide
on rank-independent, i.e. already reduced, quantities).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_rlvr.distributed import all_sum, gather_cat

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_rlvr.algorithms.policy_loss import PolicyLossOutput
    from lightning_rlvr.data.batch import RolloutBatch

__all__ = ["Intervention", "MicroBatchContext", "MinibatchView", "Needs", "StatisticsScope", "StepContext"]

#: Over what an intervention takes its batch statistics: the whole minibatch (default: independent of
#: ``micro_batch_size``) or each micro-batch (the verl reference code's per-device semantics).
StatisticsScope = Literal["minibatch", "micro_batch"]


@dataclass(frozen=True)
class Needs:
    """What an intervention asks the module to compute (the union over callbacks is computed).

    Attributes:
        entropy_grad: current-policy entropy with gradient in ``mctx.entropy`` (otherwise detached).
        old_stats: old-policy log-probs and entropy in ``ctx.old_logprobs`` / ``ctx.old_entropy`` before
            ``shape_advantages`` (forces the no-grad pass that a single on-policy update skips).
        ref_logprobs: reference-model log-probs in ``ctx.ref_logprobs`` / ``mctx.ref_logprobs``.
        flow_stats: ``S̄ = Σ_j π_j² (log π_j + H)`` (the first-order entropy-change statistic,
            :mod:`lightning_rlvr.algorithms.entropy_change`) of the current policy in ``mctx.sbar`` and of
            the behaviour policy in ``ctx.old_sbar`` — two more reductions in the same vocabulary pass.
        nucleus_top_p: the ``top_p`` of the current policy's local nucleus entropy and top-two log-prob gap
            in ``mctx.nucleus_entropy`` / ``mctx.top2_gap``
            (:func:`~lightning_rlvr.ops.nucleus_entropy_and_gap`, a no-grad ``topk`` pass); ``None`` = not needed.
        minibatch_stats: the whole minibatch's current statistics in ``mctx.minibatch`` while its micro-batches are
            processed (one no-grad forward over the minibatch when ``micro_batch_size`` splits it).
        on_policy: the intervention assumes every rollout was generated by the policy it trains (the module
            refuses ``RolloutDataModule(max_policy_lag > 0)`` with it).
    """

    entropy_grad: bool = False
    old_stats: bool = False
    ref_logprobs: bool = False
    flow_stats: bool = False
    nucleus_top_p: float | None = None
    minibatch_stats: bool = False
    on_policy: bool = False

    def __or__(self, other: Needs) -> Needs:
        if None not in (self.nucleus_top_p, other.nucleus_top_p) and self.nucleus_top_p != other.nucleus_top_p:
            raise ValueError(f"two interventions need the nucleus statistics at different top_p "
                             f"({self.nucleus_top_p} and {other.nucleus_top_p}); use one value")
        top_p = self.nucleus_top_p if self.nucleus_top_p is not None else other.nucleus_top_p
        flags = {name: getattr(self, name) or getattr(other, name)
                 for name in ("entropy_grad", "old_stats", "ref_logprobs", "flow_stats", "minibatch_stats", "on_policy")}
        return Needs(**flags, nucleus_top_p=top_p)


class _MetricSink:
    """Running means of scalars logged during one step."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def log(self, name: str, value: float | Tensor) -> None:
        value = float(value.item() if isinstance(value, Tensor) else value)
        self.sums[name] = self.sums.get(name, 0.0) + value
        self.counts[name] = self.counts.get(name, 0) + 1

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}


@dataclass
class StepContext:
    """What one training step computed, shared by every intervention of the step.

    Attributes:
        batch: the scored rollout (after ``on_rollout``).
        mask: ``(N, T)`` float response mask.
        advantages: ``(N, T)`` per-token advantages (outcome advantage broadcast, then shaped).
        old_logprobs: ``(N, T)`` behaviour-policy log-probs. Before the update only when some callback
            needs ``old_stats`` (or the module needed them); always filled by ``on_update_end``.
        old_entropy: ``(N, T)`` behaviour-policy token entropy, same availability.
        old_sbar: ``(N, T)`` behaviour-policy ``S̄`` when some callback needs ``flow_stats``; same availability.
        ref_logprobs: ``(N, T)`` reference log-probs when a KL term or a callback needs them.
        step: rollout step (the logger's step).
        aggregation: the module's loss aggregation mode.
        updates_applied: optimizer steps of this rollout that were applied (non-finite ones are skipped;
            on a skipped single on-policy update the old-policy tensors are only partly filled); set
            before ``on_update_end`` (``None`` in contexts built by hand).
    """

    batch: RolloutBatch
    mask: Tensor
    advantages: Tensor
    old_logprobs: Tensor | None = None
    old_entropy: Tensor | None = None
    old_sbar: Tensor | None = None
    ref_logprobs: Tensor | None = None
    step: int = 0
    aggregation: str = "token-mean"
    updates_applied: int | None = None
    metrics: _MetricSink = field(default_factory=_MetricSink)

    def log(self, name: str, value: float | Tensor) -> None:
        """Record a scalar metric for this step (averaged if logged several times)."""
        self.metrics.log(name, value)


def _trained_tokens(mask: Tensor, engine_weights: Tensor | None) -> Tensor:
    """Response tokens (``mask > 0``) less those an engine correction's mask mode dropped (weight 0)."""
    return mask > 0 if engine_weights is None else (mask > 0) & (engine_weights != 0)


@dataclass
class MinibatchView:
    """Detached per-token statistics of every row of one minibatch (or of one micro-batch, for
    ``scope="micro_batch"``), shared by the micro-batches it is split into.

    Attributes:
        mask: ``(B, T)`` float response mask.
        advantages: ``(B, T)`` shaped advantages.
        logprobs: ``(B, T)`` current log-probs (detached).
        old_logprobs: ``(B, T)`` behaviour log-probs.
        entropy: ``(B, T)`` current entropy (detached).
        old_entropy: ``(B, T)`` behaviour entropy.
        policy_loss: the PPO surrogate of these log-probs (ratio and clip indicators; detached), before the engine
            importance weights.
        sbar: ``(B, T)`` current ``S̄`` when some callback needs ``flow_stats``.
        nucleus_entropy: ``(B, T)`` current local top-p entropy when some callback needs ``nucleus_top_p``.
        top2_gap: ``(B, T)`` current top-two log-prob gap, same availability.
        engine_weights: ``(B, T)`` the importance weights the applied loss multiplies each token's surrogate by
            (``RLVRModule(engine_is_cap=...)``; ``None`` without a correction). The update a token makes is this
            times the interventions' weights, so an intervention that balances or scales per-token updates (OPEFO,
            STEER) multiplies them in; a token a mask mode dropped (weight 0) is not :attr:`valid`.
    """

    mask: Tensor
    advantages: Tensor
    logprobs: Tensor
    old_logprobs: Tensor
    entropy: Tensor
    old_entropy: Tensor | None
    policy_loss: PolicyLossOutput
    sbar: Tensor | None = None
    nucleus_entropy: Tensor | None = None
    top2_gap: Tensor | None = None
    engine_weights: Tensor | None = None
    _results: dict = field(default_factory=dict)

    @property
    def valid(self) -> Tensor:
        """``(B, T)`` bool mask of the tokens the update trains on: response tokens, less those the engine
        correction's mask modes dropped (selections and flows are taken over these)."""
        return _trained_tokens(self.mask, self.engine_weights)

    def applied(self, per_token: Tensor) -> Tensor:
        """``per_token`` times the engine importance weights (unchanged without a correction): e.g. a predicted
        entropy change per token, as the applied update makes it."""
        return per_token if self.engine_weights is None else per_token * self.engine_weights

    def gather_valid(self, values: Tensor) -> tuple[Tensor, int]:
        """These rows' valid-token values on every rank, flattened: ``(all_values, offset of this rank's)``."""
        return gather_cat(values[self.valid].detach())

    def scatter_valid(self, selected: Tensor, offset: int) -> Tensor:
        """Inverse of :meth:`gather_valid` for this rank: a flat selection back to a ``(B, T)`` tensor."""
        valid = self.valid
        local = selected[offset : offset + int(valid.sum().item())]
        out = torch.zeros(valid.shape, dtype=selected.dtype, device=valid.device)
        out[valid] = local.to(valid.device)
        return out

    def once(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()`` the first time ``key`` (e.g. the intervention) asks, its cached result afterwards: a
        selection made once per minibatch serves all its micro-batches."""
        if key not in self._results:
            self._results[key] = compute()
        return self._results[key]


@dataclass
class MicroBatchContext:
    """One micro-batch of one optimizer step (rows ``index`` of the step's batch).

    Attributes:
        step: the step's :class:`StepContext`.
        index: ``(b,)`` rows of ``step.batch`` in this micro-batch.
        mask: ``(b, T)`` float response mask.
        advantages: ``(b, T)`` shaped advantages.
        logprobs: ``(b, T)`` current log-probs (with gradient).
        old_logprobs: ``(b, T)`` behaviour log-probs (detached).
        entropy: ``(b, T)`` current entropy (with gradient only if some callback needs ``entropy_grad``).
        old_entropy: ``(b, T)`` behaviour-policy entropy (detached; the current one on a single on-policy update).
        sbar: ``(b, T)`` current ``S̄`` when some callback needs ``flow_stats``, else ``None``.
        nucleus_entropy: ``(b, T)`` current local top-p entropy when some callback needs ``nucleus_top_p``.
        top2_gap: ``(b, T)`` current top-two log-prob gap, same availability.
        ref_logprobs: ``(b, T)`` or ``None``.
        policy_loss: the PPO surrogate's per-token output (loss, ratio, clip indicators), before the engine
            importance weights.
        weights: ``(b, T)`` product of the ``token_weights`` returned so far (starts at 1).
        aggregate: ``aggregate(values) -> scalar`` with the module's mode and minibatch-wide normaliser,
            so that an extra loss term accumulates over micro-batches (and ranks) like the pg loss.
        extra_losses: ``{callback state_key: term}`` returned so far this micro-batch.
        minibatch: the whole minibatch's statistics when some callback needs ``minibatch_stats``
            (:meth:`statistics_view`).
        rows: ``(b,)`` positions of this micro-batch's rows in ``minibatch``.
        share_scale: micro-batches in the minibatch × ranks (see :meth:`log_share`).
        engine_weights: ``(b, T)`` the engine importance weights of these tokens, or ``None`` without a correction
            (:attr:`MinibatchView.engine_weights`).
    """

    step: StepContext
    index: Tensor
    mask: Tensor
    advantages: Tensor
    logprobs: Tensor
    old_logprobs: Tensor
    entropy: Tensor
    ref_logprobs: Tensor | None
    policy_loss: PolicyLossOutput
    weights: Tensor
    aggregate: Callable[[Tensor], Tensor]
    extra_losses: dict[str, Tensor] = field(default_factory=dict)
    old_entropy: Tensor | None = None
    sbar: Tensor | None = None
    nucleus_entropy: Tensor | None = None
    top2_gap: Tensor | None = None
    minibatch: MinibatchView | None = None
    rows: Tensor | None = None
    share_scale: float = 1.0
    engine_weights: Tensor | None = None
    _own_view: MinibatchView | None = None

    def log(self, name: str, value: float | Tensor) -> None:
        """Record a scalar metric (values logged several times in a step are averaged)."""
        self.step.log(name, value)

    def log_share(self, name: str, value: float | Tensor) -> None:
        """Record this micro-batch's *share* of a minibatch-wide quantity, e.g. an extra loss term built with
        :attr:`aggregate` (whose normaliser is the whole minibatch's on all ranks): the metric is the whole
        minibatch's value, however many micro-batches and ranks it is split over (mean over the step's minibatches)."""
        self.step.log(name, value * self.share_scale)

    def statistics_view(self, scope: StatisticsScope = "minibatch") -> tuple[MinibatchView, Tensor]:
        """``(view, rows)``: the statistics a batch-level selection is taken over, and this micro-batch's rows in it.

        ``scope="minibatch"``: the whole minibatch (needs ``Needs(minibatch_stats=True)``), so the selection does
        not depend on ``micro_batch_size``; ``"micro_batch"``: this micro-batch alone.
        """
        if scope == "minibatch":
            if self.minibatch is None:
                raise RuntimeError("the minibatch's statistics were not computed: declare Needs(minibatch_stats=True)")
            return self.minibatch, self.rows
        if self._own_view is None:
            self._own_view = MinibatchView(
                mask=self.mask, advantages=self.advantages, logprobs=self.logprobs.detach(),
                old_logprobs=self.old_logprobs, entropy=self.entropy.detach(), old_entropy=self.old_entropy,
                policy_loss=detached(self.policy_loss), sbar=None if self.sbar is None else self.sbar.detach(),
                nucleus_entropy=self.nucleus_entropy, top2_gap=self.top2_gap, engine_weights=self.engine_weights)
        return self._own_view, torch.arange(len(self.index), device=self.mask.device)

    @property
    def valid(self) -> Tensor:
        """``(b, T)`` bool mask of valid tokens (response tokens the engine correction did not drop)."""
        return _trained_tokens(self.mask, self.engine_weights)



class Intervention(Callback):
    """Base class of entropy interventions: override the hooks you need (all are no-ops by default).

    Subclasses set :attr:`needs`, validate their constructor arguments immediately, and define
    :attr:`state_key` from those arguments when two instances may coexist (see :meth:`_state_key`).
    """

    needs: Needs = Needs()
    #: Prefix of this intervention's metrics (``<prefix>/<name>``).
    metric_prefix: str = ""

    def on_rollout(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: RolloutBatch) -> RolloutBatch | None:
        """Change the scored rollout (rewards, kept rows); return the new batch or ``None`` to keep it."""
        return None

    def shape_advantages(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> Tensor | None:
        """Return new ``(N, T)`` advantages (``ctx.advantages`` holds the current ones) or ``None``."""
        return None

    def token_weights(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: MicroBatchContext
    ) -> Tensor | None:
        """Return a ``(b, T)`` factor for the per-token pg loss (multiplied into ``ctx.weights``) or ``None``."""
        return None

    def extra_loss(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: MicroBatchContext) -> Tensor | None:
        """Return a scalar added to this micro-batch's loss (use ``ctx.aggregate``) or ``None``."""
        return None

    def on_update_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> None:
        """Called once per rollout step after its optimizer steps; update state, log metrics."""

    def _state_key(self, **arguments: Any) -> str:
        # A non-default statistics scope is part of the key; the default is not, so checkpoints keep their keys.
        scope = getattr(self, "scope", "minibatch")
        return self._generate_state_key(**arguments, **({} if scope == "minibatch" else {"scope": scope}))

    def _statistics_scope(self, scope: StatisticsScope) -> Needs:
        """Validate and keep ``scope`` (batch statistics per minibatch or per micro-batch); the ``Needs`` it implies."""
        if scope not in ("minibatch", "micro_batch"):
            raise ValueError(f"{type(self).__name__}: scope must be 'minibatch' or 'micro_batch', got {scope!r}")
        self.scope = scope
        return Needs(minibatch_stats=scope == "minibatch")

    def log_name(self, name: str) -> str:
        return f"{self.metric_prefix}/{name}" if self.metric_prefix else name


def detached(policy_loss: PolicyLossOutput) -> PolicyLossOutput:
    """The surrogate's output without its graph (statistics are read, never differentiated)."""
    return dataclasses.replace(policy_loss, loss=policy_loss.loss.detach(), ratio=policy_loss.ratio.detach())


def masked_mean(values: Tensor, mask: Tensor) -> float:
    """Mean of ``values`` over ``mask`` on all ranks (``nan`` when empty)."""
    mask = mask.float()
    totals = all_sum(torch.stack([(values.detach().float() * mask).sum(), mask.sum()]))
    return totals[0].item() / totals[1].item() if totals[1] > 0 else math.nan


def entropy_before_update(pl_module: pl.LightningModule, ctx: StepContext, rows: Tensor) -> Tensor | None:
    """``H_before`` of ``rows`` from the forward that ``recompute_token_stats`` will give ``H_after`` with, for
    callbacks that measure what an update changed (call it before the update, e.g. in ``shape_advantages``).

    ``None`` when ``ctx.old_entropy`` already is that forward's. When the rollout engine supplied the behaviour
    stats (HFEngine's decoding loop), its cached one-token forward differs from the full one by float rounding
    (~1e-8), which on a step that changed nothing would be measured as the change.
    """
    if ctx.batch.behaviour_entropy is None:
        return None
    return pl_module.recompute_token_stats(ctx.batch.select(rows)).entropy
