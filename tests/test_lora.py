"""LoRA policies (peft): only the adapter trains, the reference is the base (adapter off, no second model),
checkpoints hold the adapter, a warm start can become the base, engines generate with the adapter."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM

from lightning_rlvr import BuiltinTask, LoRA, RLVRModule, RolloutDataModule
from lightning_rlvr.callbacks import SupervisedWarmStart
from lightning_rlvr.loggers import InMemoryLogger
from lightning_rlvr.lora import merged_weights
from lightning_rlvr.verifiers import CallableVerifier
from tests.conftest import ScriptedEngine
from tests.reference_objective import completion_logprobs
from tests.test_objective import SCRIPT, graded

pytest.importorskip("peft")

LORA = {"rank": 4, "alpha": 8.0}


def data(**kwargs) -> RolloutDataModule:
    """Scripted completions with graded rewards (tests/test_objective.py): every group is informative."""
    settings = dict(source=BuiltinTask("reverse", num_digits=3, warm_start_fraction=0.2), engine=ScriptedEngine(SCRIPT),
                    verifier=CallableVerifier(graded), prompts_per_step=4, group_size=4, max_new_tokens=4,
                    val_samples=0, verifier_workers=1)
    return RolloutDataModule(**{**settings, **kwargs})


def trainer(steps: int, logger=None, callbacks=(), **kwargs) -> pl.Trainer:
    settings = dict(accelerator="cpu", max_steps=steps, logger=logger or False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                    num_sanity_val_steps=0, log_every_n_steps=1, callbacks=list(callbacks))
    return pl.Trainer(**{**settings, **kwargs})


class LastRollout(pl.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        original = trainer.datamodule.rollout

        def rollout(problems):
            self.batch = original(problems)
            return self.batch

        trainer.datamodule.rollout = rollout


def base_logprobs(model_dir, batch) -> torch.Tensor:
    """The checkpoint's own log-probs of a batch, without lightning_rlvr (tests/reference_objective.py)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        return completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_length,
                                   batch.temperature)


def test_only_the_adapter_trains_and_the_reference_is_the_base_model(tiny_model_dir):
    pl.seed_everything(0)
    module = RLVRModule(model=tiny_model_dir, learning_rate=1e-2, kl_coef=0.1, lora=LORA)
    seen = LastRollout()
    logger = InMemoryLogger()
    fit = trainer(4, logger, callbacks=[seen])
    fit.fit(module, data())
    assert module.ref_model is None  # no second model: the reference is the adapter switched off
    trainable = {name for name, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    optimized = {id(p) for group in fit.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in module.policy.parameters() if p.requires_grad}
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for name, parameter in module.policy.get_base_model().named_parameters():
        if ".lora_" not in name:  # the base weights never moved
            original = name.replace(".base_layer", "")
            torch.testing.assert_close(parameter, base.get_parameter(original), rtol=0, atol=0)
    assert any(p.abs().sum() > 0 for n, p in module.policy.named_parameters() if ".lora_B." in n)
    batch = seen.batch
    torch.testing.assert_close(module.reference_logprobs(batch), base_logprobs(tiny_model_dir, batch),
                               rtol=1e-5, atol=1e-5)
    kl = logger.history["loss/kl"]
    assert kl[0] == 0.0  # B = 0 at the start: the policy is its reference, exactly
    assert kl[3] > 0


def test_the_checkpoint_holds_the_adapter_and_resumes_exactly(tiny_model_dir, tmp_path):
    def run(directory, seed, ckpt_path=None):
        pl.seed_everything(seed)
        logger = InMemoryLogger()
        fit = trainer(12, logger, callbacks=[ModelCheckpoint(dirpath=directory, every_n_train_steps=6, save_top_k=-1)],
                      enable_checkpointing=True)
        fit.fit(RLVRModule(model=tiny_model_dir, learning_rate=1e-2, kl_coef=0.05, lora=LORA,
                           minibatch_size=8), data(), ckpt_path=ckpt_path)
        return logger.history

    full = run(tmp_path / "full", 0)
    checkpoint = tmp_path / "full" / "epoch=0-step=6.ckpt"  # after 3 of 6 rollouts (2 minibatches each)
    state = torch.load(checkpoint, weights_only=True)
    policy_keys = [k for k in state["state_dict"] if k.startswith("policy.")]
    assert policy_keys and all(".lora_" in k for k in policy_keys)
    assert not any(k.startswith("ref_model.") for k in state["state_dict"])
    pl.seed_everything(0)
    full_size = os.path.getsize(checkpoint)
    resumed = run(tmp_path / "resumed", 123, ckpt_path=str(checkpoint))
    for key in ("loss/pg", "loss/kl", "reward/mean", "policy/grad_norm"):
        expected = {s: v for s, v in full[key].items() if s >= 3}
        assert {s: repr(v) for s, v in resumed[key].items()} == {s: repr(v) for s, v in expected.items()}, key
    # The same run with full fine-tuning: its checkpoint holds every weight (and their optimizer state).
    pl.seed_everything(0)
    fit = trainer(2, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ft", every_n_train_steps=2)],
                  enable_checkpointing=True)
    fit.fit(RLVRModule(model=tiny_model_dir, learning_rate=1e-2, minibatch_size=8), data())
    assert full_size < 0.5 * os.path.getsize(tmp_path / "ft" / "epoch=0-step=2.ckpt")


def test_a_warm_start_merged_into_the_base_is_the_reference_and_comes_back_with_the_checkpoint(tiny_model_dir,
                                                                                                tmp_path):
    pl.seed_everything(0)
    logger = InMemoryLogger()
    module = RLVRModule(model=tiny_model_dir, learning_rate=1e-2, kl_coef=0.1, lora=LORA)
    seen = LastRollout()
    fit = trainer(2, logger, callbacks=[SupervisedWarmStart(steps=30), seen,
                                        ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)],
                  enable_checkpointing=True)
    fit.fit(module, data())
    assert logger.history["loss/kl"][0] == 0.0  # the reference is the warmed-up policy (a fresh adapter on it)
    assert len(module.merged_adapters) == 1
    batch = seen.batch
    assert (module.reference_logprobs(batch) - base_logprobs(tiny_model_dir, batch)).abs().max() > 1e-2
    # A new module loaded from the checkpoint merges the warm start into its base again: same reference, same policy.
    restored = RLVRModule(model=tiny_model_dir, learning_rate=1e-2, kl_coef=0.1, lora=LORA)
    restored.configure_model()
    checkpoint = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)
    restored.on_load_checkpoint(checkpoint)
    restored.load_state_dict(checkpoint["state_dict"], strict=False)
    torch.testing.assert_close(restored.reference_logprobs(batch), module.reference_logprobs(batch), rtol=0, atol=0)
    torch.testing.assert_close(restored.token_stats(restored.policy, batch).logprobs,
                               module.token_stats(module.policy, batch).logprobs, rtol=0, atol=0)


def test_merged_weights_are_the_policy_as_a_plain_checkpoint(tiny_model_dir):
    """What vLLM receives: a plain model with these weights computes the LoRA policy's log-probs."""
    pl.seed_everything(0)
    module = RLVRModule(model=tiny_model_dir, learning_rate=3e-2, lora=LORA)
    seen = LastRollout()
    trainer(3, callbacks=[seen]).fit(module, data())
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    names = {name for name, _ in plain.named_parameters()}
    pushed = dict(item for bucket in merged_weights(module.policy, bucket_bytes=4096) for item in bucket)
    assert set(pushed) == names  # the base model's own names, nothing of the adapter
    plain.load_state_dict(pushed, strict=False)
    batch = seen.batch
    with torch.no_grad():
        ours = module.token_stats(module.policy, batch).logprobs
    theirs = completion_logprobs(plain, batch.input_ids, batch.attention_mask, batch.prompt_length,
                                 batch.temperature)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (ours - base_logprobs(tiny_model_dir, batch)).abs().max() > 1e-2  # the adapter changed the policy


def test_lora_settings_are_validated():
    with pytest.raises(ValueError, match="rank"):
        RLVRModule(model="builtin:tiny", lora={"rank": 0})
    with pytest.raises(ValueError, match="target_modules"):
        LoRA(target_modules="everything")
    with pytest.raises(ValueError, match="ties its output head"):  # the tiny Llama ties lm_head to embed_tokens
        RLVRModule(model="builtin:tiny", lora={"target_modules": ["q_proj", "lm_head"]}).configure_model()
    assert RLVRModule(model="builtin:tiny", lora=LoRA(rank=2)).hparams.lora["rank"] == 2


def test_export_writes_a_peft_adapter_and_a_merged_model_that_reproduce_the_policy(tiny_model_dir, tmp_path):
    """A warm start merged into the base and the RL adapter on top: both exports reproduce the policy exactly."""
    from peft import PeftModel

    from lightning_rlvr.cli import main

    pl.seed_everything(0)
    module = RLVRModule(model=tiny_model_dir, learning_rate=2e-2, lora=LORA)
    seen = LastRollout()
    trainer(3, callbacks=[SupervisedWarmStart(steps=20), seen, ModelCheckpoint(dirpath=tmp_path / "ckpt")],
            enable_checkpointing=True).fit(module, data())
    assert len(module.merged_adapters) == 1
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    main(["export", "--ckpt_path", str(checkpoint), "--output", str(tmp_path / "out"), "--merged"])
    batch = seen.batch
    with torch.no_grad():
        expected = module.token_stats(module.policy, batch).logprobs

    def logprobs(model):
        with torch.no_grad():
            return completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_length,
                                       batch.temperature)

    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                        str(tmp_path / "out" / "adapter"))
    torch.testing.assert_close(logprobs(adapter), expected, rtol=1e-5, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    torch.testing.assert_close(logprobs(merged), expected, rtol=1e-5, atol=1e-5)
    assert (expected - base_logprobs(tiny_model_dir, batch)).abs().max() > 1e-2


def test_engines_generate_with_the_adapter(tiny_model_dir, memory_logger):
    """HFEngine samples from the LoRA policy itself; vLLM (the stand-in) from the merged weights it was pushed: its
    log-probs are the trainer's (engine_kl ~ 0) after every update."""
    from lightning_rlvr.rollout import HFEngine, SamplingConfig, VLLMEngine
    from tests.fake_vllm import FakeLLM, fake_sampling_params

    pl.seed_everything(0)
    module = RLVRModule(model=tiny_model_dir, learning_rate=3e-2, lora=LORA)
    trainer(3).fit(module, data())
    policy = module.policy
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    merged.load_state_dict(dict(item for bucket in merged_weights(policy) for item in bucket), strict=False)
    prompts = [[1, 5, 6, 7], [1, 9]]
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, stop_token_ids=(2,))
    outputs = []
    for model in (policy, merged):
        engine = HFEngine()
        engine.sync(model, 0)
        torch.manual_seed(7)
        outputs.append(engine.generate(prompts, 4, sampling).completion_ids)
    assert torch.equal(outputs[0], outputs[1])  # the same draws: the adapter is active while decoding
    vllm = VLLMEngine(llm_factory=FakeLLM, sampling_params_factory=fake_sampling_params,
                      logprobs_mode="processed_logprobs")
    fresh = RLVRModule(model=tiny_model_dir, learning_rate=3e-2, lora=LORA)
    trainer(3, memory_logger).fit(fresh, data(engine=vllm, verifier=CallableVerifier(lambda c, a: float(len(c) % 2)),
                                             max_new_tokens=12))
    kl = memory_logger.history["rollout/engine_kl"]
    assert len(kl) == 3 and max(abs(v) for v in kl.values()) < 1e-5
    assert sum(call[0] == "load_weights" for call in vllm.llm.calls) >= 3


def test_vllm_serves_the_adapter_through_its_lora_support(tiny_model_dir, memory_logger):
    """lora_mode="adapter": the base pushed once (again whenever a warm start is merged into it), the adapter written
    and loaded per update through a LoRARequest; vLLM's log-probs are still the trainer's."""
    from lightning_rlvr.rollout import VLLMEngine
    from tests.fake_vllm import FakeLLM, LoRARequest, fake_sampling_params

    pl.seed_everything(0)
    vllm = VLLMEngine(llm_factory=FakeLLM, sampling_params_factory=fake_sampling_params,
                      lora_request_factory=LoRARequest, lora_mode="adapter", logprobs_mode="processed_logprobs")
    module = RLVRModule(model=tiny_model_dir, learning_rate=3e-2, lora=LORA)
    trainer(3, memory_logger, callbacks=[SupervisedWarmStart(steps=20)]).fit(
        module, data(engine=vllm, verifier=CallableVerifier(lambda c, a: float(len(c) % 2)), max_new_tokens=12))
    llm = vllm.llm
    assert llm.kwargs["enable_lora"] is True and llm.kwargs["max_lora_rank"] == 8
    requests = [r for r in llm.lora_requests if r is not None]
    assert len(requests) == 3 and len({r.lora_int_id for r in requests}) == 3  # a new adapter after each update
    # The base went once, at the first rollout, after the warm start was merged into it: engine_kl ~ 0 below
    # shows vLLM's base is the merged one.
    assert sum(call[0] == "load_weights" for call in llm.calls) == 1 and module.policy.merged_adapter_count == 1
    kl = memory_logger.history["rollout/engine_kl"]
    assert max(abs(v) for v in kl.values()) < 1e-5


def test_adapter_mode_is_refused_where_vllm_cannot_serve_it(tiny_model_dir, monkeypatch):
    """Before 0.28 vLLM names an enable_lora model's linear weights ``…q_proj.base_layer.weight`` and loads nothing
    under the plain names (the stand-in enforces this per version); and it refuses adapters with modules_to_save."""
    import functools

    import lightning_rlvr.rollout.vllm as vllm_module
    from lightning_rlvr.rollout import VLLMEngine
    from tests.fake_vllm import FakeLLM, LoRARequest, fake_sampling_params

    def engine(version: str) -> VLLMEngine:
        return VLLMEngine(llm_factory=functools.partial(FakeLLM, version=version),
                          sampling_params_factory=fake_sampling_params, lora_request_factory=LoRARequest,
                          lora_mode="adapter", logprobs_mode="processed_logprobs")

    from lightning_rlvr.lora import attach_lora

    policy = attach_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoRA(**LORA))
    monkeypatch.setattr(vllm_module, "installed_vllm_release", lambda: None)  # what the push meets without the check
    with pytest.raises(KeyError, match="q_proj.weight"):
        engine("0.27.1").sync(policy, 0)
    engine("0.28.0").sync(policy, 0)
    monkeypatch.setattr(vllm_module, "installed_vllm_release", lambda: (0, 27))
    with pytest.raises(ValueError, match="needs vLLM >= 0.28"):
        engine("0.27.1").sync(policy, 0)
    monkeypatch.setattr(vllm_module, "installed_vllm_release", lambda: (0, 33))
    saving = attach_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoRA(**LORA, modules_to_save=["norm"]))
    with pytest.raises(ValueError, match=r"modules_to_save=\[.norm.\]"):
        engine("0.33.0").sync(saving, 0)


def test_export_takes_a_checkpoint_written_by_the_cli(tmp_path, monkeypatch):
    """LightningCLI saves its own entries (``_instantiator``) among the hyperparameters; export must skip them."""
    from lightning_rlvr.cli import build_cli, main

    monkeypatch.chdir(tmp_path)
    build_cli(["fit", "--config", str(Path(__file__).parents[1] / "configs" / "quickstart_lora.yaml"),
               "--trainer.max_steps", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
               "--trainer.val_check_interval", "1", "--trainer.num_sanity_val_steps", "0",  # saved after validation
               "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks", "[]",
               "--data.prompts_per_step", "2", "--data.group_size", "2", "--data.val_max_prompts", "2",
               "--data.val_samples", "0"])
    (checkpoint,) = tmp_path.glob("**/*.ckpt")
    assert "_instantiator" in torch.load(checkpoint, weights_only=True)["hyper_parameters"]
    main(["export", "--ckpt_path", str(checkpoint), "--output", str(tmp_path / "out")])
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
