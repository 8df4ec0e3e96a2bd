"""Prompt sources, the scored rollout batch and the RolloutDataModule."""

from lightning_rlvr.data.batch import RolloutBatch
from lightning_rlvr.data.datamodule import RolloutDataModule
from lightning_rlvr.data.reasoning_gym import ReasoningGymSource, ReasoningGymVerifier
from lightning_rlvr.data.sources import BuiltinTask, FileSource, PromptSource, load_problems

__all__ = ["BuiltinTask", "FileSource", "PromptSource", "ReasoningGymSource", "ReasoningGymVerifier", "RolloutBatch",
           "RolloutDataModule", "load_problems"]
