"""Rollout engines: Hugging Face ``generate`` (CPU / small models) and colocated vLLM (GPUs, extra ``[vllm]``)."""

from lightning_rlvr.rollout.base import GenerationOutput, RolloutEngine, SamplingConfig
from lightning_rlvr.rollout.hf import HFEngine
from lightning_rlvr.rollout.vllm import VLLMEngine

__all__ = ["GenerationOutput", "HFEngine", "RolloutEngine", "SamplingConfig", "VLLMEngine"]
