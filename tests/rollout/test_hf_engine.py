"""HFEngine: its decoding loop draws exactly what transformers' generate draws, and leaves the policy as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_rlvr.rollout.base import SamplingConfig
from lightning_rlvr.rollout.hf import HFEngine, takes_prepared_mask

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
        return engine._hf_generate(policy, ids, mask, sampling, config.pad_token_id, synced=False)[0]
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
    out = engine.generate(PROMPTS, 4, sampling)
    torch.manual_seed(123)
    theirs = reference_generate(policy, engine, 4, sampling)
    assert torch.equal(out.completion_ids, theirs)
    eos = policy.generation_config.eos_token_id
    for row, length, stopped in zip(theirs.tolist(), out.lengths.tolist(), out.stopped.tolist()):
        assert (length, stopped) == ((row.index(eos) + 1, True) if eos in row else (sampling.max_new_tokens, False))


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
    ended = [row for row in out.completion_ids.tolist() if eos in row]
    assert 0 < len(ended) < 15  # rows that ended and rows that ran to the limit: both cases are checked
    for row in ended:
        assert set(row[row.index(eos) + 1:]) <= {pad}
    assert out.stopped.tolist() == [eos in row for row in out.completion_ids.tolist()]


def test_the_prefill_encodes_each_prompt_once(tiny_model_dir):
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    shapes: list[tuple[int, int]] = []
    policy.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    engine = HFEngine()
    engine.sync(policy, 0)
    engine.generate(PROMPTS, 5, SamplingConfig(max_new_tokens=3, greedy=True))
    width = max(len(p) for p in PROMPTS)
    assert shapes[0] == (len(PROMPTS), width)  # then one token for each of the 15 rows per step
    assert shapes[1:] == [(len(PROMPTS) * 5, 1)] * (len(shapes) - 1) and len(shapes) > 1


def test_policy_mode_is_restored_and_no_gradient_is_recorded(policy):
    engine = HFEngine()
    engine.sync(policy, 0)
    engine.generate(PROMPTS, 2, SamplingConfig(max_new_tokens=4))
    assert policy.training and all(module.training for module in policy.modules())
    policy.eval()
    engine.generate(PROMPTS, 2, SamplingConfig(max_new_tokens=4))
    assert not any(module.training for module in policy.modules())
    policy.train()
    out = engine.generate(PROMPTS, 2, SamplingConfig(max_new_tokens=4, behaviour_stats=True))
    assert not out.completion_ids.requires_grad
    # Decoded under inference mode, handed out as plain tensors: the trainer may save them for backward.
    for tensor in (out.completion_ids, out.behaviour.logprobs, out.behaviour.entropy, out.behaviour.sbar):
        assert not tensor.is_inference()
    weights = torch.ones(out.completion_ids.shape, requires_grad=True)
    (weights * out.behaviour.logprobs).gather(1, out.completion_ids.clamp(max=1)).sum().backward()


def test_generating_before_sync_is_a_clear_error():
    with pytest.raises(RuntimeError, match="before sync"):
        HFEngine().generate(PROMPTS, 1, SamplingConfig())


@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_new_tokens=10, temperature=1.0, behaviour_stats=True),
    SamplingConfig(max_new_tokens=10, temperature=0.7, top_k=5, top_p=0.9, behaviour_stats=True),
], ids=["plain", "tau_top_k_top_p"])
@pytest.mark.parametrize("steps_per_call", [None, 1, 3], ids=["all_steps_at_once", "per_step", "three_at_a_time"])
def test_behaviour_stats_equal_a_full_forward_of_the_sampled_sequences(policy, sampling, steps_per_call, monkeypatch):
    """Log-prob, entropy and S̄ from the decoding loop against a fresh full-sequence forward and Categorical at τ,
    however many decoding steps go through the kernel at once (a large vocabulary gets one step per call)."""
    if steps_per_call is not None:
        step_bytes = 4 * len(PROMPTS) * 4 * policy.config.vocab_size  # 4 samples per prompt, float32
        monkeypatch.setattr("lightning_rlvr.rollout.hf.DEFAULT_CHUNK_BYTES", steps_per_call * step_bytes)
    engine = HFEngine()
    engine.sync(policy, 0)
    torch.manual_seed(3)
    out = engine.generate(PROMPTS, 4, sampling)
    assert out.behaviour is not None
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    eos = policy.generation_config.eos_token_id
    width = out.completion_ids.shape[1]
    # valid = up to and including the first EOS
    valid = (torch.cumsum((out.completion_ids == eos).long(), 1) - (out.completion_ids == eos).long()) == 0
    attention = torch.cat([out.prompt_mask, valid.long()], 1)
    positions = (attention.cumsum(-1) - 1).clamp_min(0)
    policy.eval()
    try:
        with torch.no_grad():
            logits = policy(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    finally:
        policy.train()
    dist = torch.distributions.Categorical(logits=logits[:, -(width + 1):-1].double() / sampling.temperature)
    logp = dist.log_prob(out.completion_ids)
    entropy = dist.entropy()
    p = dist.probs
    s = p * (p.log() + entropy[..., None])
    sbar = (p * s).sum(-1)
    for got, expected in ((out.behaviour.logprobs, logp), (out.behaviour.entropy, entropy),
                          (out.behaviour.sbar, sbar)):
        assert got.shape == out.completion_ids.shape
        torch.testing.assert_close(got[valid].double(), expected[valid], rtol=1e-4, atol=1e-5)


def test_behaviour_stats_only_when_asked_exact_and_sampled(policy):
    engine = HFEngine()
    engine.sync(policy, 0)
    asked = SamplingConfig(max_new_tokens=6, behaviour_stats=True)
    assert engine.generate(PROMPTS, 2, asked).behaviour is not None
    assert engine.generate(PROMPTS, 2, SamplingConfig(max_new_tokens=6)).behaviour is None  # not asked
    greedy = SamplingConfig(max_new_tokens=4, greedy=True, behaviour_stats=True)
    assert engine.generate(PROMPTS, 1, greedy).behaviour is None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 decode logits are not the trainer's float32 forward
        assert engine.generate(PROMPTS, 2, asked).behaviour is None
    off = HFEngine(behaviour_stats=False)
    off.sync(policy, 0)
    assert off.generate(PROMPTS, 2, asked).behaviour is None
    torch.manual_seed(0)
    with_stats = engine.generate(PROMPTS, 2, asked).completion_ids
    torch.manual_seed(0)
    assert torch.equal(off.generate(PROMPTS, 2, asked).completion_ids, with_stats)  # computing them draws nothing


def test_decoding_steps_take_a_prepared_mask_only_where_it_means_the_same(tiny_model_dir):
    """SDPA without a sliding window gets the padding mask as (B, 1, 1, L) booleans, so transformers builds none;
    eager attention (adds a float mask) and windowed attention keep the 2-D mask; both draw generate's tokens."""
    config = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config
    assert config._attn_implementation == "sdpa" and takes_prepared_mask(config)
    for changes in ({"_attn_implementation": "eager"}, {"sliding_window": 16}, {"attention_chunk_size": 8},
                    {"layer_types": ["full_attention", "sliding_attention"]}):
        changed = copy.deepcopy(config)
        for name, value in changes.items():
            setattr(changed, name, value)
        assert not takes_prepared_mask(changed), changes

    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0)
    for implementation in ("sdpa", "eager"):
        policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=implementation)
        mask_dims: list[int] = []
        policy.get_decoder().register_forward_pre_hook(
            lambda module, args, kwargs, dims=mask_dims: dims.append(kwargs["attention_mask"].dim()), with_kwargs=True)
        engine = HFEngine()
        engine.sync(policy, 0)
        torch.manual_seed(9)
        ours = engine.generate(PROMPTS, 4, sampling).completion_ids
        steps = len(mask_dims)
        torch.manual_seed(9)
        theirs = reference_generate(policy, engine, 4, sampling)
        assert torch.equal(ours, theirs), implementation
        assert steps == ours.shape[1]  # the prefill, then a forward per token after the first
        assert mask_dims[:steps] == [2] + [4 if implementation == "sdpa" else 2] * (steps - 1), implementation


def test_an_fsdp2_sharded_policy_decodes_the_same_tokens(policy, tmp_path):
    """FSDP2 gathers parameters inside the forward and tracks their version counters, which inference tensors
    lack: a sharded policy (here on a one-rank group, as a single-process FSDP run has) decodes under no_grad."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_rlvr.sharding import fsdp2_shard, is_sharded

    sampling = SamplingConfig(max_new_tokens=6, greedy=True)
    engine = HFEngine()
    engine.sync(policy, 0)
    expected = engine.generate(PROMPTS, 2, sampling).completion_ids
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        sharded = fsdp2_shard(copy.deepcopy(policy), init_device_mesh("cpu", (1,)))
        assert is_sharded(sharded)
        engine.sync(sharded, 1)
        got = engine.generate(PROMPTS, 2, sampling).completion_ids
    finally:
        dist.destroy_process_group()
    assert torch.equal(got, expected)


def test_a_copy_engine_generates_what_the_live_one_does_until_the_policy_changes(policy):
    policy = copy.deepcopy(policy)  # the fixture is shared: this test changes the weights
    live, own = HFEngine(), HFEngine(weights="copy")
    live.sync(policy, 0)
    own.sync(policy, 0)
    prompts, sampling = PROMPTS, SamplingConfig(max_new_tokens=5, behaviour_stats=True)
    torch.manual_seed(3)
    expected = live.generate(prompts, 4, sampling)
    torch.manual_seed(3)
    got = own.generate(prompts, 4, sampling)
    assert torch.equal(expected.completion_ids, got.completion_ids)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5)  # the live policy moves on; the copy keeps version 0 until the next sync
    own.generator = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    after = live.generate(prompts, 4, sampling)
    again = own.generate(prompts, 4, sampling)
    assert torch.equal(again.completion_ids, got.completion_ids)  # own generator seeded as the global one was
    assert not torch.allclose(after.behaviour.logprobs, again.behaviour.logprobs)
    own.sync(policy, 1)
    own.generator = None
    torch.manual_seed(3)
    synced = own.generate(prompts, 4, sampling)
    assert torch.equal(synced.completion_ids, after.completion_ids)


def test_the_engines_own_logprobs_are_its_decoding_stats_or_one_scoring_forward(policy):
    """SamplingConfig.logprobs: float32 from the decoding loop; for a bf16 policy (no exact stats) one forward of the
    engine's weights over the rollout, in their precision, at the sampling temperature."""
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.7, behaviour_stats=True, logprobs=True)
    for model in (policy, copy.deepcopy(policy).to(torch.bfloat16)):
        engine = HFEngine()
        engine.sync(model, 0)
        torch.manual_seed(11)
        out = engine.generate(PROMPTS, 4, sampling)
        sequences = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
        mask = torch.cat([out.prompt_mask, torch.ones_like(out.completion_ids)], dim=1)
        with torch.no_grad():
            logits = model.eval()(input_ids=sequences, attention_mask=mask,
                                  position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits.float()
        model.train()
        width = out.completion_ids.shape[1]
        scores = logits[:, -(width + 1) : -1] / 0.7
        reference = torch.distributions.Categorical(logits=scores).log_prob(out.completion_ids)
        valid = torch.arange(width) < out.lengths[:, None]
        if model is policy:
            assert out.behaviour is not None and torch.equal(out.logprobs, out.behaviour.logprobs)
            torch.testing.assert_close(out.logprobs[valid], reference[valid], atol=1e-5, rtol=0)
        else:
            assert out.behaviour is None  # bf16 logits: no exact decoding stats, so the engine scored the rollout
            torch.testing.assert_close(out.logprobs[valid], reference[valid], atol=1e-4, rtol=0)
    assert engine.generate(PROMPTS, 1, SamplingConfig(max_new_tokens=3, greedy=True, logprobs=True)).logprobs is None
