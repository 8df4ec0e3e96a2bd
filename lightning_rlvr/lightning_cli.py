"""The LightningCLI behind ``lightning_rlvr fit | validate | test | predict``: :class:`RLVRModule` and
:class:`RolloutDataModule` with RL defaults (:mod:`lightning_rlvr.cli` has the command's usage)."""

from __future__ import annotations

import os

from lightning.pytorch.cli import ArgsType, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger

import lightning_rlvr.callbacks  # noqa: F401  (short class names in YAML)
import lightning_rlvr.data  # noqa: F401
import lightning_rlvr.rollout.process  # noqa: F401  (every engine, for their short names)
import lightning_rlvr.rollout.server  # noqa: F401
import lightning_rlvr.rollout.vllm  # noqa: F401
import lightning_rlvr.verifiers  # noqa: F401
from lightning_rlvr.data.datamodule import RolloutDataModule
from lightning_rlvr.module import RLVRModule

__all__ = ["MLflowSaveConfigCallback", "RLVRCLI", "build_cli"]

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


class MLflowSaveConfigCallback(SaveConfigCallback):
    """Logs the resolved config to the MLflow run (``config.yaml``) and, without MLflow, to the log dir.

    Lightning's default ``SaveConfigCallback`` needs ``trainer.log_dir``, which is ``None`` for a non-file
    MLflow URI (Lightning #19441), so the file write is skipped there.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{**kwargs, "save_to_log_dir": False, "overwrite": True})

    def save_config(self, trainer, pl_module, stage: str) -> None:
        text = self.parser.dump(self.config, skip_none=False)
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                logger.experiment.log_text(logger.run_id, text, "config.yaml")
                return
        if trainer.log_dir is not None:
            os.makedirs(trainer.log_dir, exist_ok=True)
            with open(os.path.join(trainer.log_dir, "config.yaml"), "w", encoding="utf-8") as handle:
                handle.write(text)


class RLVRCLI(LightningCLI):
    """LightningCLI with RL defaults (see module docstring)."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults({
            "trainer.log_every_n_steps": 1,
            "trainer.logger": {
                "class_path": "lightning.pytorch.loggers.MLFlowLogger",
                "init_args": {
                    "experiment_name": "lightning_rlvr",
                    "tracking_uri": os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI),
                },
            },
        })


def build_cli(args: ArgsType = None, run: bool = True) -> RLVRCLI:
    """Parse ``args`` (default: ``sys.argv``), build module, DataModule and Trainer, and run the subcommand."""
    return RLVRCLI(
        RLVRModule,
        RolloutDataModule,
        save_config_callback=MLflowSaveConfigCallback,
        auto_configure_optimizers=False,
        seed_everything_default=0,
        args=args,
        run=run,
    )
