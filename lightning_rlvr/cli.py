"""The ``lightning_rlvr`` command line: a LightningCLI over :class:`RLVRModule` and :class:`RolloutDataModule`.

Usage::

    lightning_rlvr fit --config configs/quickstart.yaml
    lightning_rlvr fit --config configs/quickstart.yaml --trainer.max_steps 100 --model.learning_rate 1e-4
    lightning_rlvr fit --config configs/quickstart.yaml --print_config
    lightning_rlvr validate --config configs/quickstart.yaml --ckpt_path path/to/last.ckpt
    lightning_rlvr export --ckpt_path path/to/last.ckpt --output exported/ [--merged]
    lightning_rlvr prepare-model smollm2-135m-instruct

Every constructor argument of the module, the DataModule and the Trainer is a config key; an unknown key
fails with its name. Defaults set here: ``log_every_n_steps=1`` (RL curves are per step) and an MLflow
logger on ``sqlite:///mlflow.db`` (MLflow ≥ 3.13 refuses the file store that Lightning's logger would
otherwise fall back to). The resolved config is logged to the MLflow run as ``config.yaml``.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import ArgsType, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger

import lightning_rlvr.callbacks  # noqa: F401  (short class names in YAML)
import lightning_rlvr.data  # noqa: F401
import lightning_rlvr.verifiers  # noqa: F401
from lightning_rlvr.data.datamodule import RolloutDataModule
from lightning_rlvr.module import RLVRModule

__all__ = ["MLflowSaveConfigCallback", "RLVRCLI", "build_cli", "main"]

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


def main(args: ArgsType = None) -> None:
    """Entry point of the ``lightning_rlvr`` console script (``args`` for tests and notebooks).

    ``lightning_rlvr export --ckpt_path ... --output ...`` writes a checkpoint's policy as a PEFT adapter or a plain
    model (:mod:`lightning_rlvr.export`); ``lightning_rlvr prepare-model NAME`` builds the cache of
    ``builtin:NAME`` (:mod:`lightning_rlvr.models.smollm2`); every other subcommand is Lightning's. Returns ``None`` on
    purpose: a console script passes the return value to ``sys.exit``.
    """
    arguments = list(sys.argv[1:] if args is None else args)
    if arguments[:1] == ["export"]:
        from lightning_rlvr.export import main as export

        export(arguments[1:])
        return
    if arguments[:1] == ["prepare-model"]:
        from lightning_rlvr.models.smollm2 import main as prepare_model

        prepare_model(arguments[1:])
        return
    build_cli(args)


if __name__ == "__main__":  # pragma: no cover
    main()
