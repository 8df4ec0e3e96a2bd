"""Rollout engines: Hugging Face ``generate`` (CPU / small models; in the trainer's process or its own), colocated
vLLM (GPUs, extra ``[vllm]``) and a vLLM server (``vllm serve`` on other GPUs or machines).

The engines are imported on first use (PEP 562): ``ProcessEngine``'s decoding process imports only ``HFEngine``'s
module, not Lightning, which ``VLLMEngine``'s does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_rlvr.lazy import lazy_names
from lightning_rlvr.rollout.base import GenerationOutput, RolloutEngine, SamplingConfig
from lightning_rlvr.rollout.stops import end_of_completion, resolve_stop_token_ids

if TYPE_CHECKING:
    from lightning_rlvr.rollout.hf import HFEngine
    from lightning_rlvr.rollout.process import ProcessEngine
    from lightning_rlvr.rollout.server import VLLMServerEngine
    from lightning_rlvr.rollout.vllm import VLLMEngine

__all__ = ["GenerationOutput", "HFEngine", "ProcessEngine", "RolloutEngine", "SamplingConfig", "VLLMEngine",
           "VLLMServerEngine", "end_of_completion", "resolve_stop_token_ids"]

_HOMES = {"HFEngine": "lightning_rlvr.rollout.hf", "ProcessEngine": "lightning_rlvr.rollout.process",
          "VLLMServerEngine": "lightning_rlvr.rollout.server", "VLLMEngine": "lightning_rlvr.rollout.vllm"}


__getattr__, __dir__ = lazy_names(__name__, _HOMES, globals())
