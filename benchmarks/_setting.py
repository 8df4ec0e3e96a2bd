"""The embedded task and the trainer every benchmark uses (imported by the scripts next to it)."""

from __future__ import annotations

import time

import lightning.pytorch as pl

from lightning_rlvr import BuiltinTask, RolloutDataModule
from lightning_rlvr.loggers import InMemoryLogger


def addition_data(warm_start_fraction: float = 0.05) -> RolloutDataModule:
    """`a+b=` with a, b in 0..49, 15% held out, 16 prompts x 8 completions, pass@8 on the held-out problems."""
    return RolloutDataModule(
        source=BuiltinTask("addition", max_operand=49, held_out_fraction=0.15, warm_start_fraction=warm_start_fraction),
        prompts_per_step=16, group_size=8, max_new_tokens=4, val_samples=8, val_k=8,
    )


def quiet_trainer(max_steps: int, rollout_steps: int, logger: InMemoryLogger, callbacks: list) -> pl.Trainer:
    """CPU, every step logged, one validation at the end (after ``rollout_steps``), no checkpoints or bars."""
    return pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=logger, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        check_val_every_n_epoch=None, val_check_interval=rollout_steps, num_sanity_val_steps=0, callbacks=callbacks,
    )


class StepClock(pl.Callback):
    """The wall-clock time at the end of every training step, for a benchmark worker's steps per second."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, *args, **kwargs) -> None:
        self.stamps.append(time.perf_counter())

    def steps_per_s(self, warmup: int) -> float:
        """Steps per second over the steps after the first ``warmup``."""
        timed = self.stamps[warmup:]
        return (len(timed) - 1) / (timed[-1] - timed[0])
