"""ProcessEngine: HFEngine in a process of its own, fed the weights by version over a gloo group, in buckets."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from lightning_rlvr.rollout import HFEngine, ProcessEngine, SamplingConfig
from lightning_rlvr.rollout.process import WeightSlot, weight_layout

PROMPTS = [[1, 6, 14, 9, 19], [1, 8, 19], [1, 5, 5, 14, 7, 19]]
SAMPLING = SamplingConfig(max_new_tokens=6, temperature=1.0, behaviour_stats=True)


@pytest.fixture
def policy(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def engine():
    # 16 KiB buckets: the tiny model's ~300 KiB of weights travel in many broadcasts, and its embedding alone
    # (and the tied head, once) is larger than a bucket
    engine = ProcessEngine(device="cpu", threads=1, bucket_mb=1 / 64)
    yield engine
    engine.close()


def sampled_logprobs(policy: nn.Module, out, temperature: float = 1.0) -> torch.Tensor:
    """log π(token) at ``temperature`` of every generated token under ``policy``, from one full-sequence forward and
    ``torch.distributions`` (the engine's own numbers come from its cached one-token decoding steps)."""
    sequences = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
    mask = torch.cat([out.prompt_mask, torch.ones_like(out.completion_ids)], dim=1)
    with torch.no_grad():
        logits = policy(input_ids=sequences, attention_mask=mask,
                        position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits.float()
    width = out.completion_ids.shape[1]
    return torch.distributions.Categorical(logits=logits[:, -(width + 1) : -1] / temperature).log_prob(
        out.completion_ids)


def valid(out) -> torch.Tensor:
    return torch.arange(out.completion_ids.shape[1]) < out.lengths[:, None]


def test_weight_layout_packs_each_tensor_once_at_aligned_offsets():
    module = nn.Module()
    module.embed = nn.Embedding(10, 4)                      # 160 bytes
    module.head = nn.Linear(4, 10, bias=True)               # weight tied to the embedding below, bias 40 bytes
    module.head.weight = module.embed.weight
    module.register_buffer("scale", torch.ones(3, dtype=torch.bfloat16))          # 6 bytes
    module.register_buffer("flags", torch.ones(5, dtype=torch.bool), persistent=False)  # 5 bytes, not in state_dict
    module.tail = nn.Module()
    module.tail.big = nn.Parameter(torch.zeros(70))         # 280 bytes: more than a bucket
    slots, sizes = weight_layout(module, bucket_bytes=256)
    # parameters first (the tied weight once, under its first name), then the buffers; a bucket holds slots at
    # multiples of 64 bytes until the next one would overflow 256; the 280-byte tensor gets a bucket of its own
    assert slots == [
        WeightSlot("embed.weight", (10, 4), torch.float32, 0, 0, 160),
        WeightSlot("head.bias", (10,), torch.float32, 0, 192, 40),
        WeightSlot("tail.big", (70,), torch.float32, 1, 0, 280),
        WeightSlot("scale", (3,), torch.bfloat16, 2, 0, 6),
        WeightSlot("flags", (5,), torch.bool, 2, 64, 5),
    ]
    assert sizes == [232, 280, 69]


def test_generates_what_an_in_process_copy_generates_with_the_synced_weights(engine, policy):
    engine.sync(policy, 0)
    engine.generator = torch.Generator().manual_seed(7)
    got = engine.generate(PROMPTS, 4, SAMPLING)
    engine.generator = None
    # the process seeds its sampler with the first draw of the engine's generator (the class docstring)
    seed = int(torch.randint(2**62, (1,), generator=torch.Generator().manual_seed(7)))
    local = HFEngine(weights="copy")
    local.sync(policy, 0)
    local.generator = torch.Generator().manual_seed(seed)
    expected = local.generate(PROMPTS, 4, SAMPLING)
    assert torch.equal(got.completion_ids, expected.completion_ids)
    assert torch.equal(got.lengths, expected.lengths) and torch.equal(got.stopped, expected.stopped)
    mask = valid(got)
    torch.testing.assert_close(got.behaviour.logprobs[mask], sampled_logprobs(policy, got)[mask], atol=1e-5, rtol=0)


def test_keeps_a_version_until_the_next_sync(engine, policy):
    engine.sync(policy, 3)
    before = copy.deepcopy(policy)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    stale = engine.generate(PROMPTS, 4, SAMPLING)  # the trainer moved on; the process still holds version 3
    mask = valid(stale)
    torch.testing.assert_close(stale.behaviour.logprobs[mask], sampled_logprobs(before, stale)[mask], atol=1e-5, rtol=0)
    assert not torch.allclose(stale.behaviour.logprobs[mask], sampled_logprobs(policy, stale)[mask], atol=1e-3)
    engine.sync(policy, 4)
    fresh = engine.generate(PROMPTS, 4, SAMPLING)
    mask = valid(fresh)
    torch.testing.assert_close(fresh.behaviour.logprobs[mask], sampled_logprobs(policy, fresh)[mask], atol=1e-5, rtol=0)
    assert engine.version == 4


def test_bf16_weights_travel_as_their_bytes(policy):
    policy = policy.to(torch.bfloat16)
    engine = ProcessEngine(device="cpu", threads=1, bucket_mb=1 / 64)
    try:
        engine.sync(policy, 0)
        greedy = SamplingConfig(max_new_tokens=12, greedy=True)
        got = engine.generate(PROMPTS, 1, greedy)
    finally:
        engine.close()
    local = HFEngine()
    local.sync(policy, 0)
    assert torch.equal(got.completion_ids, local.generate(PROMPTS, 1, greedy).completion_ids)
    assert got.behaviour is None  # behaviour stats are float32-only (HFEngine)


def test_a_failure_in_the_process_is_raised_with_its_traceback_and_the_engine_serves_on(engine, policy):
    engine.sync(policy, 5)
    vocabulary = policy.config.vocab_size
    with pytest.raises(RuntimeError, match=r"(?s)engine process failed \('output'\).*IndexError"):
        engine.generate([[1, vocabulary + 3]], 2, SAMPLING)
    assert engine.generate(PROMPTS, 2, SAMPLING).completion_ids.shape[0] == 6
    with pytest.raises(ValueError, match="changed since the engine process started"):
        engine.sync(nn.Linear(2, 2), 6)


def test_a_dead_process_is_named_not_waited_for(policy):
    engine = ProcessEngine(device="cpu", threads=1)
    try:
        engine.sync(policy, 0)
        engine._process.kill()
        with pytest.raises(RuntimeError, match="exited with code"):
            engine.generate(PROMPTS, 2, SAMPLING)
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="before sync"):
        engine.generate(PROMPTS, 2, SAMPLING)


def test_what_cannot_be_sent_is_refused_before_a_process_runs(policy):
    policy.not_picklable = lambda: None
    engine = ProcessEngine(device="cpu")
    with pytest.raises(ValueError, match="does not pickle"):
        engine.sync(policy, 0)
    assert engine._process is None
    with pytest.raises(ValueError, match="threads must be >= 1"):
        ProcessEngine(threads=0)
    with pytest.raises(ValueError, match="bucket_mb"):
        ProcessEngine(bucket_mb=0)


def test_a_lora_policy_generates_in_the_process_with_its_adapter(policy):
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(policy, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in lora.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)  # an adapter that changes what is drawn (B starts at zero)
    engine = ProcessEngine(device="cpu", threads=1)
    try:
        engine.sync(lora, 0)
        got = engine.generate(PROMPTS, 2, SAMPLING)
    finally:
        engine.close()
    mask = valid(got)
    with_adapter = sampled_logprobs(lora, got)[mask]
    torch.testing.assert_close(got.behaviour.logprobs[mask], with_adapter, atol=1e-5, rtol=0)
    with lora.disable_adapter():
        assert not torch.allclose(got.behaviour.logprobs[mask], sampled_logprobs(lora, got)[mask], atol=1e-3)


def test_the_weights_backend_is_nccl_only_between_two_gpus(monkeypatch):
    from lightning_rlvr.rollout.process import weights_backend

    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)  # as on a CUDA build
    assert weights_backend("auto", gpu0, gpu1) == "nccl"
    assert weights_backend("nccl", gpu0, gpu1) == "nccl"
    assert weights_backend("auto", gpu0, gpu0) == "gloo"  # NCCL cannot put both ranks on one device
    assert weights_backend("auto", gpu0, cpu) == "gloo"
    assert weights_backend("gloo", gpu0, gpu1) == "gloo"
    with pytest.raises(ValueError, match="two different CUDA devices"):
        weights_backend("nccl", gpu0, gpu0)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)  # a CPU build of torch
    assert weights_backend("auto", gpu0, gpu1) == "gloo"
    with pytest.raises(ValueError, match="a torch with NCCL"):
        weights_backend("nccl", gpu0, gpu1)
    with pytest.raises(ValueError, match="backend must be"):
        ProcessEngine(backend="mpi")
    with pytest.raises(ValueError, match="policy is on cpu, the engine on cpu"):
        ProcessEngine(device="cpu", backend="nccl").sync(nn.Linear(2, 2), 0)
