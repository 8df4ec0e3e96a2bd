"""lightning_rlvr: reinforcement learning with verifiable rewards on PyTorch Lightning, built around entropy control."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_rlvr.lazy import lazy_names

if TYPE_CHECKING:
    from lightning_rlvr.data import BuiltinTask, FileSource, RolloutBatch, RolloutDataModule
    from lightning_rlvr.lora import LoRA
    from lightning_rlvr.module import RLVRModule

__version__ = "0.1.0"
__all__ = ["BuiltinTask", "FileSource", "LoRA", "RLVRModule", "RolloutBatch", "RolloutDataModule", "__version__"]

# Imported on first use (PEP 562): the trainer pulls in Lightning and transformers (~5 s), which a process that
# only needs the kernels (``lightning_rlvr.ops``), a verifier or the task data should not pay for.
_HOMES = {"BuiltinTask": "lightning_rlvr.data", "FileSource": "lightning_rlvr.data",
          "RolloutBatch": "lightning_rlvr.data", "RolloutDataModule": "lightning_rlvr.data",
          "RLVRModule": "lightning_rlvr.module", "LoRA": "lightning_rlvr.lora"}

__getattr__, __dir__ = lazy_names(__name__, _HOMES, globals())
