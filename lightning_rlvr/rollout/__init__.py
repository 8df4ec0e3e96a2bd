"""Rollout engines: Hugging Face ``generate`` (CPU / small models; in the trainer's process or its own), colocated
vLLM (GPUs, extra ``[vllm]``) and a vLLM server (``vllm serve`` on other GPUs or machines)."""

from lightning_rlvr.rollout.base import GenerationOutput, RolloutEngine, SamplingConfig
from lightning_rlvr.rollout.hf import HFEngine
from lightning_rlvr.rollout.process import ProcessEngine
from lightning_rlvr.rollout.server import VLLMServerEngine
from lightning_rlvr.rollout.stops import end_of_completion, resolve_stop_token_ids
from lightning_rlvr.rollout.vllm import VLLMEngine

__all__ = ["GenerationOutput", "HFEngine", "ProcessEngine", "RolloutEngine", "SamplingConfig", "VLLMEngine",
           "VLLMServerEngine", "end_of_completion", "resolve_stop_token_ids"]
