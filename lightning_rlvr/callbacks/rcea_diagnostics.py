"""RCEADiagnostics: reward-conditioned entropy allocation, logged during training (seed paper ``seeds/002``).

Global entropy conflates uncertainty in failed and successful trajectories and diversity across correct
solution strategies; RCEA separates them (:mod:`lightning_rlvr.metrics.rcea`, ALGORITHMS.md §9.4). From the
behaviour policy's token entropy of every rollout batch — no extra forward pass — this callback accumulates,
over windows of ``every_n_steps`` rollout steps, and logs at the end of each window:

- ``rcea/failed_entropy``, ``rcea/successful_entropy``, ``rcea/ratio`` (token-weighted), the ``*_seq``
  sequence-weighted variants, ``rcea/failed_mass_share``;
- ``rcea/paired_ratio`` with ``rcea/paired_ci_low`` / ``rcea/paired_ci_high`` (seeded bootstrap over questions),
  ``rcea/paired_questions``, ``rcea/failure_higher`` and ``rcea/sign_test_p`` (one-sided exact). Questions are
  identified by their prompt tokens, so a prompt drawn twice in a window pools its completions;
- ``rcea/cov_tail/<stratum>_top<pct>pct``: the share of positive chosen-token covariance
  ``(log π − mean)(A − mean)`` held by each stratum's top tokens, on the window's last batch (an endpoint proxy);
- every ``retention_every_n_steps`` steps, **correct-solution-mode retention** on a fixed probe set (the
  first ``probe_size`` held-out problems, ``probe_samples`` samples each at the training temperature):
  ``rcea/retention`` = retained baseline modes / baseline modes, pooled over questions, with a bootstrap CI
  over questions (``rcea/retention_ci_low`` / ``_high``), ``rcea/modes_per_question`` and
  ``rcea/probe_coverage`` (share of probe questions with a correct sample). The baseline is the policy at the
  first training step (after any warm start). Modes are clusters of correct completions
  (:func:`~lightning_rlvr.metrics.rcea.cluster_modes`; ``mode_similarity = 1`` = distinct normalised texts).
  On the embedded arithmetic tasks every question has a single correct text, so retention there is the
  retention of correct-answer *coverage*; on free-form reasoning it counts distinct solutions. The probe runs
  under a forked RNG with its own seed, so it does not change the training run's random stream. This is
  answer-coverage retention (at most 1), not the seed paper's rarefied effective-mode ratio;
- at the same probes, the **rarefied effective-mode ratio** (our reading of the seed paper's "rarefied
  effective-mode retention", Table A6; [derived]): per probe question, the Hill number of order 1 of its correct
  samples' modes, ``exp(−Σ_j p_j log p_j)``, averaged over ``rarefaction_draws`` random subsets of
  ``rarefaction_size`` correct samples (:func:`~lightning_rlvr.metrics.rcea.rarefied_effective_modes`), at the
  baseline and now; ``rcea/effective_mode_ratio = Σ_q D_now(q) / Σ_q D_base(q)`` over the questions with at
  least ``rarefaction_size`` correct samples at both (``rcea/effective_mode_questions``), with a bootstrap CI over
  them (``_ci_low`` / ``_ci_high``). It can exceed 1. The draws are frozen: each question's generator is seeded
  from ``seed``, its probe index and baseline-or-now, so a rerun draws the same subsets;
- with ``endpoint_samples = K > 0``, at the same probes, the seed paper's **endpoint paired ratio** (its Tables
  A4-A5): ``K`` samples of each probe question at that checkpoint, their token entropies under the policy (one
  no-grad forward), and only the questions with at least ``endpoint_min_per_stratum`` (seed: 8) failed and as
  many successful samples: ``rcea/endpoint_paired_ratio`` with ``_ci_low`` / ``_ci_high``,
  ``rcea/endpoint_paired_questions``, ``rcea/endpoint_coverage`` (paired / probe questions),
  ``rcea/endpoint_failure_higher`` and ``rcea/endpoint_sign_test_p``. The rolling ``rcea/paired_*`` above are
  the training-rollout version (the behaviour policy's samples pooled over a window, any count per stratum).
  Rank 0 also logs the paired questions' rows as a table artifact,
  :func:`~lightning_rlvr.loggers.endpoint_ratios_artifact` (``rcea/endpoint_step_<step>.json``): ``question``
  (index in the probe set, the same in every run), ``log_ratio``, ``failed``, ``successful`` — for a report
  that pools several runs' questions.

At the end of the fit, rank 0 plots the stratum trajectories and the paired-ratio CIs (and predicted vs
observed entropy change when an :class:`~lightning_rlvr.callbacks.EntropyChangeProbe` is in the callbacks)
and logs them to MLflow (``plots/*.png``) or writes them to ``plot_dir`` (:func:`~lightning_rlvr.plots.save_figures`).
Under DDP every rank updates its torchmetrics and calls ``compute`` (a collective); probe questions are sharded
over ranks and their counts gathered, so the statistics are those of the whole batch / probe set.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_rlvr.algorithms.covariance import token_covariance
from lightning_rlvr.callbacks.base import Intervention, StepContext
from lightning_rlvr.distributed import gather_cat, world_size
from lightning_rlvr.loggers import endpoint_ratios_artifact, log_table
from lightning_rlvr.metrics.rcea import (
    CovarianceTailConcentration,
    PairedEntropyRatio,
    StratifiedEntropy,
    bootstrap_ci,
    cluster_modes,
    mode_labels,
    mode_retention,
    paired_ratio_summary,
    rarefied_effective_modes,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_rlvr.data.batch import RolloutBatch

__all__ = ["RCEADiagnostics", "question_ids"]


def question_ids(batch: RolloutBatch) -> Tensor:
    """A stable int64 id per row from its prompt tokens (padding excluded): equal prompts → equal ids, any rank."""
    prompt = batch.input_ids[:, : batch.prompt_length].tolist()
    attention = batch.attention_mask[:, : batch.prompt_length].tolist()
    # hash() of a tuple of ints does not depend on PYTHONHASHSEED: the same on every process.
    return torch.tensor([hash(tuple(t for t, a in zip(ids, att) if a)) for ids, att in zip(prompt, attention)],
                        dtype=torch.long)


class RCEADiagnostics(Intervention):
    """Entropy by verifier outcome, paired ratios with CIs, covariance tail concentration, mode retention and the
    rarefied effective-mode ratio.

    Args:
        every_n_steps: window length (rollout steps) of the stratified and paired statistics.
        num_resamples: bootstrap resamples (paired ratio, retention).
        confidence: two-sided level of the bootstrap intervals.
        seed: bootstrap seed (and the probe's sampling seed).
        tail_fractions: upper-tail budgets of the covariance concentration.
        retention_every_n_steps: probe period in rollout steps (0 = no mode retention).
        probe_size: probe questions (the first held-out problems).
        probe_samples: samples per probe question.
        mode_similarity: character-3-gram Jaccard threshold of one mode (1 = identical normalised text).
        plots: write the figures at the end of the fit.
        plot_dir: folder for the PNGs (default: MLflow artifacts, else ``<default_root_dir>/plots``).
        min_per_stratum: failed and successful responses a question needs within a window to enter the rolling
            paired ratio (with ``group_size`` 8 a window of training rollouts rarely has 8 of each, so the default 1
            pairs any question with both outcomes).
        endpoint_samples: samples per probe question of the endpoint paired ratio at each probe (0: off).
        endpoint_min_per_stratum: failed and successful samples a probe question needs to enter it (seed: 8).
        rarefaction_size: correct samples per rarefaction draw of the effective-mode ratio; a probe question with
            fewer correct samples (at the baseline or now) is left out of it. At most ``probe_samples``.
        rarefaction_draws: random subsets averaged per question and probe.

    Example::

        >>> from lightning_rlvr.callbacks import RCEADiagnostics
        >>> RCEADiagnostics(every_n_steps=50).every_n_steps
        50
    """

    metric_prefix = "rcea"

    def __init__(self, every_n_steps: int = 20, num_resamples: int = 1000, confidence: float = 0.95, seed: int = 0,
                 tail_fractions: tuple[float, ...] = (0.01, 0.025, 0.05), retention_every_n_steps: int = 500,
                 probe_size: int = 64, probe_samples: int = 8, mode_similarity: float = 1.0, plots: bool = True,
                 plot_dir: str | None = None, min_per_stratum: int = 1, endpoint_samples: int = 0,
                 endpoint_min_per_stratum: int = 8, rarefaction_size: int = 4, rarefaction_draws: int = 10) -> None:
        if every_n_steps < 1:
            raise ValueError(f"RCEADiagnostics: every_n_steps must be >= 1, got {every_n_steps}")
        if num_resamples < 1 or not 0 < confidence < 1:
            raise ValueError("RCEADiagnostics: need num_resamples >= 1 and 0 < confidence < 1")
        if retention_every_n_steps < 0 or probe_size < 1 or probe_samples < 1:
            raise ValueError("RCEADiagnostics: need retention_every_n_steps >= 0, probe_size >= 1, probe_samples >= 1")
        if endpoint_samples < 0 or endpoint_min_per_stratum < 1:
            raise ValueError(f"RCEADiagnostics: need endpoint_samples >= 0 and endpoint_min_per_stratum >= 1, got "
                             f"{endpoint_samples}, {endpoint_min_per_stratum}")
        if endpoint_samples and not retention_every_n_steps:
            raise ValueError("RCEADiagnostics: endpoint_samples needs retention_every_n_steps > 0 (the probe steps)")
        if not 0 < mode_similarity <= 1:
            raise ValueError(f"RCEADiagnostics: mode_similarity must be in (0, 1], got {mode_similarity}")
        if rarefaction_size < 1 or rarefaction_draws < 1:
            raise ValueError(f"RCEADiagnostics: need rarefaction_size >= 1 and rarefaction_draws >= 1, got "
                             f"{rarefaction_size}, {rarefaction_draws}")
        if rarefaction_size > probe_samples:
            raise ValueError(f"RCEADiagnostics: rarefaction_size ({rarefaction_size}) must be <= probe_samples "
                             f"({probe_samples}): no question could have that many correct samples")
        self.every_n_steps, self.num_resamples, self.confidence, self.seed = every_n_steps, num_resamples, confidence, seed
        self.tail_fractions = tuple(float(f) for f in tail_fractions)
        self.retention_every_n_steps, self.probe_size, self.probe_samples = retention_every_n_steps, probe_size, probe_samples
        self.mode_similarity, self.plots, self.plot_dir = float(mode_similarity), bool(plots), plot_dir
        self.strata = StratifiedEntropy()
        self.paired = PairedEntropyRatio(num_resamples, confidence, seed, min_per_stratum)  # validates the minimum
        self.endpoint_samples, self.endpoint_min_per_stratum = int(endpoint_samples), int(endpoint_min_per_stratum)
        self.endpoint: list[dict[str, float]] = []
        self.cov_tail = CovarianceTailConcentration(self.tail_fractions)  # validates the fractions
        self.rarefaction_size, self.rarefaction_draws = int(rarefaction_size), int(rarefaction_draws)
        self.baseline_modes: list[list[str]] | None = None
        #: this rank's probe questions' rarefied effective modes at the baseline (``nan``: too few correct samples).
        self.baseline_effective_modes: list[float] | None = None
        #: one dict of logged values per window (and per probe), for the plots and for users.
        self.windows: list[dict[str, float]] = []
        self.retention: list[dict[str, float]] = []

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(every_n_steps=self.every_n_steps, seed=self.seed,
                               retention_every_n_steps=self.retention_every_n_steps, probe_size=self.probe_size)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # States live where the data is: a NCCL all-gather needs CUDA tensors, gloo takes CPU ones.
        for metric in (self.strata, self.paired, self.cov_tail):
            metric.to(pl_module.device)

    # -- per-step statistics -------------------------------------------------------------------------------
    @override
    def on_update_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> None:
        if ctx.updates_applied == 0:
            return  # the behaviour stats of a fully skipped single update are only partly filled
        batch, mask = ctx.batch, ctx.mask
        entropy, correct = ctx.old_entropy.detach(), batch.correct
        self.strata.update(entropy, mask, correct)
        self.paired.update(entropy, mask, correct, question_ids(batch).to(entropy.device))
        window_end = (ctx.step + 1) % self.every_n_steps == 0
        if window_end:
            self._log_window(ctx)
        if self.retention_every_n_steps and (ctx.step + 1) % self.retention_every_n_steps == 0:
            self._log_retention(trainer, pl_module, ctx)
            if self.endpoint_samples:
                self._log_endpoint(trainer, pl_module, ctx)

    def _log_window(self, ctx: StepContext) -> None:
        valid = ctx.mask > 0
        logprobs, _ = gather_cat(ctx.old_logprobs[valid].float())
        advantages, offset = gather_cat(ctx.advantages[valid].float())
        covariance = torch.zeros_like(ctx.mask)
        covariance[valid] = token_covariance(logprobs, advantages)[offset : offset + int(valid.sum())].to(ctx.mask.dtype)
        self.cov_tail.update(covariance, ctx.mask, ctx.batch.correct)
        values: dict[str, float] = {"step": float(ctx.step)}
        strata = {k: v.item() for k, v in self.strata.compute().items()}
        for key in ("failed", "successful", "failed_seq", "successful_seq"):
            values[f"{key}_entropy"] = strata[key]
        values.update(ratio=strata["ratio"], ratio_seq=strata["ratio_seq"], failed_mass_share=strata["failed_mass_share"])
        paired = {k: v.item() for k, v in self.paired.compute().items()}
        values.update(paired_ratio=paired["geometric_mean"], paired_ci_low=paired["ci_low"],
                      paired_ci_high=paired["ci_high"], paired_questions=paired["paired"],
                      failure_higher=paired["failure_higher"], sign_test_p=paired["sign_test_p"])
        values.update({f"cov_tail/{k}": v.item() for k, v in self.cov_tail.compute().items()})
        for metric in (self.strata, self.paired, self.cov_tail):
            metric.reset()
        self.windows.append(values)
        for key, value in values.items():
            if key != "step":
                ctx.log(self.log_name(key), value)

    # -- mode retention --------------------------------------------------------------------------------------
    def _probe_problems(self, trainer: pl.Trainer) -> list:
        """This rank's shard of the probe set (the first ``probe_size`` held-out problems)."""
        probe = trainer.datamodule.source.held_out_problems()[: self.probe_size]
        return probe[trainer.global_rank :: max(world_size(), 1)]

    @staticmethod
    def _probe_index(trainer: pl.Trainer, local: int) -> int:
        """The probe-set index of this rank's ``local``-th probe question (rank ``r`` holds ``probe[r::world]``)."""
        return trainer.global_rank + max(world_size(), 1) * local

    def _rarefaction_generator(self, index: int, baseline: bool) -> torch.Generator:
        """A private generator per (seed, probe question, baseline or now): frozen draws, independent of the rank
        layout and of every other random stream (the probe's sampling RNG is not touched)."""
        return torch.Generator().manual_seed((self.seed * 1_000_003 + index) * 2 + int(not baseline))

    def _probe_modes(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     step: int) -> list[tuple[list[str], bool, float]]:
        """This rank's shard of the probe set: per question, its modes, whether any sample was correct and its
        rarefied effective modes (``step = -1``: the baseline's draws)."""
        data = trainer.datamodule
        problems = self._probe_problems(trainer)
        if not problems:
            return []
        device = pl_module.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self.seed + step)
            samples = data.sample_completions(problems, self.probe_samples)
        out = []
        for local, rows in enumerate(samples):
            correct = [t for t, ok in rows if ok]
            effective = rarefied_effective_modes(
                mode_labels(correct, self.mode_similarity), self.rarefaction_size, self.rarefaction_draws,
                self._rarefaction_generator(self._probe_index(trainer, local), baseline=step < 0))
            out.append((cluster_modes(correct, self.mode_similarity), any(ok for _, ok in rows), effective))
        return out

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.retention_every_n_steps and self.baseline_modes is None:
            baseline = self._probe_modes(trainer, pl_module, step=-1)
            self.baseline_modes = [modes for modes, _, _ in baseline]
            self.baseline_effective_modes = [effective for _, _, effective in baseline]

    def _log_retention(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> None:
        current = self._probe_modes(trainer, pl_module, ctx.step)
        baseline_modes = self.baseline_modes or []
        # A checkpoint from before the effective-mode ratio has no baseline for it: those questions are left out.
        baseline_effective = self.baseline_effective_modes or [math.nan] * len(baseline_modes)
        rows = [[float(len(base)), float(mode_retention(base, modes, self.mode_similarity)), float(len(modes)),
                 float(covered), base_effective, effective]
                for base, base_effective, (modes, covered, effective)
                in zip(baseline_modes, baseline_effective, current)]
        local = torch.tensor(rows, dtype=torch.float64).reshape(-1)
        gathered, _ = gather_cat(local.to(ctx.mask.device))
        table = gathered.cpu().view(-1, 6)
        base, kept = table[:, 0], table[:, 1]
        has_base = base > 0
        retention = kept.sum().item() / base.sum().item() if base.sum() > 0 else math.nan
        low, high = bootstrap_ci(kept[has_base] / base[has_base], weights=base[has_base],
                                 num_resamples=self.num_resamples, confidence=self.confidence, seed=self.seed)
        values = {"retention": retention, "retention_ci_low": low, "retention_ci_high": high,
                  "modes_per_question": table[:, 2].mean().item() if len(table) else math.nan,
                  "baseline_modes_per_question": base.mean().item() if len(table) else math.nan,
                  "probe_coverage": table[:, 3].mean().item() if len(table) else math.nan,
                  **self._effective_mode_ratio(table[:, 4], table[:, 5])}
        self.retention.append({"step": float(ctx.step), **values})
        for key, value in values.items():
            ctx.log(self.log_name(key), value)

    def _effective_mode_ratio(self, baseline: Tensor, current: Tensor) -> dict[str, float]:
        """``Σ_q current(q) / Σ_q baseline(q)`` over the questions rarefied at both probes, with its bootstrap CI."""
        both = baseline.isfinite() & current.isfinite()
        baseline, current = baseline[both], current[both]
        ratio = current.sum().item() / baseline.sum().item() if both.any() else math.nan
        # weights = the baseline counts: each resample's Σ w x / Σ w is again a ratio of sums.
        low, high = bootstrap_ci(current / baseline, weights=baseline, num_resamples=self.num_resamples,
                                 confidence=self.confidence, seed=self.seed)
        return {"effective_mode_ratio": ratio, "effective_mode_ratio_ci_low": low,
                "effective_mode_ratio_ci_high": high, "effective_mode_questions": float(both.sum())}

    # -- the endpoint paired ratio ----------------------------------------------------------------------------
    def _log_endpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: StepContext) -> None:
        device = pl_module.device
        metric = PairedEntropyRatio(self.num_resamples, self.confidence, self.seed,
                                    self.endpoint_min_per_stratum).to(device)
        problems = self._probe_problems(trainer)
        if problems:
            # Its own seed, apart from the retention probe's, and a forked RNG: training's random stream is unchanged.
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(self.seed + ctx.step + 7919)
                batch = trainer.datamodule.sample_batch(problems, self.endpoint_samples).to(device)
            entropy = pl_module.recompute_token_stats(batch).entropy
            # The question id is the probe index: rows come grouped by problem in order (group_ids 0..), and this
            # rank's problem i is probe[rank + world * i]. Unlike a prompt hash it is the same in every run, so a
            # report can pool runs by question, and two probe problems with the same prompt stay two questions.
            index = self._probe_index(trainer, 0) + max(world_size(), 1) * batch.group_ids.to(device)
            metric.update(entropy, batch.response_mask, batch.correct, index)
        else:  # no probe question on this rank: typed empty states, so the gather below matches the other ranks'
            empty = torch.zeros(0, 1, device=device)
            metric.update(empty, empty, torch.zeros(0, dtype=torch.bool, device=device),
                          torch.zeros(0, dtype=torch.long, device=device))
        rows = metric.per_question()  # every rank's paired questions (a collective)
        paired = paired_ratio_summary(rows["log_ratio"], self.num_resamples, self.confidence, self.seed)
        if trainer.is_global_zero:
            log_table(trainer.loggers, {"question": rows["question"].tolist(), "log_ratio": rows["log_ratio"].tolist(),
                                        "failed": rows["failed"].tolist(), "successful": rows["successful"].tolist()},
                      endpoint_ratios_artifact(ctx.step))
        probe_questions = min(self.probe_size, len(trainer.datamodule.source.held_out_problems()))
        values = {"endpoint_paired_ratio": paired["geometric_mean"], "endpoint_ci_low": paired["ci_low"],
                  "endpoint_ci_high": paired["ci_high"], "endpoint_paired_questions": paired["paired"],
                  "endpoint_coverage": paired["paired"] / max(probe_questions, 1),
                  "endpoint_failure_higher": paired["failure_higher"], "endpoint_sign_test_p": paired["sign_test_p"]}
        self.endpoint.append({"step": float(ctx.step), **values})
        for key, value in values.items():
            ctx.log(self.log_name(key), value)

    # -- plots -------------------------------------------------------------------------------------------------
    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.plots or not trainer.is_global_zero or not self.windows:
            return
        from lightning_rlvr.callbacks.entropy_change_probe import EntropyChangeProbe
        from lightning_rlvr.plots import entropy_by_stratum_figure, entropy_change_figure, paired_ratio_figure, save_figures

        column = {key: [w[key] for w in self.windows] for key in self.windows[0]}
        figures = {
            "rcea_entropy_by_stratum": entropy_by_stratum_figure(column["step"], column["failed_entropy"],
                                                                 column["successful_entropy"], column["ratio"]),
            "rcea_paired_ratio": paired_ratio_figure(column["step"], column["paired_ratio"], column["paired_ci_low"],
                                                     column["paired_ci_high"]),
        }
        probes = [cb for cb in trainer.callbacks if isinstance(cb, EntropyChangeProbe) and cb.trajectory]
        if probes:
            _, cov, flow, observed = zip(*probes[0].trajectory)
            figures["entropy_change_predicted_vs_observed"] = entropy_change_figure(cov, flow, observed)
        self.written = save_figures(trainer, figures, self.plot_dir)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"baseline_modes": self.baseline_modes, "baseline_effective_modes": self.baseline_effective_modes,
                "windows": [dict(w) for w in self.windows],
                "retention": [dict(r) for r in self.retention], "endpoint": [dict(e) for e in self.endpoint]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.baseline_modes = state_dict["baseline_modes"]
        self.baseline_effective_modes = state_dict.get("baseline_effective_modes")  # absent from older checkpoints
        self.windows = [dict(w) for w in state_dict["windows"]]
        self.retention = [dict(r) for r in state_dict["retention"]]
        self.endpoint = [dict(e) for e in state_dict.get("endpoint", [])]  # absent from older checkpoints
