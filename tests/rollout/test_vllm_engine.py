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
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_rlvr.rollout.base import SamplingConfig
from lightning_rlvr.rollout.vllm import VLLMEngine, _vllm_llm
from tests.conftest import fake_policy


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
    engine.generate([[1, 6]], 2, sampling)  # a second dynamic-sampling round: no sleep in between
    engine.release()  # the rollout is done: sleep during the update
    engine.sync(policy, 1)  # after an update: weights first, then the KV cache for generating
    engine.generate([[1, 5]], 2, sampling)
    engine.release()
    engine.generate([[1, 6]], 1, sampling)  # validation right after: same weights, everything woken
    engine.release()
    engine.release()  # already asleep: nothing to do
    assert [c for c in engine.llm.calls if c[0] != "load_weights"] == [
        ("reset_prefix_cache",), ("generate", 1), ("generate", 1), ("sleep", 1),
        ("wake_up", ("weights",)), ("reset_prefix_cache",), ("wake_up", ("kv_cache",)), ("generate", 1), ("sleep", 1),
        ("wake_up", ("weights",)), ("wake_up", ("kv_cache",)), ("generate", 1), ("sleep", 1),
    ]
    assert len(names(engine.llm.calls, "load_weights")) == 2


def test_sleep_level_2_pushes_the_weights_again_on_waking(policy):
    engine = make_engine(enable_sleep_mode=True, sleep_level=2)
    sampling = SamplingConfig(max_new_tokens=4)
    engine.sync(policy, 0)
    engine.generate([[1, 5]], 1, sampling)
    engine.release()
    engine.generate([[1, 5]], 1, sampling)  # level 2 dropped the weights: pushed again before generating
    kinds = [c[0] for c in engine.llm.calls]
    assert kinds == ["load_weights", "reset_prefix_cache", "generate", "sleep",
                     "wake_up", "load_weights", "reset_prefix_cache", "wake_up", "generate"]


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
    data.connect(AutoTokenizer.from_pretrained(tiny_model_dir), policy=fake_policy(policy))
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


# -- what vLLM enforces and what the engine must do about it (../shared/reviews/vllm-review.md priority list) ------
def quiet_trainer(max_steps: int, logger, **kwargs):
    import lightning.pytorch as pl

    settings = dict(accelerator="cpu", max_steps=max_steps, logger=logger, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                    num_sanity_val_steps=0, log_every_n_steps=1)
    return pl.Trainer(**{**settings, **kwargs})


@pytest.mark.slow
def test_two_ranks_started_by_lightnings_launcher_build_vllm_with_their_rank(tiny_model_dir, tmp_path):
    """Lightning's launcher sets LOCAL_RANK and WORLD_SIZE, never RANK, which vLLM's external_launcher reads."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, str(root / "tests" / "vllm_two_ranks.py"), tiny_model_dir, str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, result in enumerate(ranks):
        assert (result["rank"], result["world_size"], result["global_step"]) == (r, 2, 2)
        assert result["backend"] == "external_launcher" and (result["llm_rank"], result["llm_local_rank"]) == (r, r)
        assert result["seed"] == r  # each rank's engine gets its own seed
        assert result["pushes"] == 2 and all(abs(kl) < 1e-5 for kl in result["engine_kl"])


def test_the_engine_is_built_fed_and_run_outside_inference_mode_autocast_and_bf16_defaults(policy):
    """Lightning's sanity validation runs under inference_mode, bf16-true sets a bfloat16 default dtype."""
    engine = make_engine()
    outer = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            engine.sync(policy, 0)  # the first sync, as in a sanity validation under bf16-true
            engine.generate([[1, 5, 6]], 2, SamplingConfig(max_new_tokens=3))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine.sync(policy, 1)  # the next one, in a training step
        assert torch.get_default_dtype() == torch.bfloat16  # the caller's context is given back
    finally:
        torch.set_default_dtype(outer)
    contexts = engine.llm.contexts
    assert [c["call"] for c in contexts] == ["LLM", "load_weights", "generate", "load_weights"]
    for context in contexts:
        assert context == {"call": context["call"], "inference_mode": False, "grad": False, "autocast": False,
                           "default_dtype": torch.float32}


def test_building_the_engine_leaves_every_global_rng_where_it_was(policy):
    """vLLM's worker reseeds random, numpy and torch in this process; a resumed run must not see that."""
    import random

    import numpy as np

    from lightning_rlvr.rng import rng_state

    torch.manual_seed(1234)
    random.seed(99)
    np.random.seed(7)
    before = rng_state()
    engine = make_engine(seed=5)
    engine.sync(policy, 0)
    after = rng_state()
    assert torch.equal(before["torch"], after["torch"])
    assert before["python"] == after["python"]
    assert torch.equal(before["numpy"][1], after["numpy"][1]) and before["numpy"][2:] == after["numpy"][2:]


def resumable_fit(model_dir: str, checkpoint_dir: str, logger, max_steps: int = 6, ckpt_path: str | None = None,
                  seed: int = 0) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
    from lightning_rlvr.verifiers import CallableVerifier

    pl.seed_everything(seed, verbose=False)
    engine = make_engine(enable_sleep_mode=True, sleep_level=2, logprobs_mode="processed_logprobs")
    data = RolloutDataModule(source=BuiltinTask("addition", warm_start_fraction=0.0), engine=engine,
                             verifier=CallableVerifier(lambda completion, answer: float(len(completion) % 2)),
                             prompts_per_step=2, group_size=8, max_new_tokens=12, val_samples=0)
    # Two minibatches: the module draws their order from the global RNG every step.
    module = RLVRModule(model=model_dir, learning_rate=1e-2, minibatch_size=8)
    trainer = quiet_trainer(max_steps * 2, logger, enable_checkpointing=True, callbacks=[
        ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=6, save_top_k=-1)])
    trainer.fit(module, data, ckpt_path=ckpt_path)


def test_a_resumed_run_with_the_vllm_engine_continues_exactly(tiny_model_dir, tmp_path):
    """The engine is built again after a resume; its construction must not reseed the restored random streams."""
    from lightning_rlvr.loggers import InMemoryLogger

    full = InMemoryLogger()
    resumable_fit(tiny_model_dir, str(tmp_path / "full"), full)
    checkpoint = tmp_path / "full" / "epoch=0-step=6.ckpt"  # after 3 rollout steps (2 minibatches each)
    assert checkpoint.exists()
    resumed = InMemoryLogger()
    resumable_fit(tiny_model_dir, str(tmp_path / "resumed"), resumed, ckpt_path=str(checkpoint), seed=123)
    assert sorted(resumed.history["loss/pg"]) == [3, 4, 5]
    for key in ("loss/pg", "reward/mean", "rollout/engine_kl", "policy/grad_norm", "entropy/token_mean"):
        expected = {s: v for s, v in full.history[key].items() if s >= 3}
        assert {s: repr(v) for s, v in resumed.history[key].items()} == {s: repr(v) for s, v in expected.items()}, key
    assert len(set(full.history["reward/mean"].values())) > 1  # the rollouts are not all alike


def test_the_engine_sleeps_once_per_rollout_and_once_per_validation_epoch(tiny_model_dir, memory_logger):
    from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
    from lightning_rlvr.verifiers import CallableVerifier

    engine = make_engine(enable_sleep_mode=True)
    data = RolloutDataModule(source=BuiltinTask("addition", warm_start_fraction=0.0), engine=engine,
                             verifier=CallableVerifier(lambda completion, answer: 0.0),  # every group uninformative
                             prompts_per_step=2, group_size=4, max_new_tokens=6, dynamic_sampling=True,
                             max_generation_rounds=3, val_batch_size=2, val_max_prompts=6, val_samples=2, val_k=2)
    trainer = quiet_trainer(4, memory_logger, limit_val_batches=None, num_sanity_val_steps=-1,
                            val_check_interval=2, check_val_every_n_epoch=None)
    with pytest.warns(UserWarning, match="dynamic sampling kept no informative group"):
        trainer.fit(RLVRModule(model=tiny_model_dir), data)
    calls = [c[0] for c in engine.llm.calls]
    rollouts, validations = 4, 3  # the sanity check and after steps 2 and 4
    generations = rollouts * 3 + validations * 3 * 2  # 3 rounds a rollout; 3 batches x (greedy + samples) an epoch
    assert calls.count("generate") == generations
    assert calls.count("sleep") == rollouts + validations
    # weights and KV cache wake after each sleep but the last (the engine starts awake)
    assert calls.count("wake_up") == 2 * (rollouts + validations - 1)


def test_engine_is_cap_with_top_p_or_top_k_is_refused(tiny_model_dir):
    from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule

    for sampling in ({"top_p": 0.9}, {"top_k": 20}):
        data = RolloutDataModule(source=BuiltinTask("addition"), engine=make_engine(), **sampling)
        with pytest.raises(ValueError, match="engine_is_cap needs top_p=1 and top_k=0"):
            quiet_trainer(1, False).fit(RLVRModule(model=tiny_model_dir, engine_is_cap=2.0), data)


def test_a_prompt_longer_than_max_model_len_is_named_before_generating(tiny_model_dir):
    from lightning_rlvr import RolloutDataModule
    from lightning_rlvr.tasks import Problem
    from tests.conftest import ListSource

    problems = [Problem("1+1=", "2"), Problem("12+34+5+6+7+8+9=", "81")]
    engine = make_engine(max_model_len=10)
    data = RolloutDataModule(source=ListSource(problems), engine=engine, prompts_per_step=2, group_size=2)
    data.connect(AutoTokenizer.from_pretrained(tiny_model_dir),
                 policy=fake_policy(AutoModelForCausalLM.from_pretrained(tiny_model_dir)))
    with pytest.raises(ValueError, match=r"'12\+34\+5\+6\+7\+8\+9=' is 17 tokens long.*max_model_len"):
        data.rollout(problems)
    assert [c for c in engine.llm.calls if c[0] == "generate"] == []  # nothing was lost in vLLM


def test_vllm_multiprocessing_set_by_the_user_is_switched_off_with_a_warning(policy, monkeypatch):
    import os

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.warns(UserWarning, match="VLLM_ENABLE_V1_MULTIPROCESSING=1 would put vLLM's model in another process"):
        make_engine().sync(policy, 0)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_sampling_params_are_vllms_and_skip_detokenizing(policy):
    engine = make_engine()
    engine.sync(policy, 0)
    engine.generate([[1, 5]], 2, SamplingConfig(max_new_tokens=3))
    assert engine.llm.params.detokenize is False  # the DataModule decodes the ids itself
    with pytest.raises(TypeError, match="max_new_tokens"):
        fake_sampling_params(max_new_tokens=3)  # the stand-in knows vLLM's fields only
    with pytest.raises(ValueError, match="greedy"):
        fake_sampling_params(n=2, temperature=0.0)


def test_the_stand_in_enforces_what_vllm_enforces(policy, tiny_model_dir, monkeypatch):
    with pytest.raises(TypeError, match="gpu_memory_utilisation"):
        FakeLLM(model=tiny_model_dir, gpu_memory_utilisation=0.3)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(KeyError, match="RANK"):
        FakeLLM(model=tiny_model_dir, distributed_executor_backend="external_launcher")
    llm = FakeLLM(model=tiny_model_dir, enable_sleep_mode=True)
    with pytest.raises(RuntimeError, match="one instance per process"):
        FakeLLM(model=tiny_model_dir, enable_sleep_mode=True)
    with pytest.raises(KeyError):
        llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.load_weights(
            [("model.layers.0.self_attn.q_proj.weight.orig", torch.zeros(1))])
    llm.sleep(level=2)
    llm.wake_up()
    with pytest.raises(RuntimeError, match="discarded weights"):
        llm.generate([{"prompt_token_ids": [1, 5]}], fake_sampling_params(max_tokens=2))
    del llm


def test_level_2_sleep_between_rollouts_re_pushes_the_weights(tiny_model_dir, memory_logger):
    from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
    from lightning_rlvr.verifiers import CallableVerifier

    engine = make_engine(enable_sleep_mode=True, sleep_level=2, logprobs_mode="processed_logprobs")
    data = RolloutDataModule(source=BuiltinTask("addition", warm_start_fraction=0.0), engine=engine,
                             verifier=CallableVerifier(lambda completion, answer: 1.0),
                             prompts_per_step=2, group_size=8, max_new_tokens=40, val_samples=0)
    quiet_trainer(3, memory_logger).fit(RLVRModule(model=tiny_model_dir, learning_rate=1e-2), data)
    assert max(abs(v) for v in memory_logger.history["rollout/engine_kl"].values()) < 1e-5
