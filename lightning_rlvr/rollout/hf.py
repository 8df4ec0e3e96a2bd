"""Hugging Face ``generate`` rollout engine, colocated with the policy (the CPU / small-model default)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_rlvr.distributed import world_size
from lightning_rlvr.rollout.base import GenerationOutput, RolloutEngine, SamplingConfig
from lightning_rlvr.sharding import is_sharded

__all__ = ["HFEngine"]


class HFEngine(RolloutEngine):
    """Generates with ``policy.generate`` on the live training module (no weight copy, so sync is free).

    The policy is put in eval mode while generating and restored afterwards. Prompts are repeated ``n``
    times (``num_return_sequences``), so rows come grouped by prompt. When the policy is sharded across ranks
    (FSDP2, DeepSpeed ZeRO-3) every forward gathers parameters from all ranks, so generation runs with
    ``synced_gpus=True``: a rank whose completions all ended keeps stepping until every rank is done.

    Args:
        use_cache: use the KV cache during generation.
    """

    def __init__(self, use_cache: bool = True) -> None:
        self.use_cache = use_cache
        self.policy: nn.Module | None = None
        self.version: int = -1

    def sync(self, policy: nn.Module, version: int) -> None:
        self.policy = policy
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> GenerationOutput:
        if self.policy is None:
            raise RuntimeError("HFEngine.generate called before sync(policy)")
        policy = self.policy
        config = policy.generation_config
        pad_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        device = next(policy.parameters()).device
        prompt_ids, prompt_mask = self.left_pad(prompts, pad_id, device)
        kwargs = dict(
            max_new_tokens=sampling.max_new_tokens,
            num_return_sequences=n,
            pad_token_id=pad_id,
            eos_token_id=config.eos_token_id,
            use_cache=self.use_cache,
            synced_gpus=world_size() > 1 and is_sharded(policy),
        )
        if sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        was_training = policy.training
        policy.eval()
        try:
            sequences = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kwargs)
        finally:
            policy.train(was_training)
        width = prompt_ids.shape[1]
        return GenerationOutput(
            prompt_ids=prompt_ids.repeat_interleave(n, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(n, dim=0),
            completion_ids=sequences[:, width:],
        )

