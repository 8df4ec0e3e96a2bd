"""lightning_rlvr: reinforcement learning with verifiable rewards on PyTorch Lightning, built around entropy control."""

from lightning_rlvr.data import BuiltinTask, FileSource, RolloutBatch, RolloutDataModule
from lightning_rlvr.module import RLVRModule

__version__ = "0.1.0"
__all__ = ["BuiltinTask", "FileSource", "RLVRModule", "RolloutBatch", "RolloutDataModule", "__version__"]
