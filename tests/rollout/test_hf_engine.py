"""HFEngine: its decoding loop draws exactly what transformers' generate draws, and leaves the policy as it was."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_rlvr.rollout.base import SamplingConfig
from lightning_rlvr.rollout.hf import HFEngine

PROMPTS = [[1, 6, 14, 9, 19], [1, 8, 19], [1, 5, 5, 14, 7, 19]]  # different lengths: left padding matters


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()


def reference_generate(policy, engine: HFEngine, n: int, sampling: SamplingConfig) -> torch.Tensor:
    """transformers' generate on the same left-padded prompts (the path multi-rank sharded policies take)."""
    config = policy.generation_config
    ids, mask = engine.left_pad(PROMPTS, config.pad_token_id, "cpu")
    ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    policy.eval()
    try:
        return engine._hf_generate(policy, ids, mask, sampling, config.pad_token_id, synced=False)
    finally:
        policy.train()


@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_new_tokens=12, greedy=True),
    SamplingConfig(max_new_tokens=12, temperature=1.0),
    SamplingConfig(max_new_tokens=12, temperature=0.7, top_k=5),
    SamplingConfig(max_new_tokens=12, temperature=1.3, top_p=0.8),
    SamplingConfig(max_new_tokens=12, temperature=0.9, top_k=8, top_p=0.9),
], ids=["greedy", "plain", "top_k", "top_p", "top_k_and_top_p"])
def test_decoding_loop_draws_the_same_tokens_as_transformers_generate(policy, sampling):
    engine = HFEngine()
    engine.sync(policy, 0)
    torch.manual_seed(123)
    ours = engine.generate(PROMPTS, 4, sampling).completion_ids
    torch.manual_seed(123)
    theirs = reference_generate(policy, engine, 4, sampling)
    assert torch.equal(ours, theirs)


def test_the_models_own_generation_settings_do_not_change_what_is_drawn(policy):
    """Only SamplingConfig counts: a checkpoint's repetition penalty or top-k would sample another distribution."""
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0)
    engine = HFEngine()
    engine.sync(policy, 0)
    torch.manual_seed(5)
    plain = engine.generate(PROMPTS, 4, sampling).completion_ids
    saved = policy.generation_config.to_dict()
    policy.generation_config.repetition_penalty, policy.generation_config.top_k = 1.8, 3
    try:
        torch.manual_seed(5)
        ours = engine.generate(PROMPTS, 4, sampling).completion_ids
        torch.manual_seed(5)
        theirs = reference_generate(policy, engine, 4, sampling)
    finally:
        policy.generation_config.repetition_penalty = saved.get("repetition_penalty", 1.0)
        policy.generation_config.top_k = saved.get("top_k", 50)
    assert torch.equal(ours, plain) and torch.equal(theirs, plain)


def test_rows_are_padded_after_eos_and_grouped_by_prompt(policy):
    engine = HFEngine()
    engine.sync(policy, 0)
    torch.manual_seed(0)
    out = engine.generate(PROMPTS, 5, SamplingConfig(max_new_tokens=16))
    eos, pad = policy.generation_config.eos_token_id, policy.generation_config.pad_token_id
    assert out.completion_ids.shape[0] == out.prompt_ids.shape[0] == 15
    assert torch.equal(out.prompt_ids[:5], out.prompt_ids[0].expand(5, -1))
    for row in out.completion_ids.tolist():
        if eos in row:
            assert set(row[row.index(eos) + 1:]) <= {pad}


def test_policy_mode_is_restored_and_no_gradient_is_recorded(policy):
    engine = HFEngine()
    engine.sync(policy, 0)
    engine.generate(PROMPTS, 2, SamplingConfig(max_new_tokens=4))
    assert policy.training and all(module.training for module in policy.modules())
    policy.eval()
    engine.generate(PROMPTS, 2, SamplingConfig(max_new_tokens=4))
    assert not any(module.training for module in policy.modules())
    policy.train()
    out = engine.generate(PROMPTS, 2, SamplingConfig(max_new_tokens=4))
    assert not out.completion_ids.requires_grad


def test_generating_before_sync_is_a_clear_error():
    with pytest.raises(RuntimeError, match="before sync"):
        HFEngine().generate(PROMPTS, 1, SamplingConfig())
