"""RLVRModule end to end on the tiny offline model: log-prob alignment, learning, accumulation, KL/ref, resume."""

from __future__ import annotations

import copy
import math

import lightning.pytorch as pl
import pytest
import torch

from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
from lightning_rlvr.callbacks import SupervisedWarmStart
from lightning_rlvr.data.batch import RolloutBatch
from lightning_rlvr.rollout.base import RolloutEngine
from lightning_rlvr.training.stats import UpdateStats
from lightning_rlvr.training.token_stats import PolicyScorer
from lightning_rlvr.training.update import engine_correction, log_engine_mismatch


def trainer(max_steps: int, **kwargs) -> pl.Trainer:
    defaults = dict(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                    num_sanity_val_steps=0, log_every_n_steps=1)
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def reverse_data(**kwargs) -> RolloutDataModule:
    defaults = dict(source=BuiltinTask("reverse", num_digits=3), prompts_per_step=8, group_size=4, max_new_tokens=4,
                    val_samples=0)
    defaults.update(kwargs)
    return RolloutDataModule(**defaults)


class FixedRollout(RolloutDataModule):
    """Serves one frozen rollout batch every step (re-stamped with the current policy version)."""

    def __init__(self, batch: RolloutBatch, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fixed = batch

    def rollout(self, problems):
        batch = copy.copy(self.fixed)
        batch.policy_version = self.trainer.lightning_module.policy_version
        return batch


def frozen_rollout(model_dir: str, temperature: float = 1.0) -> RolloutBatch:
    module = RLVRModule(model=model_dir)
    module.configure_model()
    dm = reverse_data(temperature=temperature)
    dm.connect(module.tokenizer, policy=module)
    torch.manual_seed(0)
    batch = dm.rollout(dm.source.train_problems()[:8])
    # A random policy never solves the task; alternate rewards so that every group has a learning signal.
    batch.rewards = (torch.arange(len(batch)) % 2).float()
    return batch


def test_logprobs_match_the_generation_logits_with_left_padding(tiny_model_dir):
    module = RLVRModule(model=tiny_model_dir)
    module.configure_model()
    tok = module.tokenizer
    prompts = [tok("rev 12=").input_ids, tok("5+7=").input_ids, tok("49+49=").input_ids]  # different lengths
    ids, mask = RolloutEngine.left_pad(prompts, tok.pad_token_id)
    torch.manual_seed(0)
    temperature = 0.7
    out = module.policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=True, top_k=0,
                                 temperature=temperature, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=tok.pad_token_id, eos_token_id=10_000)  # no early stop
    completion = out.sequences[:, ids.shape[1]:]
    expected = torch.stack([torch.log_softmax(l.float() / temperature, -1) for l in out.logits], 1)
    expected = expected.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    batch = RolloutBatch(
        input_ids=out.sequences, attention_mask=torch.cat([mask, torch.ones_like(completion)], 1),
        response_mask=torch.ones_like(completion, dtype=torch.float32), prompt_length=ids.shape[1],
        rewards=torch.zeros(3), scores=torch.zeros(3), correct=torch.zeros(3, dtype=torch.bool),
        truncated=torch.zeros(3, dtype=torch.bool), group_ids=torch.arange(3), policy_version=0,
        temperature=temperature,
    )
    stats = module.token_stats(module.policy, batch)
    torch.testing.assert_close(stats.logprobs, expected, atol=1e-5, rtol=1e-5)
    probs = torch.softmax(torch.stack(out.logits, 1).float() / temperature, -1)
    torch.testing.assert_close(stats.entropy, torch.distributions.Categorical(probs=probs).entropy(), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.slow
def test_grpo_learns_the_reverse_task(tiny_model_dir, memory_logger):
    pl.seed_everything(0)
    module = RLVRModule(model=tiny_model_dir, learning_rate=3e-4)
    data = reverse_data(prompts_per_step=16, group_size=8)
    fit = trainer(150, logger=memory_logger, callbacks=[SupervisedWarmStart(steps=100)])
    fit.fit(module, data)
    rewards = memory_logger.history["reward/mean"]
    steps = sorted(rewards)
    assert len(steps) == 150
    first = sum(rewards[s] for s in steps[:30]) / 30
    last = sum(rewards[s] for s in steps[-30:]) / 30
    assert last > first + 0.2, (first, last)
    assert module.policy_version == 150 + 1  # 150 updates + the warm start
    for key in ("reward/accuracy", "rollout/zero_std_groups", "rollout/response_length", "rollout/truncated",
                "entropy/token_mean", "entropy/failed", "entropy/successful", "policy/clipfrac_high",
                "policy/clipfrac_low", "policy/ppo_kl", "policy/grad_norm", "loss/pg", "reward/verifier_errors"):
        assert key in memory_logger.history, key


def test_micro_batches_give_the_same_update_as_the_whole_minibatch(tiny_model_dir):
    batch = frozen_rollout(tiny_model_dir)
    assert batch.rewards.std() > 0
    params = []
    for micro in (None, 5):
        torch.manual_seed(0)
        module = RLVRModule(model=tiny_model_dir, micro_batch_size=micro, loss_aggregation="token-mean")
        trainer(1).fit(module, FixedRollout(batch, source=BuiltinTask("reverse", num_digits=3), val_samples=0))
        params.append(torch.cat([p.detach().flatten() for p in module.policy.parameters()]))
    initial = RLVRModule(model=tiny_model_dir)
    initial.configure_model()
    start = torch.cat([p.detach().flatten() for p in initial.policy.parameters()])
    assert (params[0] - start).abs().max() > 1e-5  # an update happened
    torch.testing.assert_close(params[0], params[1], atol=1e-6, rtol=1e-5)


def test_fused_hidden_state_logprobs_give_the_same_updates_as_the_logits_path(tiny_model_dir):
    batch = frozen_rollout(tiny_model_dir)
    params = []
    for fused in (False, True):
        torch.manual_seed(0)
        # Two minibatches: the second update has ratios != 1, so old log-probs, entropy and S̄ all matter.
        module = RLVRModule(model=tiny_model_dir, fused_logprobs=fused, minibatch_size=16, kl_coef=0.1,
                            logprob_chunk_size=7)
        trainer(2).fit(module, FixedRollout(batch, source=BuiltinTask("reverse", num_digits=3), val_samples=0))
        params.append(torch.cat([p.detach().flatten() for p in module.policy.parameters()]))
    torch.testing.assert_close(params[1], params[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_the_shared_prompt_forward_gives_the_same_updates_as_full_rows(tiny_model_dir, fused):
    batch = frozen_rollout(tiny_model_dir)
    params, embedded_tokens = [], []
    for share in (False, True):
        torch.manual_seed(0)
        # Two shuffled minibatches and a KL term: the policy's forwards with and without gradient and the reference's.
        module = RLVRModule(model=tiny_model_dir, share_prompt_forward=share, fused_logprobs=fused, minibatch_size=16,
                            kl_coef=0.1)
        module.configure_model()
        tokens: list[int] = []
        module.policy.get_input_embeddings().register_forward_hook(lambda m, args, out: tokens.append(args[0].numel()))
        trainer(2).fit(module, FixedRollout(batch, source=BuiltinTask("reverse", num_digits=3), val_samples=0))
        params.append(torch.cat([p.detach().flatten() for p in module.policy.parameters()]))
        embedded_tokens.append(sum(tokens))
    torch.testing.assert_close(params[1], params[0], atol=1e-6, rtol=1e-5)
    assert embedded_tokens[1] < 0.8 * embedded_tokens[0], embedded_tokens


def test_auto_prompt_sharing_is_off_for_the_tiny_model_and_on_past_the_worthwhile_saving(tiny_model_dir, monkeypatch):
    batch = frozen_rollout(tiny_model_dir)
    module = RLVRModule(model=tiny_model_dir)  # share_prompt_forward="auto"
    module.configure_model()
    shapes: list[tuple[int, ...]] = []
    module.policy.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(args[0].shape))
    module.token_stats(module.policy, batch)
    assert shapes == [batch.input_ids.shape]  # 32 rows x (prompt + completion): below 1e8 parameter-tokens
    monkeypatch.setattr("lightning_rlvr.ops.shared_prompt.WORTHWHILE_SAVING", 1.0)
    shapes.clear()
    module.token_stats(module.policy, batch)
    assert len(shapes) == 2 and shapes[0][0] == len(batch.group_ids.unique())


def test_fused_logprobs_refuse_a_model_whose_logits_are_not_a_linear_map_of_its_hidden_state(tiny_model_dir):
    batch = frozen_rollout(tiny_model_dir)
    module = RLVRModule(model=tiny_model_dir, fused_logprobs=True)
    module.configure_model()
    head = module.policy.lm_head
    head.forward = lambda hidden: torch.nn.functional.linear(hidden, head.weight) * 2.0  # a logit scale
    with pytest.raises(RuntimeError, match="not a plain linear map"):
        module.token_stats(module.policy, batch)


def test_several_ppo_epochs_and_minibatches_step_the_optimizer_each_time(tiny_model_dir, memory_logger):
    batch = frozen_rollout(tiny_model_dir)
    module = RLVRModule(model=tiny_model_dir, ppo_epochs=2, minibatch_size=8, learning_rate=1e-3)
    fit = trainer(8, logger=memory_logger)
    fit.fit(module, FixedRollout(batch, source=BuiltinTask("reverse", num_digits=3), val_samples=0))
    assert module.policy_version == 8  # 2 epochs × 32/8 minibatches, one rollout step
    assert fit.global_step == 8
    assert memory_logger.history["policy/updates"][0] == 8
    assert memory_logger.history["policy/ppo_kl"][0] != 0.0  # later minibatches see a moved policy


def test_reference_model_only_with_kl_and_never_in_checkpoints(tiny_model_dir, tmp_path, memory_logger):
    plain = RLVRModule(model=tiny_model_dir)
    plain.configure_model()
    assert plain.ref_model is None

    module = RLVRModule(model=tiny_model_dir, kl_coef=0.1, kl_estimator="k3", learning_rate=1e-3)
    fit = trainer(3, logger=memory_logger, default_root_dir=tmp_path)
    fit.fit(module, FixedRollout(frozen_rollout(tiny_model_dir), source=BuiltinTask("reverse", num_digits=3),
                                 val_samples=0))
    assert all(not p.requires_grad for p in module.ref_model.parameters())
    optimized = {id(p) for group in fit.optimizers[0].param_groups for p in group["params"]}
    assert optimized.isdisjoint(id(p) for p in module.ref_model.parameters())
    assert "loss/kl" in memory_logger.history
    assert memory_logger.history["loss/kl"][0] == pytest.approx(0.0, abs=1e-7)  # policy == ref at step 0
    assert memory_logger.history["loss/kl"][2] > 0
    path = tmp_path / "kl.ckpt"
    fit.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert not any(k.startswith("ref_model.") for k in checkpoint["state_dict"])
    assert any(k.startswith("policy.") for k in checkpoint["state_dict"])


def test_fit_resumes_from_a_checkpoint(tiny_model_dir, tmp_path):
    warm = SupervisedWarmStart(steps=5)
    module = RLVRModule(model=tiny_model_dir)
    fit = trainer(3, default_root_dir=tmp_path, callbacks=[warm])
    fit.fit(module, reverse_data())
    path = tmp_path / "resume.ckpt"
    fit.save_checkpoint(path)
    weights = {k: v.clone() for k, v in module.policy.state_dict().items()}

    warm2 = SupervisedWarmStart(steps=5)
    resumed = RLVRModule(model=tiny_model_dir)
    calls = []
    original_fit = warm2.fit
    warm2.fit = lambda *a, **k: calls.append(1) or original_fit(*a, **k)
    fit2 = trainer(5, default_root_dir=tmp_path, callbacks=[warm2])

    seen = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["version"] = pl_module.policy_version
            seen["weights"] = {k: v.clone() for k, v in pl_module.policy.state_dict().items()}

    fit2.callbacks.append(Probe())
    fit2.fit(resumed, reverse_data(), ckpt_path=path)
    assert calls == []  # the warm start is not repeated after a resume
    assert seen["version"] == 3 + 1
    for k, v in weights.items():
        torch.testing.assert_close(seen["weights"][k], v)
    assert fit2.global_step == 5
    assert resumed.policy_version == 5 + 1


def test_non_finite_loss_skips_the_update_with_a_warning(tiny_model_dir, memory_logger):
    batch = frozen_rollout(tiny_model_dir)
    batch.rewards = torch.full_like(batch.rewards, float("nan"))
    module = RLVRModule(model=tiny_model_dir)
    module.configure_model()
    before = [p.detach().clone() for p in module.policy.parameters()]
    with pytest.warns(UserWarning, match="non-finite loss"):
        trainer(1, logger=memory_logger, max_epochs=1, limit_train_batches=1).fit(
            module, FixedRollout(batch, source=BuiltinTask("reverse", num_digits=3), val_samples=0))
    for b, p in zip(before, module.policy.parameters()):
        assert torch.equal(b, p.detach())
    assert memory_logger.history["policy/skipped_updates"][0] == 1
    assert module.policy_version == 0


def test_an_off_policy_rollout_is_refused(tiny_model_dir):
    batch = frozen_rollout(tiny_model_dir)

    class Stale(FixedRollout):
        def rollout(self, problems):
            stale = super().rollout(problems)
            stale.policy_version -= 1
            return stale

    with pytest.raises(RuntimeError, match="off-policy rollout"):
        trainer(1).fit(RLVRModule(model=tiny_model_dir),
                       Stale(batch, source=BuiltinTask("reverse", num_digits=3), val_samples=0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"ppo_epochs": 0}, "ppo_epochs"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"loss_aggregation": "mean"}, "loss_aggregation"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"clip_low": 1.5}, "clip_low"),
        ({"minibatch_size": 0}, "minibatch_size"),
        ({"logprob_chunk_size": 0}, "logprob_chunk_size"),
        ({"share_prompt_forward": "always"}, "share_prompt_forward"),
    ],
)
def test_invalid_arguments_are_rejected_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RLVRModule(**kwargs)


@pytest.mark.parametrize("reset_reference", [True, False])
def test_warm_start_sets_the_reference_to_the_warmed_up_policy(tiny_model_dir, memory_logger, reset_reference):
    pl.seed_everything(0)
    initial = RLVRModule(model=tiny_model_dir)
    initial.configure_model()
    module = RLVRModule(model=tiny_model_dir, kl_coef=0.1, kl_estimator="k3")
    seen = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["policy"] = {k: v.clone() for k, v in pl_module.policy.state_dict().items()}
            seen["ref"] = {k: v.clone() for k, v in pl_module.ref_model.state_dict().items()}

    warm = SupervisedWarmStart(steps=5, reset_reference=reset_reference)
    fit = trainer(1, logger=memory_logger, callbacks=[warm, Probe()])
    fit.fit(module, reverse_data(source=BuiltinTask("reverse", num_digits=3, warm_start_fraction=0.2)))
    expected = seen["policy"] if reset_reference else initial.policy.state_dict()
    for k, v in expected.items():
        torch.testing.assert_close(seen["ref"][k], v, rtol=0, atol=0)
    assert not torch.equal(seen["policy"]["lm_head.weight"], initial.policy.state_dict()["lm_head.weight"])
    assert all(not p.requires_grad for p in module.ref_model.parameters())
    kl_at_start = memory_logger.history["loss/kl"][0]
    if reset_reference:
        assert kl_at_start == pytest.approx(0.0, abs=1e-7)  # KL to the policy RL starts from
    else:
        assert kl_at_start > 1e-4


def test_resume_replays_the_warm_start_on_the_reference_only(tiny_model_dir, tmp_path, recwarn):
    def run(max_steps, ckpt_path=None):
        pl.seed_everything(0)
        module = RLVRModule(model=tiny_model_dir, kl_coef=0.1, kl_estimator="k3")
        warm = SupervisedWarmStart(steps=5)
        seen = {}

        class Probe(pl.Callback):
            def on_train_start(self, trainer, pl_module):
                seen["ref"] = {k: v.clone() for k, v in pl_module.ref_model.state_dict().items()}
                seen["policy"] = {k: v.clone() for k, v in pl_module.policy.state_dict().items()}

        fit = trainer(max_steps, default_root_dir=tmp_path, callbacks=[warm, Probe()])
        source = BuiltinTask("reverse", num_digits=3, warm_start_fraction=0.2)
        fit.fit(module, reverse_data(source=source), ckpt_path=ckpt_path)
        return fit, module, warm, seen

    fit, _, warm, first = run(2)
    path = tmp_path / "ref.ckpt"
    fit.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert not any(k.startswith("ref_model.") for k in checkpoint["state_dict"])

    _, _, warm2, resumed = run(3, ckpt_path=path)
    for k, v in first["ref"].items():  # the post-warm-start reference, rebuilt bitwise
        torch.testing.assert_close(resumed["ref"][k], v, rtol=0, atol=0)
    assert warm2.reference_fingerprint == warm.reference_fingerprint
    assert not any("replayed reference differs" in str(w.message) for w in recwarn)
    for k, v in fit.lightning_module.policy.state_dict().items():  # from the checkpoint, not a second warm start
        torch.testing.assert_close(resumed["policy"][k], v, rtol=0, atol=0)


@pytest.mark.parametrize("dynamic_sampling", [False, True], ids=["epoch_position", "refill_sampler"])
def test_resume_continues_exactly_as_the_uninterrupted_run(tiny_model_dir, tmp_path, dynamic_sampling):
    """Mid-epoch resume: the next steps' metrics equal the uninterrupted run's.

    Without dynamic sampling the rollouts come from the interrupted epoch's remaining prompts; with it (nothing is
    informative this early) from the refill sampler's last round — each of the two states is exercised.
    """
    from lightning_rlvr.loggers import InMemoryLogger

    def run(max_steps, ckpt_path=None, save=None, seed=0):
        pl.seed_everything(seed)
        logger = InMemoryLogger()
        module = RLVRModule(model=tiny_model_dir, learning_rate=1e-3)
        data = reverse_data(source=BuiltinTask("reverse", num_digits=3, warm_start_fraction=0.2),
                            dynamic_sampling=dynamic_sampling,
                            max_generation_rounds=2)
        fit = trainer(max_steps, logger=logger, callbacks=[SupervisedWarmStart(steps=3)])
        fit.fit(module, data, ckpt_path=ckpt_path)
        if save is not None:
            fit.save_checkpoint(save)
        return logger.history

    full = run(6)
    path = tmp_path / "mid.ckpt"
    run(3, save=path)
    checkpoint = torch.load(path, weights_only=True)  # safe loading works: only tensors and plain containers
    assert checkpoint["RolloutDataModule"]["consumed"] == 3 * 8
    resumed = run(6, ckpt_path=path, seed=1)  # a fresh process's RNG: everything must come from the checkpoint
    for key in ("reward/mean", "loss/pg", "entropy/token_mean", "policy/grad_norm", "rollout/generation_rounds"):
        assert {s: resumed[key][s] for s in (3, 4, 5)} == {s: full[key][s] for s in (3, 4, 5)}, key


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_resume_matches_the_uninterrupted_run(tiny_model_dir, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from lightning_rlvr.loggers import InMemoryLogger
    from resume_run import fit

    full = InMemoryLogger()
    fit(tiny_model_dir, str(tmp_path / "full"), logger=full)
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, str(here / "resume_run.py"), tiny_model_dir, str(tmp_path / "killed"),
                             "--kill-after", "3"], env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == ["epoch=0-step=3.ckpt"]
    resumed = InMemoryLogger()
    fit(tiny_model_dir, str(tmp_path / "resumed"), logger=resumed, ckpt_path=str(tmp_path / "killed" / "epoch=0-step=3.ckpt"),
        seed=123)
    assert min(resumed.history["loss/pg"]) == 3
    assert set(resumed.history) == set(full.history)
    for key in full.history:  # exactly equal (NaN == NaN: a stratum absent in both)
        if key.startswith("perf/"):
            continue  # wall-clock seconds
        expected = {s: v for s, v in full.history[key].items() if s >= 3}
        assert {s: repr(v) for s, v in resumed.history[key].items()} == {s: repr(v) for s, v in expected.items()}, key


def test_engine_mismatch_is_measured_and_truncated_importance_sampling_weights_the_loss(tiny_model_dir):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.0]])
    engine = torch.tensor([[-1.5, -0.5, -0.5], [-0.3, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    for cap in (None, 2.0):
        module = RLVRModule(model=tiny_model_dir, engine_is_cap=cap)
        stats = UpdateStats()
        log_engine_mismatch(old, engine, mask, mask.sum(), stats)
        weight = engine_correction(module.hparams, old, engine, mask, stats, mask.sum())
        kl = sum((e - o) for e, o, m in zip(engine.flatten().tolist(), old.flatten().tolist(),
                                            mask.flatten().tolist()) if m) / mask.sum().item()
        assert stats.engine_kl == pytest.approx(kl)
        if cap is None:
            assert weight is None and stats.tis_clip is None and stats.mis_mask is None
            continue
        expected_weight = [[min(math.exp(o - e), cap) * m for o, e, m in zip(ro, re, rm)]
                           for ro, re, rm in zip(old.tolist(), engine.tolist(), mask.tolist())]
        torch.testing.assert_close(weight, torch.tensor(expected_weight))
        over = [(math.exp(o - e) > cap) * m for o, e, m in zip(old.flatten().tolist(), engine.flatten().tolist(),
                                                              mask.flatten().tolist())]
        assert stats.tis_clip == pytest.approx(sum(over) / mask.sum().item())  # 2 of 5 valid tokens here
    with pytest.raises(ValueError, match="engine_is_cap"):
        RLVRModule(model=tiny_model_dir, engine_is_cap=0.0)
    with pytest.raises(ValueError, match="engine_is_mode"):
        RLVRModule(model=tiny_model_dir, engine_is_cap=2.0, engine_is_mode="sequence_clip")


@pytest.mark.parametrize("mode, key", [("sequence_truncate", "tis_clip"), ("token_mask", "mis_mask"),
                                       ("sequence_mask", "mis_mask")])
def test_every_engine_importance_sampling_mode_weights_the_loss_and_counts_its_tokens(tiny_model_dir, mode, key):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -1.0], [-0.2, -0.1, -0.4]])
    engine = torch.tensor([[-1.5, -0.5, -0.5], [-0.3, -1.0, -9.0], [-0.2, -0.1, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    module = RLVRModule(model=tiny_model_dir, engine_is_cap=2.0, engine_is_mode=mode)
    stats = UpdateStats()
    weight_applied = engine_correction(module.hparams, old, engine, mask, stats, mask.sum())
    # Row ratios: exp(0.5 - 1.5 + 0) = e^-1 (outside [1/2, 2]), exp(0 - 0.2) = e^-0.2, exp(0.1) (both inside);
    # token ratios outside [1/2, 2]: e^-1.5 (row 0).
    if mode == "sequence_truncate":
        weight = [[math.exp(-1)] * 3, [math.exp(-0.2)] * 2 + [0.0], [math.exp(0.1)] * 3]
        affected = 0
    elif mode == "sequence_mask":
        weight = [[0.0] * 3, [math.exp(-0.2)] * 2 + [0.0], [math.exp(0.1)] * 3]
        affected = 3
    else:
        weight = [[math.exp(0.5), 0.0, 1.0], [1.0, math.exp(-0.2), 0.0], [1.0, 1.0, math.exp(0.1)]]
        affected = 1
    torch.testing.assert_close(weight_applied, torch.tensor(weight))
    assert getattr(stats, key) == pytest.approx(affected / mask.sum().item())
    assert getattr(stats, "mis_mask" if key == "tis_clip" else "tis_clip") is None


def test_behaviour_stats_from_the_decoding_loop_replace_the_no_grad_pass(tiny_model_dir, monkeypatch):
    """Two minibatches need the behaviour policy's stats before the first update: HFEngine's decoding loop has them
    (same module, float32), so no no-grad pass runs, and the run matches one that recomputes them."""
    from lightning_rlvr.rollout import HFEngine

    params, passes, calls = [], [], []
    original = PolicyScorer.no_grad_stats
    monkeypatch.setattr(PolicyScorer, "no_grad_stats", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    for behaviour_stats in (True, False):
        calls.clear()
        pl.seed_everything(0)
        module = RLVRModule(model=tiny_model_dir, minibatch_size=16, learning_rate=1e-3)
        trainer(6).fit(module, reverse_data(engine=HFEngine(behaviour_stats=behaviour_stats)))
        params.append(torch.cat([p.detach().flatten() for p in module.policy.parameters()]))
        passes.append(len(calls))
    assert passes == [0, 3]  # 3 rollout steps x 2 minibatches; the recomputing run did one pass per rollout
    torch.testing.assert_close(params[0], params[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dynamic_sampling", [False, True])
def test_batched_behaviour_stats_match_a_recompute_row_by_row(tiny_model_dir, dynamic_sampling):
    """After verification, filtering across generation rounds and padding, each row's behaviour stats are still its
    own tokens' stats under the policy that generated them (zero past EOS)."""
    from lightning_rlvr.callbacks import Intervention

    checked = []

    class Check(Intervention):
        def on_rollout(self, trainer, pl_module, batch):
            expected = pl_module.recompute_token_stats(batch, with_sbar=True)
            mask = batch.response_mask.bool()
            for got, want in ((batch.behaviour_logprobs, expected.logprobs),
                              (batch.behaviour_entropy, expected.entropy), (batch.behaviour_sbar, expected.sbar)):
                assert got.shape == mask.shape
                torch.testing.assert_close(got[mask], want[mask], rtol=1e-4, atol=1e-5)
                assert (got[~mask] == 0).all()
            checked.append(len(batch))

    pl.seed_everything(1)
    module = RLVRModule(model=tiny_model_dir, minibatch_size=16, learning_rate=1e-3)
    data = reverse_data(dynamic_sampling=dynamic_sampling, max_generation_rounds=3, temperature=0.8)
    trainer(4, callbacks=[Check()]).fit(module, data)
    assert len(checked) == 2 and all(n > 0 for n in checked)


@pytest.mark.parametrize(("kwargs", "callbacks", "wanted"), [
    ({}, [], False),  # one on-policy update: the update's own forward is the behaviour pass
    ({"minibatch_size": 16}, [], True),
    ({"ppo_epochs": 2}, [], True),
    ({}, ["GTPO"], True),  # reads the old entropy before the update
])
def test_the_engine_is_asked_for_behaviour_stats_only_when_a_pass_would_run(tiny_model_dir, kwargs, callbacks,
                                                                              wanted):
    from lightning_rlvr import callbacks as cb
    from lightning_rlvr.rollout import HFEngine

    asked = []

    class Spy(HFEngine):
        def generate(self, prompts, n, sampling):
            asked.append(sampling.behaviour_stats)
            return super().generate(prompts, n, sampling)

    module = RLVRModule(model=tiny_model_dir, **kwargs)
    steps = 2 if kwargs.get("minibatch_size") or kwargs.get("ppo_epochs") else 1
    trainer(steps, callbacks=[getattr(cb, name)() for name in callbacks]).fit(module, reverse_data(engine=Spy()))
    assert asked == [wanted]
