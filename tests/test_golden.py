"""Golden training runs: the parameters and logged metrics after a few real rollout steps, recorded once.

A safety net for refactoring the training step and the DataModule: every configuration below (micro-batches, two
minibatches, two PPO epochs, KL, RLOO with dual-clip, interventions of each hook kind, dynamic sampling, LoRA and a
policy lag of 1) trains the built-in tiny model through the real engine, verifier and Trainer, and what it ends with
must not move. On the platform that recorded them (the same torch build and CPU) the trained parameters must be
bit-identical (a SHA-256 of their bytes) and every logged metric equal to its last digit; elsewhere, where float
kernels may round differently, they must agree to 1e-4.

Recording (only when a change is *meant* to change the numbers; say why in the commit), all runs or those a change
moved; each run keeps the platform it was recorded on::

    LIGHTNING_RLVR_RECORD_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_golden.py [-k lag_1]
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_rlvr.callbacks import AdaptiveEntropy, ClipCov, Intervention, PositionShaping
from lightning_rlvr.data import RolloutDataModule
from lightning_rlvr.data.sources import BuiltinTask
from lightning_rlvr.module import RLVRModule
from lightning_rlvr.rollout.hf import HFEngine
from lightning_rlvr.verifiers import CallableVerifier
from tests.conftest import MemoryLogger

GOLDEN = Path(__file__).parent / "golden" / "training.json"
# Written at step 2 of 3 by the code before the architecture split (commit e9b3875): the tiny model, KL, micro-batches
# and AdaptiveEntropy's controller state, with the DataModule's resume state.
OLD_CHECKPOINT = Path(__file__).parent / "golden" / "checkpoint_before_split.ckpt"
RECORD = os.environ.get("LIGHTNING_RLVR_RECORD_GOLDEN") == "1"
ROLLOUT_STEPS = 2
PROMPTS, GROUP = 4, 4


def graded(completion: str, answer: str) -> float:
    """A reward that varies within every group, so that every configuration has non-zero advantages."""
    return (len(completion) * 7 + sum(ord(c) for c in completion)) % 5 / 4


class FlipEveryThirdReward(Intervention):
    """An ``on_rollout`` hook (no shipped intervention has one of its own): every third reward becomes 1."""

    def on_rollout(self, trainer, pl_module, batch):
        rewards = batch.rewards.clone()
        rewards[::3] = 1.0
        batch.rewards = rewards
        return batch


def every_hook():
    return [FlipEveryThirdReward(), PositionShaping(alpha=0.5, active_steps=None, active_fraction=None),
            ClipCov(ratio=0.2, lower=-10.0, upper=10.0), AdaptiveEntropy(init_coef=0.05, max_coef=0.1, gate=False)]


# name -> (RLVRModule arguments, RolloutDataModule arguments, interventions)
CONFIGS = {
    "plain": ({}, {}, list),
    "micro_batches": ({"micro_batch_size": 4}, {}, list),
    "two_minibatches": ({"minibatch_size": 8}, {}, list),
    "two_ppo_epochs": ({"ppo_epochs": 2, "micro_batch_size": 8}, {}, list),
    "kl_k3": ({"kl_coef": 0.05, "micro_batch_size": 8}, {}, list),
    "rloo_dual_clip_seq_mean": ({"advantage": "rloo", "dual_clip": 3.0, "clip_high": 0.28,
                                 "loss_aggregation": "seq-mean-token-sum-norm"}, {}, list),
    "every_hook": ({}, {}, every_hook),
    "every_hook_split": ({"minibatch_size": 8, "micro_batch_size": 4, "kl_coef": 0.05}, {}, every_hook),
    "dynamic_sampling": ({}, {"dynamic_sampling": True, "overlong_buffer": 2}, list),
    "lora": ({"lora": {"rank": 4, "alpha": 8.0}, "learning_rate": 1e-2, "kl_coef": 0.05}, {}, list),
    "lag_1": ({"engine_is_cap": 2.0, "minibatch_size": 8},
              {"max_policy_lag": 1, "engine": lambda: HFEngine(weights="copy")}, list),
}


def platform_key() -> str:
    """What decides float rounding here: the torch build, its CPU kernels, the processor and the threads."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    # The thread count too: float sums split across threads round differently (1 and 2 threads differ by ~1e-8).
    return (f"torch {torch.__version__} | {torch.backends.cpu.get_cpu_capability()} | {platform.machine()} | {cpu} "
            f"| {torch.get_num_threads()} threads")


def fingerprint(module: RLVRModule) -> dict:
    """SHA-256 of the trained parameters' bytes, and float64 projections of them that a tolerance can compare."""
    digest = hashlib.sha256()
    projections = [0.0, 0.0, 0.0]
    generator = torch.Generator().manual_seed(1234)
    for name, p in module.policy.named_parameters():
        if not p.requires_grad:
            continue
        values = p.detach().float().contiguous()
        digest.update(name.encode())
        digest.update(values.numpy().tobytes())
        flat = values.double().flatten()
        direction = torch.randn(flat.numel(), generator=generator, dtype=torch.float64)
        projections[0] += flat.sum().item()
        projections[1] += (flat * flat).sum().item()
        projections[2] += (flat * direction).sum().item()
    return {"sha256": digest.hexdigest(), "projections": projections}


def train(model_dir: str, config: str) -> dict:
    module_args, data_args, interventions = CONFIGS[config]
    data_args = dict(data_args)
    engine = data_args.pop("engine", HFEngine)()
    pl.seed_everything(0, verbose=False)
    data = RolloutDataModule(source=BuiltinTask("addition", warm_start_fraction=0.0), engine=engine,
                             verifier=CallableVerifier(graded), prompts_per_step=PROMPTS, group_size=GROUP,
                             max_new_tokens=4, temperature=1.0, val_samples=0, verifier_workers=1, **data_args)
    module = RLVRModule(model=model_dir, **{"learning_rate": 5e-2, **module_args})
    rows = PROMPTS * GROUP
    updates_per_rollout = module_args.get("ppo_epochs", 1) * -(-rows // module_args.get("minibatch_size", rows))
    logger = MemoryLogger()
    trainer = pl.Trainer(accelerator="cpu", max_steps=ROLLOUT_STEPS * updates_per_rollout, logger=logger,
                         log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                         callbacks=interventions())
    trainer.fit(module, data)
    metrics = {key: {str(step): value for step, value in sorted(by_step.items())}
               for key, by_step in sorted(logger.history.items()) if not key.startswith("perf/")}
    return {**fingerprint(module), "policy_version": module.policy_version, "metrics": metrics}


def load_golden() -> dict:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"platform": None, "runs": {}}


def same_value(recorded: float, measured: float, exact: bool) -> bool:
    if math.isnan(recorded) or math.isnan(measured):
        return math.isnan(recorded) and math.isnan(measured)
    if exact:
        return recorded == measured
    return abs(recorded - measured) <= 1e-4 * max(1.0, abs(recorded))


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_training_matches_the_golden_record(tiny_model_dir, config):
    measured = train(tiny_model_dir, config)
    golden = load_golden()
    if RECORD:  # each run records its platform (the file's: the runs recorded before runs had their own)
        golden["platform"] = golden.get("platform") or platform_key()
        golden["runs"][config] = {**measured, "platform": platform_key()}
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        return
    assert config in golden["runs"], f"no golden record of {config!r}: record it (see the module docstring)"
    recorded = golden["runs"][config]
    exact = recorded.get("platform", golden["platform"]) == platform_key()
    assert measured["policy_version"] == recorded["policy_version"]
    assert sorted(measured["metrics"]) == sorted(recorded["metrics"]), "the logged metric names changed"
    for key, by_step in recorded["metrics"].items():
        assert sorted(measured["metrics"][key]) == sorted(by_step), f"{key} is logged at other steps"
        for step, value in by_step.items():
            assert same_value(value, measured["metrics"][key][step], exact), \
                f"{config}: {key} at step {step} is {measured['metrics'][key][step]!r}, recorded {value!r}"
    for got, want in zip(measured["projections"], recorded["projections"]):
        assert same_value(want, got, exact), f"{config}: parameters moved: projection {got!r}, recorded {want!r}"
    if exact:
        assert measured["sha256"] == recorded["sha256"], f"{config}: the trained parameters are not bit-identical"


def resume_run(ckpt_path: Path | None) -> RLVRModule:
    """The 3-step run the old checkpoint was cut from, from scratch (``None``) or resumed from ``ckpt_path``."""
    pl.seed_everything(0, verbose=False)
    data = RolloutDataModule(source=BuiltinTask("addition"), prompts_per_step=4, group_size=4, max_new_tokens=4,
                             val_samples=0, verifier_workers=1)
    module = RLVRModule(model="builtin:tiny", learning_rate=1e-2, micro_batch_size=8, kl_coef=0.05)
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, callbacks=[AdaptiveEntropy(init_coef=0.005, gate=False)])
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module


def test_a_checkpoint_from_before_the_split_resumes_exactly():
    """The checkpoint loads into today's classes and its run continues to the parameters the uninterrupted run (as
    recorded by the code that wrote it) reached."""
    golden = load_golden()
    if RECORD:
        golden["resume"] = fingerprint(resume_run(None))
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        return
    module = resume_run(OLD_CHECKPOINT)
    assert module.policy_version == 3
    measured, recorded = fingerprint(module), golden["resume"]
    for got, want in zip(measured["projections"], recorded["projections"]):
        assert same_value(want, got, golden["platform"] == platform_key()), "the resumed run ended elsewhere"
    if golden["platform"] == platform_key():
        assert measured["sha256"] == recorded["sha256"]


def test_the_golden_configurations_change_the_parameters():
    """The record is worth guarding only if training moved something: every run applied its updates, and the
    configurations end at different parameters."""
    runs = load_golden()["runs"]
    assert sorted(runs) == sorted(CONFIGS)
    assert len({run["sha256"] for run in runs.values()}) == len(runs)
    for config, run in runs.items():
        assert run["policy_version"] > 0, config
        assert all(v == 0.0 for v in run["metrics"]["policy/skipped_updates"].values()), config
