"""Rollout engines: Hugging Face ``generate`` (CPU / small models; in the trainer's process or its own) and colocated
vLLM (GPUs, extra ``[vllm]``)."""

from lightning_rlvr.rollout.base import GenerationOutput, RolloutEngine, SamplingConfig
from lightning_rlvr.rollout.hf import HFEngine
from lightning_rlvr.rollout.process import ProcessEngine
from lightning_rlvr.rollout.stops import end_of_completion, resolve_stop_token_ids
from lightning_rlvr.rollout.vllm import VLLMEngine

__all__ = ["GenerationOutput", "HFEngine", "ProcessEngine", "RolloutEngine", "SamplingConfig", "VLLMEngine",
           "end_of_completion", "resolve_stop_token_ids"]
