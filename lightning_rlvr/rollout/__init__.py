"""Rollout engines: Hugging Face ``generate`` (CPU / small models); vLLM comes as an extra."""

from lightning_rlvr.rollout.base import GenerationOutput, RolloutEngine, SamplingConfig
from lightning_rlvr.rollout.hf import HFEngine

__all__ = ["GenerationOutput", "HFEngine", "RolloutEngine", "SamplingConfig"]
