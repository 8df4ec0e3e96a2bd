"""A short fit that checkpoints every 3 steps; ``python tests/resume_run.py DIR --kill-after 3`` SIGKILLs itself
right after the step-3 checkpoint (used by the exact-resume test; also importable)."""

from __future__ import annotations

import argparse
import os
import signal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
from lightning_rlvr.callbacks import SupervisedWarmStart, TopEntropyTokens


class _KillAfter(pl.Callback):
    """SIGKILL (no clean-up, like the OOM killer) at the start of the step after ``step`` was checkpointed."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def fit(model_dir: str, checkpoint_dir: str, max_steps: int = 6, ckpt_path: str | None = None, logger=None,
        kill_after: int | None = None, seed: int = 0) -> None:
    pl.seed_everything(seed, verbose=False)
    callbacks = [SupervisedWarmStart(steps=3), TopEntropyTokens(ratio=0.5),
                 ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=3, save_top_k=-1)]
    if kill_after is not None:
        callbacks.append(_KillAfter(kill_after))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=logger or False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, log_every_n_steps=1, callbacks=callbacks)
    data = RolloutDataModule(source=BuiltinTask("reverse", num_digits=3, warm_start_fraction=0.2), prompts_per_step=8,
                             group_size=4, max_new_tokens=4, val_samples=0)
    trainer.fit(RLVRModule(model=model_dir, learning_rate=1e-3), data, ckpt_path=ckpt_path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("checkpoint_dir")
    parser.add_argument("--kill-after", type=int, default=None)
    args = parser.parse_args()
    fit(args.model_dir, args.checkpoint_dir, kill_after=args.kill_after)
