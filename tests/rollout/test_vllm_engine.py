"""VLLMEngine against the vLLM stand-in (tests/fake_vllm.py: vLLM's argument checks and stop rules, generating with
a real copy of the pushed weights; vLLM itself needs CUDA, scripts/gpu_smoke_vllm.py runs it).

The stand-in records every call in order and keeps what it generated last, so what the engine returns can be
checked against what "vLLM" produced.
"""

from __future__ import annotations

import types

import pytest
import torch
from fake_vllm import FakeLLM, fake_sampling_params
from transformers import AutoModelForCausalLM

from lightning_rlvr.rollout.base import SamplingConfig
from lightning_rlvr.rollout.vllm import VLLMEngine, _vllm_llm


def make_engine(**kwargs) -> VLLMEngine:
    return VLLMEngine(llm_factory=FakeLLM, sampling_params_factory=fake_sampling_params, **kwargs)


@pytest.fixture
def policy(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def names(calls, kind):
    return [c for c in calls if c[0] == kind]


def test_weights_are_pushed_only_when_the_policy_changed(policy):
    engine = make_engine()
    engine.sync(policy, 0)
    assert len(names(engine.llm.calls, "load_weights")) == 1
    engine.sync(policy, 0)  # same version: nothing to push
    assert len(names(engine.llm.calls, "load_weights")) == 1
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.5)
    engine.sync(policy, 1)
    assert len(names(engine.llm.calls, "load_weights")) == 2
    for name, parameter in policy.named_parameters():  # vLLM now holds the updated weights
        torch.testing.assert_close(engine.llm.weights[name], parameter.detach(), rtol=0, atol=0)


def test_every_parameter_is_pushed_once_under_its_hugging_face_name(policy):
    engine = make_engine()
    engine.sync(policy, 0)
    pushed = [name for call in names(engine.llm.calls, "load_weights") for name in call[1]]
    assert sorted(pushed) == sorted(name for name, _ in policy.named_parameters())
    assert len(pushed) == len(set(pushed))
    assert all(name.startswith(("model.", "lm_head.")) for name in pushed)


def test_compiled_module_names_are_mapped_back(policy):
    wrapper = torch.nn.Module()
    wrapper._orig_mod = policy  # what torch.compile's OptimizedModule holds
    wrapper.config, wrapper.generation_config = policy.config, policy.generation_config
    engine = make_engine()
    engine.sync(wrapper, 0)
    pushed = {name for call in names(engine.llm.calls, "load_weights") for name in call[1]}
    assert pushed == {name for name, _ in policy.named_parameters()}


def test_the_prefix_cache_is_reset_after_every_weight_push(policy):
    engine = make_engine()
    engine.sync(policy, 0)
    engine.sync(policy, 1)
    kinds = [c[0] for c in engine.llm.calls]
    assert kinds == ["load_weights", "reset_prefix_cache", "load_weights", "reset_prefix_cache"]


def test_sleep_and_wake_order_around_updates_and_generations(policy):
    engine = make_engine(enable_sleep_mode=True, sleep_level=1)
    sampling = SamplingConfig(max_new_tokens=4)
    engine.sync(policy, 0)
    engine.generate([[1, 5]], 2, sampling)
    engine.sync(policy, 1)  # after an update: weights first, then the KV cache for generating
    engine.generate([[1, 5]], 2, sampling)
    engine.generate([[1, 6]], 1, sampling)  # validation right after: same weights, everything woken
    assert [c for c in engine.llm.calls if c[0] != "load_weights"] == [
        ("reset_prefix_cache",), ("generate", 1), ("sleep", 1),
        ("wake_up", ("weights",)), ("reset_prefix_cache",), ("wake_up", ("kv_cache",)), ("generate", 1), ("sleep", 1),
        ("wake_up", ("weights",)), ("wake_up", ("kv_cache",)), ("generate", 1), ("sleep", 1),
    ]
    assert len(names(engine.llm.calls, "load_weights")) == 2


def test_sleep_level_2_pushes_the_weights_again_on_waking(policy):
    engine = make_engine(enable_sleep_mode=True, sleep_level=2)
    sampling = SamplingConfig(max_new_tokens=4)
    engine.sync(policy, 0)
    engine.generate([[1, 5]], 1, sampling)
    engine.generate([[1, 5]], 1, sampling)  # level 2 dropped the weights: pushed again before generating
    kinds = [c[0] for c in engine.llm.calls]
    assert kinds == ["load_weights", "reset_prefix_cache", "generate", "sleep",
                     "wake_up", "load_weights", "reset_prefix_cache", "wake_up", "generate", "sleep"]


def test_completions_and_vllm_logprobs_are_passed_through(policy):
    engine = make_engine()
    engine.sync(policy, 0)
    prompts = [[1, 5, 6], [1, 7]]
    out = engine.generate(prompts, 3, SamplingConfig(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=0,
                                                     stop_token_ids=(2,)))
    pad = policy.generation_config.pad_token_id
    rows = [c for o in engine.llm.last_outputs for c in o.outputs]
    assert out.completion_ids.shape == (6, max(len(c.token_ids) for c in rows))
    for i, completion in enumerate(rows):
        length = len(completion.token_ids)
        assert out.completion_ids[i, :length].tolist() == completion.token_ids
        assert set(out.completion_ids[i, length:].tolist()) <= {pad}
        assert (out.lengths[i], out.stopped[i]) == (length, completion.finish_reason == "stop")
        values = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        torch.testing.assert_close(out.logprobs[i, :length], torch.tensor(values))
        assert out.logprobs[i, length:].abs().sum() == 0
    assert out.prompt_ids[:3].tolist() == [[1, 5, 6]] * 3 and out.prompt_ids[3].tolist() == [pad, 1, 7]
    params = engine.llm.params
    assert (params.n, params.max_tokens, params.logprobs, params.temperature, params.top_p, params.top_k,
            params.stop_token_ids) == (3, 4, 0, 0.7, 0.9, -1, [2])  # top_k 0 (off) is vLLM's -1
    engine.generate(prompts, 1, SamplingConfig(max_new_tokens=4, greedy=True))
    assert engine.llm.params.temperature == 0.0


def test_the_llm_starts_from_the_policys_checkpoint_with_the_configured_settings(policy, tiny_model_dir):
    engine = make_engine(gpu_memory_utilization=0.4, enable_sleep_mode=True, max_model_len=64, seed=3)
    engine.sync(policy, 0)
    kwargs = engine.llm.kwargs
    assert kwargs["model"] == tiny_model_dir
    assert (kwargs["gpu_memory_utilization"], kwargs["enable_sleep_mode"], kwargs["max_model_len"], kwargs["seed"],
            kwargs["tensor_parallel_size"], kwargs["logprobs_mode"]) == (0.4, True, 64, 3, 1, "processed_logprobs")


def test_generate_before_sync_and_an_unreachable_model_are_clear_errors(policy):
    engine = make_engine()
    with pytest.raises(RuntimeError, match="before sync"):
        engine.generate([[1]], 1, SamplingConfig())
    engine = VLLMEngine(llm_factory=lambda **kw: types.SimpleNamespace(), sampling_params_factory=dict)
    with pytest.raises(RuntimeError, match="cannot reach vLLM's model"):
        engine.sync(policy, 0)


def test_invalid_settings_are_refused_at_construction():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMEngine(gpu_memory_utilization=0.0)
    with pytest.raises(ValueError, match="sleep_level"):
        VLLMEngine(sleep_level=3)


def test_without_vllm_installed_the_error_says_how_to_get_it():
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"lightning_rlvr\[vllm\]"):
            _vllm_llm(model="x")
    else:  # pragma: no cover - a machine with vLLM
        pytest.skip("vLLM is installed here")


def test_the_datamodule_carries_the_engines_logprobs_up_to_eos(policy, tiny_model_dir):
    from transformers import AutoTokenizer

    from lightning_rlvr.data import RolloutDataModule
    from lightning_rlvr.data.sources import PromptSource
    from lightning_rlvr.tasks import Problem

    class OneProblem(PromptSource):
        def train_problems(self):
            return [Problem("5+7=", "12")]

        def held_out_problems(self):
            return []

    engine = make_engine()
    data = RolloutDataModule(source=OneProblem(), engine=engine, prompts_per_step=1, group_size=3, max_new_tokens=4)
    data.connect(AutoTokenizer.from_pretrained(tiny_model_dir))
    data.trainer = types.SimpleNamespace(lightning_module=types.SimpleNamespace(policy=policy, policy_version=0))
    batch = data.rollout(data.source.train_problems())
    rows = [c for o in engine.llm.last_outputs for c in o.outputs]
    for i, completion in enumerate(rows):
        length = int(batch.response_mask[i].sum())
        assert length == len(completion.token_ids)  # through the stop id, or all max_new_tokens
        values = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        torch.testing.assert_close(batch.engine_logprobs[i, :length], torch.tensor(values))
        assert batch.engine_logprobs[i, length:].abs().sum() == 0


def test_a_fit_syncs_the_engine_after_each_update_and_logs_the_mismatch(tiny_model_dir, memory_logger):
    import lightning.pytorch as pl

    from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
    from lightning_rlvr.verifiers import CallableVerifier

    # The random-init policy stops (samples EOS) within 40 tokens about half the time: rewarding every completion
    # that stops gives informative groups.
    engine = make_engine(logprobs_mode="processed_logprobs")
    data = RolloutDataModule(source=BuiltinTask("addition", warm_start_fraction=0.0), engine=engine,
                             verifier=CallableVerifier(lambda completion, answer: 1.0),
                             prompts_per_step=2, group_size=8, max_new_tokens=40, val_samples=0)
    module = RLVRModule(model=tiny_model_dir, engine_is_cap=2.0)
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=memory_logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, log_every_n_steps=1)
    trainer.fit(module, data)
    pushes = names(engine.llm.calls, "load_weights")
    assert len(pushes) == 3 and engine.version == 2  # versions 0, 1, 2: one push per policy the rollouts used
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    current = dict(module.policy.named_parameters())
    pushed = engine.llm.weights  # the weights of version 2: trained twice, then updated once more after the push
    assert any(not torch.equal(pushed[k], initial[k]) for k in pushed)
    assert any(not torch.equal(pushed[k], current[k].detach()) for k in pushed)
    history = memory_logger.history
    assert set(history["rollout/engine_kl"]) == {0, 1, 2}
    # vLLM sampled with exactly the weights the trainer scored: the mismatch is float rounding only.
    assert max(history["rollout/engine_kl"].values()) < 1e-5
    assert all(0.0 <= v <= 1.0 for v in history["policy/tis_clipfrac"].values())


def test_a_skipped_weight_push_shows_up_as_engine_kl(tiny_model_dir, memory_logger, monkeypatch):
    """The stand-in samples with the weights it was given: a stale engine is measured, not assumed away."""
    import lightning.pytorch as pl

    from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
    from lightning_rlvr.verifiers import CallableVerifier

    engine = make_engine(logprobs_mode="processed_logprobs")
    real_push = engine._push_weights
    monkeypatch.setattr(engine, "_push_weights", lambda: None if engine.version is not None else real_push())
    data = RolloutDataModule(source=BuiltinTask("addition", warm_start_fraction=0.0), engine=engine,
                             verifier=CallableVerifier(lambda completion, answer: 1.0),
                             prompts_per_step=2, group_size=8, max_new_tokens=40, val_samples=0)
    module = RLVRModule(model=tiny_model_dir, learning_rate=1e-2)
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=memory_logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, log_every_n_steps=1)
    trainer.fit(module, data)
    kl = memory_logger.history["rollout/engine_kl"]
    assert kl[0] < 1e-5  # the first rollout: pushed
    assert min(kl[1], kl[2]) > 1e-3  # later rollouts sampled by the version-0 weights the engine kept
