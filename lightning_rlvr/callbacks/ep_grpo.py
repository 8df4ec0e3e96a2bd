"""EP-GRPO: Entropy-Progress aligned GRPO with implicit process guidance (arXiv 2605.04960; a Table 1 baseline of RCEA).

Three fixes of GRPO's uniform token credit, as the abstract names them, in a design of ours (no formulas were
found; ALGORITHMS.md §9.5, lowest confidence — :mod:`lightning_rlvr.algorithms.progress_advantage`):

1. **entropy gate** — the sequence advantage becomes token weights ``g_t = clip(1 + β(H_t/H̄_i − 1), 0.5, 2)``
   that favour the response's high-entropy "pivot" tokens;
2. **implicit process signal** — the policy's divergence from the reference, ``d_t = log π_old − log π_ref``,
   bounded by ``tanh(d/τ_d)`` and *anchored to the outcome*: signed by ``A_i`` (a token the policy already moved
   toward is reinforced on successes and suppressed on failures); in zero-variance groups (``A_i = 0``) the
   verifier outcome gives the sign, so such groups still get a gradient once the policy has moved;
3. **progress-aligned normalisation** — ``A' = g (A + γ p)`` is centred within each question and each of
   ``K`` bins of cumulative-entropy progress ``P_{i,t} = Σ_{s≤t} H / Σ H``, comparing tokens at the same stage of
   the reasoning rather than at the same index (``normalize="zscore"`` also divides by the cell's std).

Our first design (unsigned zero-variance groups, z-scored cells) collapsed on the quickstart; see
:mod:`lightning_rlvr.algorithms.progress_advantage` for why, and ``unsigned_zero_variance=True`` /
``normalize="zscore"`` to reproduce it.

Needs the behaviour policy's entropy and the reference model's log-probs (the frozen initial policy is loaded
even without a KL term; with :class:`SupervisedWarmStart` it is the warmed-up policy). At the very first step
``π_old = π_ref`` so ``p = 0``: zero-variance groups get their gradient only after the policy has moved.
``normalize="none"`` skips step 3 (an ablation).

Metrics: ``ep_grpo/gate_mean``, ``ep_grpo/process_mean_abs`` (``|p|``), ``ep_grpo/process_outcome_corr`` (Pearson
of ``p`` and ``A`` over signed tokens), ``ep_grpo/zero_variance_groups`` (share of groups with ``A = 0``) and
``ep_grpo/zero_variance_with_gradient`` (the share of those whose shaped advantage is non-zero somewhere).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor
from typing_extensions import override

from lightning_rlvr.algorithms.progress_advantage import (
    cumulative_entropy_progress,
    divergence_signal,
    entropy_gate,
    progress_bins,
    progress_normalize,
)
from lightning_rlvr.callbacks.base import Intervention, Needs, StepContext
from lightning_rlvr.distributed import all_sum

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["EPGRPO"]

NORMALIZE_MODES = ("center", "zscore", "none")


class EPGRPO(Intervention):
    """Entropy-gated, divergence-guided, progress-normalised token advantages (arXiv 2605.04960).

    Args:
        gate_strength: β of the entropy gate.
        gate_low: lower clip of the gate (``0 < gate_low ≤ 1``).
        gate_high: upper clip of the gate (``≥ 1``).
        process_weight: γ of the implicit process signal.
        divergence_temperature: τ_d (nats of log-ratio).
        progress_bins: K cumulative-entropy progress bins.
        normalize: ``"center"`` (subtract the (question, progress bin) mean), ``"zscore"`` (also divide by its
            std) or ``"none"``.
        unsigned_zero_variance: leave the process signal of zero-advantage rows unsigned (``+tanh(d/τ)``) instead
            of signing it by the verifier outcome — the first design, kept as an ablation.

    Example::

        >>> from lightning_rlvr.callbacks import EPGRPO
        >>> EPGRPO().needs.ref_logprobs
        True
    """

    metric_prefix = "ep_grpo"

    def __init__(self, gate_strength: float = 0.5, gate_low: float = 0.5, gate_high: float = 2.0,
                 process_weight: float = 0.1, divergence_temperature: float = 0.5, progress_bins: int = 10,
                 normalize: Literal["center", "zscore", "none"] = "center",
                 unsigned_zero_variance: bool = False) -> None:
        if gate_strength < 0:
            raise ValueError(f"EPGRPO: gate_strength must be >= 0, got {gate_strength}")
        if not 0 < gate_low <= 1 <= gate_high:
            raise ValueError(f"EPGRPO: need 0 < gate_low <= 1 <= gate_high, got {gate_low}, {gate_high}")
        if process_weight < 0:
            raise ValueError(f"EPGRPO: process_weight must be >= 0, got {process_weight}")
        if divergence_temperature <= 0:
            raise ValueError(f"EPGRPO: divergence_temperature must be > 0, got {divergence_temperature}")
        if progress_bins < 1:
            raise ValueError(f"EPGRPO: progress_bins must be >= 1, got {progress_bins}")
        if normalize not in NORMALIZE_MODES:
            raise ValueError(f"EPGRPO: normalize must be one of {NORMALIZE_MODES}, got {normalize!r}")
        self.gate_strength, self.gate_low, self.gate_high = float(gate_strength), float(gate_low), float(gate_high)
        self.process_weight, self.divergence_temperature = float(process_weight), float(divergence_temperature)
        self.progress_bins, self.normalize = int(progress_bins), normalize
        self.unsigned_zero_variance = bool(unsigned_zero_variance)
        self.needs = Needs(old_stats=True, ref_logprobs=True)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(gate_strength=self.gate_strength, gate_low=self.gate_low, gate_high=self.gate_high,
                               process_weight=self.process_weight, divergence_temperature=self.divergence_temperature,
                               progress_bins=self.progress_bins, normalize=self.normalize,
                               unsigned_zero_variance=self.unsigned_zero_variance)

    def shaped(self, ctx: StepContext) -> tuple[Tensor, Tensor, Tensor]:
        """``(A'', gate, process signal)`` for the step (pure given the context)."""
        mask, entropy = ctx.mask, ctx.old_entropy.float()
        gate = entropy_gate(entropy, mask, self.gate_strength, self.gate_low, self.gate_high)
        correct = None if self.unsigned_zero_variance else ctx.batch.correct
        process = divergence_signal(ctx.old_logprobs, ctx.ref_logprobs, ctx.advantages, self.divergence_temperature,
                                    correct)
        process = process * mask
        shaped = gate * (ctx.advantages + self.process_weight * process)
        if self.normalize != "none":
            bins = progress_bins(cumulative_entropy_progress(entropy, mask), self.progress_bins)
            shaped = progress_normalize(shaped, mask, ctx.batch.group_ids, bins, self.progress_bins,
                                        scale=self.normalize == "zscore")
        return shaped * mask, gate, process

    @override
    def shape_advantages(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> Tensor:
        if ctx.ref_logprobs is None or ctx.old_entropy is None:
            raise RuntimeError("EPGRPO needs the behaviour entropy and reference log-probs in the step context")
        shaped, gate, process = self.shaped(ctx)
        self._log(ctx, shaped, gate, process)
        return shaped

    def _log(self, ctx: StepContext, shaped: Tensor, gate: Tensor, process: Tensor) -> None:
        valid = ctx.mask > 0
        signed = valid & (ctx.advantages != 0)
        a, p = ctx.advantages[signed].double(), process[signed].double()
        groups = ctx.batch.group_ids
        n_groups = int(groups.max().item()) + 1 if groups.numel() else 0
        row_zero = (ctx.advantages * ctx.mask).abs().sum(-1) == 0
        row_moved = (shaped.abs() * ctx.mask).sum(-1) > 0
        # float32, not the default dtype (bfloat16 inside training_step under bf16-true)
        per_group = torch.zeros(n_groups, dtype=torch.float32, device=groups.device)
        group_zero = per_group.index_add(0, groups, (~row_zero).float()) == 0
        group_moved = per_group.index_add(0, groups, row_moved.float()) > 0
        sums = all_sum(torch.stack([
            gate[valid].double().sum(), process[valid].double().abs().sum(), valid.sum().double(),
            a.sum(), p.sum(), (a * a).sum(), (p * p).sum(), (a * p).sum(), a.new_tensor(float(a.numel())),
            group_zero.double().sum(), (group_zero & group_moved).double().sum(), a.new_tensor(float(n_groups)),
        ]))
        g_sum, p_abs, n_valid, sa, sp, saa, spp, sap, n, zero, zero_moved, groups_total = sums.tolist()
        ctx.log(self.log_name("gate_mean"), g_sum / n_valid if n_valid else math.nan)
        ctx.log(self.log_name("process_mean_abs"), p_abs / n_valid if n_valid else math.nan)
        cov = sap / n - sa * sp / n**2 if n else math.nan
        var_a, var_p = (saa / n - (sa / n) ** 2, spp / n - (sp / n) ** 2) if n else (math.nan, math.nan)
        corr = cov / math.sqrt(var_a * var_p) if n and var_a > 0 and var_p > 0 else math.nan
        ctx.log(self.log_name("process_outcome_corr"), corr)
        ctx.log(self.log_name("zero_variance_groups"), zero / groups_total if groups_total else math.nan)
        ctx.log(self.log_name("zero_variance_with_gradient"), zero_moved / zero if zero else math.nan)
