"""What one rollout step measured: the sums an update accumulates, the step's metrics, and sending them to loggers.

Loss terms and clip fractions are accumulated as each rank's share of a global sum (their normaliser is the
minibatch's on all ranks), so the per-step metric multiplies by the world size and divides by the updates applied;
logging then averages over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_rlvr.data.batch import RolloutBatch
from lightning_rlvr.loggers import completions_artifact, completions_table, log_table

__all__ = ["UpdateStats", "local_masked_mean", "log_metrics", "log_step"]


def local_masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over ``mask`` on this rank only (0 when the mask is empty); ``callbacks.base.masked_mean``
    is the all-ranks one."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


@dataclass
class UpdateStats:
    """Sums over a step's micro-batches and updates (each micro-batch's share of its minibatch's global value).

    The optional sums stay ``None`` (and their metric unlogged) until something adds to them: ``engine_kl`` when the
    engine returned log-probs, ``tis_clip`` / ``mis_mask`` with an importance-sampling correction, ``extra`` with
    interventions.
    """

    pg: float = 0.0
    total: float = 0.0
    kl: float = 0.0
    clipped_high: float = 0.0
    clipped_low: float = 0.0
    dual_clipped: float = 0.0
    ppo_kl: float = 0.0
    grad_norm: float = 0.0
    engine_kl: float | None = None
    tis_clip: float | None = None
    mis_mask: float | None = None
    extra: float | None = None
    applied: int = 0
    skipped: int = 0

    @staticmethod
    def _plus(total: float | None, value: float) -> float:
        return (0.0 if total is None else total) + value

    def add_engine_kl(self, engine_kl: float) -> None:
        """The engine mismatch of one micro-batch."""
        self.engine_kl = self._plus(self.engine_kl, engine_kl)

    def add_engine_correction(self, affected: float, mode_truncates: bool) -> None:
        """The share of one micro-batch's tokens that the engine correction capped or dropped."""
        if mode_truncates:
            self.tis_clip = self._plus(self.tis_clip, affected)
        else:
            self.mis_mask = self._plus(self.mis_mask, affected)

    def add_extra(self, extra: Tensor) -> None:
        self.extra = self._plus(self.extra, extra.item())

    @torch.no_grad()
    def add_micro_batch(self, out: Any, n_tokens: Tensor) -> None:
        """One micro-batch's losses, clip fractions and PPO KL (``out``: its
        :class:`~lightning_rlvr.training.update.MicroBatchLoss`), each as its share of the minibatch's ``n_tokens``
        valid tokens on all ranks."""
        self.pg += out.pg_loss.item()
        self.total += out.loss.item()
        if out.kl_loss is not None:
            self.kl += out.kl_loss.item()
        denom = n_tokens.clamp_min(1)
        mask, policy_loss = out.mask, out.policy_loss
        self.clipped_high += ((policy_loss.clipped_high * mask).sum() / denom).item()
        self.clipped_low += ((policy_loss.clipped_low * mask).sum() / denom).item()
        self.dual_clipped += ((policy_loss.dual_clipped * mask).sum() / denom).item()
        self.ppo_kl += (((out.old_logprobs - out.logprobs.detach()) * mask).sum() / denom).item()

    def metrics(self, rollout: RolloutBatch, entropy: Tensor, world_size: int, with_kl: bool,
                n_updates: int) -> dict[str, float]:
        """The step's metrics: the rollout's, entropy by outcome, and the update's means per applied update."""
        mask = rollout.response_mask
        success = rollout.correct.unsqueeze(-1).to(mask.dtype) * mask
        failure = mask - success
        metrics = dict(rollout.stats)
        parts = max(self.applied, 1)
        shares = world_size / parts
        metrics.update({
            "entropy/token_mean": local_masked_mean(entropy, mask).item(),
            "entropy/successful": local_masked_mean(entropy, success).item() if success.sum() > 0 else float("nan"),
            "entropy/failed": local_masked_mean(entropy, failure).item() if failure.sum() > 0 else float("nan"),
            "loss/pg": self.pg * shares,
            "loss/total": self.total * shares,
            "policy/clipfrac_high": self.clipped_high * shares,
            "policy/clipfrac_low": self.clipped_low * shares,
            "policy/dual_clipfrac": self.dual_clipped * shares,
            "policy/ppo_kl": self.ppo_kl * shares,
            "policy/grad_norm": self.grad_norm / parts,
            "policy/skipped_updates": float(self.skipped),
            "policy/updates": float(n_updates),
        })
        if with_kl:
            metrics["loss/kl"] = self.kl * shares
        optional = {"rollout/engine_kl": self.engine_kl, "policy/mis_maskfrac": self.mis_mask,
                    "policy/tis_clipfrac": self.tis_clip, "loss/interventions": self.extra}
        metrics.update({name: value * shares for name, value in optional.items() if value is not None})
        return metrics


def log_metrics(trainer, metrics: dict[str, float], device: torch.device) -> None:
    """Send one rollout step's scalars straight to the loggers, averaged over ranks.

    Lightning's ``self.log`` keeps a result collection per key that it moves and reduces every step; with ~30 keys
    that cost ~20 ms per step on the tiny model, more than the update itself. Here the values go in one all-reduce
    (every rank must call this) and one ``log_metrics`` call per logger, at the logger step Lightning uses (rollout
    batches), every ``log_every_n_steps``.
    """
    step = trainer.fit_loop.epoch_loop._batches_that_stepped
    if step % max(trainer.log_every_n_steps, 1) or not trainer.loggers:
        return
    if trainer.world_size > 1:
        keys = sorted(metrics)
        values = trainer.strategy.reduce(torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device),
                                         reduce_op="mean")
        metrics = dict(zip(keys, values.tolist()))
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def log_step(module: Any, step: Any, stats: UpdateStats, policy_lag: int, train_s: float) -> None:
    """A rollout step's metrics to the loggers, its completions table every ``log_completions_every_n_steps``, and
    the progress bar's two numbers (``step``: the :class:`~lightning_rlvr.training.update.RolloutStep`)."""
    hp, trainer, entropy = module.hparams, module.trainer, step.seen.entropy
    metrics = stats.metrics(step.rollout, entropy, trainer.world_size, hp.kl_coef > 0, step.n_updates)
    metrics.update({"policy/lr": module.optimizers().param_groups[0]["lr"],
                    "policy/version": float(module.policy_version)})
    metrics.update(step.ctx.metrics.means())
    metrics["rollout/policy_lag"] = float(policy_lag)
    metrics["perf/train_s"] = train_s
    log_metrics(trainer, metrics, module.device)
    every = hp.log_completions_every_n_steps
    if every and step.ctx.step % every == 0 and trainer.is_global_zero and trainer.loggers:
        table = completions_table(step.rollout, entropy, module.tokenizer, step.ctx.step, hp.log_completions_max_rows)
        log_table(trainer.loggers, table, completions_artifact(step.ctx.step))
    # self.log costs ~1 ms a step (tiny model: 4%): only for a progress bar or a callback that monitors a key
    if trainer.progress_bar_callback is not None or any(getattr(cb, "monitor", None) for cb in trainer.callbacks):
        module.log_dict({"reward": metrics["reward/mean"], "entropy": metrics["entropy/token_mean"]},
                        on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=len(step.rollout))
