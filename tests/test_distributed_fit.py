"""2-process CPU fits (gloo) under DDP and FSDP2 (Lightning's ModelParallelStrategy).

- With global batch B they make the same losses and parameter update as one process with batch B (under FSDP2 the
  policy and the reference are sharded, parameters gathered by forward hooks, gradients reduce-scattered).
- An FSDP2 checkpoint holds no reference weights, loads with ``weights_only=True`` (single-file) and a resumed run
  continues exactly as the uninterrupted one (single-file and distributed checkpoints).
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
from lightning_rlvr.callbacks import ClipCov, SupervisedWarmStart, TopEntropyTokens
from lightning_rlvr.data.sources import PromptSource
from lightning_rlvr.loggers import InMemoryLogger
from lightning_rlvr.lora import merged_weights
from lightning_rlvr.rollout import HFEngine
from lightning_rlvr.rollout.base import GenerationOutput, RolloutEngine
from lightning_rlvr.sharding import full_weights, is_sharded
from lightning_rlvr.tasks import Problem
from lightning_rlvr.verifiers import CallableVerifier
from tests.two_ranks import distributed_worker, free_port, spawn_two, start_two

pytestmark = pytest.mark.slow  # multi-process or subprocess runs (deselect with -m "not slow")

PROMPTS, GROUP, STEPS = 8, 4, 2


class PromptSeededEngine(RolloutEngine):
    """Completions a function of (prompt, sample index) only, so they do not depend on how ranks split prompts."""

    def __init__(self, token_ids: list[int], eos_id: int, pad_id: int) -> None:
        self.token_ids, self.eos_id, self.pad_id = token_ids, eos_id, pad_id

    def sync(self, policy, version: int) -> None:
        pass

    def generate(self, prompts, n, sampling) -> GenerationOutput:
        rows = []
        for prompt in prompts:
            generator = torch.Generator().manual_seed(sum((i + 1) * t for i, t in enumerate(prompt)))
            for _ in range(n):
                length = int(torch.randint(1, 4, (1,), generator=generator))
                picks = torch.randint(len(self.token_ids), (length,), generator=generator).tolist()
                rows.append([self.token_ids[i] for i in picks] + [self.eos_id])
        ids = torch.full((len(rows), 4), self.pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        prompt_ids, prompt_mask = self.left_pad(prompts, self.pad_id)
        return GenerationOutput(prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0), ids,
                                lengths=torch.tensor([len(row) for row in rows]),  # every row ends on its EOS
                                stopped=torch.ones(len(rows), dtype=torch.bool))


class Digits(PromptSource):
    def train_problems(self):
        return [Problem(f"{i}{i + 3}=", str(i)) for i in range(PROMPTS)]

    def held_out_problems(self):
        return []

    def warm_start_problems(self):
        return self.train_problems()


def odd_length(completion: str, answer: str) -> float:
    return float(len(completion) % 2)


class RankShards(RolloutDataModule):
    """Rank r trains prompts [r·B/W, (r+1)·B/W) every step: one process sees the same global batch in rank order."""

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        problems = self.source.train_problems()
        share = len(problems) // world
        return DataLoader([problems[rank * share:(rank + 1) * share]] * 8, batch_size=None, collate_fn=list)


def strategy_for(name: str, world: int, distributed_checkpoint: bool = False):
    if world == 1:
        return "auto"
    if name == "fsdp":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                     save_distributed_checkpoint=distributed_checkpoint)
    return "ddp"


def fit(model_dir: str, world: int, strategy: str = "ddp", logger=None, max_steps: int = STEPS,
        extra_callbacks: tuple = (), ckpt_path: str | None = None,
        distributed_checkpoint: bool = False, lora: dict | None = None) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    # Clipping active (the global norm matters) and a KL term (the reference is sharded too under FSDP).
    # Full rows in every run: FSDP2 turns the shared-prompt forward off, and at lr 1e-2 Adam (dividing by sqrt(v))
    # turns its different float rounding on a near-zero gradient into ~1e-5 on one parameter (tested on its own in
    # tests/ops/test_shared_prompt.py and test_module.py).
    module = RLVRModule(model=model_dir, learning_rate=1e-2, max_grad_norm=0.05, kl_coef=0.05,
                        share_prompt_forward=False, lora=lora)
    token_ids = [module.tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]
    engine = PromptSeededEngine(token_ids, module.tokenizer.eos_token_id, module.tokenizer.pad_token_id)
    data = RankShards(source=Digits(), engine=engine, verifier=CallableVerifier(odd_length),
                      prompts_per_step=PROMPTS // world, group_size=GROUP, max_new_tokens=4, val_samples=0)
    trainer = pl.Trainer(accelerator="cpu", devices=world,
                         strategy=strategy_for(strategy, world, distributed_checkpoint), max_steps=max_steps,
                         logger=logger or False, enable_checkpointing=bool(extra_callbacks), enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
                         use_distributed_sampler=False,
                         callbacks=[TopEntropyTokens(ratio=0.5), ClipCov(ratio=0.2, lower=-1.0, upper=5.0, seed=3),
                                    *extra_callbacks])
    trainer.fit(module, data, ckpt_path=ckpt_path)
    assert is_sharded(module.policy) == (strategy == "fsdp" and world > 1)
    if lora is None:
        assert module.ref_model is not None and is_sharded(module.ref_model) == is_sharded(module.policy)
    else:  # the reference is the policy with its adapter off
        assert module.ref_model is None
    # full_weights / merged_weights gather FSDP2 shards (a collective on every rank); the identity on a replicated
    # policy (merged: W + scale·B·A under the base model's names).
    weights = merged_weights if lora is not None else full_weights
    return {name: tensor.detach().clone() for bucket in weights(module.policy, bucket_bytes=4096)
            for name, tensor in bucket}


@distributed_worker
def worker(rank: int, port: int, model_dir: str, out_dir: str, strategy: str, lora: dict | None = None) -> None:
    logger = InMemoryLogger()
    weights = fit(model_dir, 2, strategy, logger, lora=lora)
    torch.save({"weights": weights, "history": logger.history}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_process_fit_equals_one_process_with_the_global_batch(strategy, tiny_model_dir, tmp_path):
    logger = InMemoryLogger()
    single = fit(tiny_model_dir, 1, logger=logger)
    spawn_two(worker, tiny_model_dir, str(tmp_path), strategy)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]  # our own files
    initial = RLVRModule(model=tiny_model_dir)
    initial.configure_model()
    moved = max((single[k] - v).abs().max().item() for k, v in initial.policy.named_parameters())
    assert moved > 1e-4  # the update is not trivially zero
    for k, v in single.items():
        for r in ranks:
            torch.testing.assert_close(r["weights"][k], v, rtol=1e-4, atol=1e-6)
    h = logger.history
    assert any(h["reward/mean"][s] not in (0.0, 1.0) for s in h["reward/mean"])  # informative groups
    assert all(h["clip_cov/selected_fraction"][s] > 0 for s in range(STEPS))  # Clip-Cov detaches tokens
    assert all(0 < h["top_entropy/selected_fraction"][s] < 1 for s in range(STEPS))
    for key in ("loss/pg", "loss/kl", "loss/total", "policy/grad_norm", "policy/clipfrac_high", "policy/ppo_kl",
                "reward/mean"):
        for step in range(STEPS):
            assert abs(ranks[0]["history"][key][step] - h[key][step]) <= 1e-5 + 1e-4 * abs(h[key][step]), key


@distributed_worker
def checkpoint_worker(rank: int, port: int, model_dir: str, out_dir: str, distributed: bool, resume: bool) -> None:
    logger = InMemoryLogger()
    run = "resumed" if resume else "full"
    callbacks = (SupervisedWarmStart(steps=2, batch_size=4),  # the reference = warmed-up policy, replayed on resume
                 ModelCheckpoint(dirpath=os.path.join(out_dir, run), every_n_train_steps=1, save_top_k=-1))
    ckpt_path = os.path.join(out_dir, "full", "epoch=0-step=2.ckpt") if resume else None
    weights = fit(model_dir, 2, "fsdp", logger, max_steps=3, extra_callbacks=callbacks, ckpt_path=ckpt_path,
                  distributed_checkpoint=distributed)
    torch.save({"weights": weights, "history": logger.history}, os.path.join(out_dir, f"{run}{rank}.pt"))


@pytest.mark.parametrize("distributed", [False, True], ids=["single_file", "distributed"])
def test_fsdp_checkpoint_has_no_reference_and_resumes_exactly(distributed, tiny_model_dir, tmp_path):
    for resume in (False, True):
        spawn_two(checkpoint_worker, tiny_model_dir, str(tmp_path), distributed, resume)
    checkpoint = tmp_path / "full" / "epoch=0-step=2.ckpt"
    if distributed:  # a folder: one shard file per rank + Lightning's metadata
        from torch.distributed.checkpoint import FileSystemReader

        keys = list(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    else:
        state = torch.load(checkpoint, weights_only=True)  # safe loading: tensors and plain containers only
        keys = list(state["state_dict"])
        assert state["policy_version"] == 3  # 2 updates + the warm start
    assert any(".policy." in f".{k}" for k in keys)
    assert not any("ref_model" in k for k in keys), [k for k in keys if "ref_model" in k][:3]
    for rank in range(2):
        full = torch.load(tmp_path / f"full{rank}.pt", weights_only=False)  # our own files
        resumed = torch.load(tmp_path / f"resumed{rank}.pt", weights_only=False)
        for key, value in full["weights"].items():
            torch.testing.assert_close(resumed["weights"][key], value, rtol=0, atol=0)
        assert set(resumed["history"]["loss/kl"]) == {2}
        for key, values in resumed["history"].items():
            if key.startswith("perf/"):
                continue  # wall-clock seconds
            assert repr(values[2]) == repr(full["history"][key][2]), key
    assert full["history"]["loss/kl"][2] > 0  # the reference (rebuilt by the replayed warm start) matters


class SplitAnswers(Digits):
    """Rank 0's prompts never score (its first round keeps no group: it refills); rank 1's reward odd lengths."""

    def train_problems(self):
        return [Problem(f"{i}{i + 3}=", "never" if i < PROMPTS // 2 else "odd") for i in range(PROMPTS)]


def odd_if_asked(completion: str, answer: str) -> float:
    return float(answer == "odd" and len(completion) % 2 == 1)


class CollectiveScriptedEngine(PromptSeededEngine):
    """Runs the sharded policy's own ``generate`` (the collective) but returns prompt-seeded completions, so each
    rank's number of dynamic-sampling rounds is known in advance."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.hf = HFEngine()

    def sync(self, policy, version: int) -> None:
        self.hf.sync(policy, version)

    def generate(self, prompts, n, sampling) -> GenerationOutput:
        self.hf.generate(prompts, n, sampling)
        return super().generate(prompts, n, sampling)


class RoundRecorder(RankShards):
    def rollout(self, problems):
        batch = super().rollout(problems)
        self.rounds.append(batch.stats["rollout/generation_rounds"])
        return batch


@distributed_worker
def lockstep_worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    pl.seed_everything(rank, verbose=False)  # ranks sample differently, as they would in a real run
    module = RLVRModule(model=model_dir)
    token_ids = [module.tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]
    engine = CollectiveScriptedEngine(token_ids, module.tokenizer.eos_token_id, module.tokenizer.pad_token_id)
    data = RoundRecorder(source=SplitAnswers(), engine=engine, verifier=CallableVerifier(odd_if_asked),
                         prompts_per_step=PROMPTS // 2, group_size=8, max_new_tokens=4, val_samples=0,
                         dynamic_sampling=True, max_generation_rounds=3)
    data.rounds = []
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy_for("fsdp", 2), max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False)
    trainer.fit(module, data)
    torch.save(data.rounds, os.path.join(out_dir, f"rounds{rank}.pt"))


def test_fsdp_dynamic_sampling_with_uneven_rounds_does_not_hang(tiny_model_dir, tmp_path):
    try:  # the fit takes seconds; a rank waiting for a generation round that never comes hangs
        start_two(lockstep_worker, (free_port(), tiny_model_dir, str(tmp_path)), deadline_s=180)
    except TimeoutError:
        pytest.fail("a 2-rank FSDP fit with dynamic sampling did not finish in 180 s (ranks out of step)")
    rounds = [torch.load(tmp_path / f"rounds{rank}.pt") for rank in range(2)]
    assert all(r >= 2 for r in rounds[0])  # rank 0 always refills
    assert any(r0 != r1 for r0, r1 in zip(*rounds)), rounds  # so ranks needed different numbers of rounds


class RankNoise(pl.Callback):
    """Ranks sample differently, as they drift apart in a real run (Lightning seeds every rank alike)."""

    def __init__(self, base: int) -> None:
        self.base = base

    def on_train_start(self, trainer, pl_module) -> None:
        torch.manual_seed(self.base + trainer.global_rank)


class PromptRecorder(RolloutDataModule):
    def rollout(self, problems):
        self.seen.append([p.prompt for p in problems])
        return super().rollout(problems)


@distributed_worker
def resume_worker(rank: int, port: int, model_dir: str, out_dir: str, strategy: str, resume: bool) -> None:
    pl.seed_everything(123 if resume else 0, verbose=False)  # the resumed processes are seeded differently
    run = "resumed" if resume else "full"
    # The real prompt order (the DataModule's rank-aware sampler) and the real sampling engine (global RNG).
    data = PromptRecorder(source=BuiltinTask("addition", warm_start_fraction=0.0), prompts_per_step=4, group_size=4,
                          max_new_tokens=4, val_samples=0)
    data.seen = []
    logger = InMemoryLogger()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy_for(strategy, 2), max_steps=4, logger=logger,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, log_every_n_steps=1,
                         callbacks=[TopEntropyTokens(ratio=0.5), RankNoise(2000 if resume else 1000),
                                    ModelCheckpoint(dirpath=os.path.join(out_dir, run), every_n_train_steps=1,
                                                    save_top_k=-1)])
    ckpt_path = os.path.join(out_dir, "full", "epoch=0-step=2.ckpt") if resume else None
    trainer.fit(RLVRModule(model=model_dir, learning_rate=1e-3), data, ckpt_path=ckpt_path)
    torch.save({"history": logger.history, "seen": data.seen}, os.path.join(out_dir, f"{run}{rank}.pt"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_multi_rank_resume_continues_the_epoch_exactly(strategy, tiny_model_dir, tmp_path):
    for resume in (False, True):
        spawn_two(resume_worker, tiny_model_dir, str(tmp_path), strategy, resume)
    full = [torch.load(tmp_path / f"full{rank}.pt", weights_only=False) for rank in range(2)]  # our own files
    resumed = [torch.load(tmp_path / f"resumed{rank}.pt", weights_only=False) for rank in range(2)]
    assert not set(sum(full[0]["seen"], [])) & set(sum(full[1]["seen"], []))  # disjoint rank shards
    for rank in range(2):
        assert resumed[rank]["seen"] == full[rank]["seen"][2:]  # mid-epoch: the same prompts, not a new epoch
        history = resumed[rank]["history"]
        assert set(history["loss/pg"]) == {2, 3}
        for key, values in history.items():  # every rank's RNG state restored: identical sampling and losses
            if key.startswith("perf/"):
                continue  # wall-clock seconds
            expected = {s: repr(full[rank]["history"][key][s]) for s in values}
            assert {s: repr(v) for s, v in values.items()} == expected, key


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_process_lora_fit_equals_one_process(strategy, tiny_model_dir, tmp_path):
    """A frozen base (sharded under FSDP2), a trained adapter, the reference with the adapter off: 2 ranks = 1."""
    pytest.importorskip("peft")
    lora = {"rank": 4, "alpha": 8.0}
    logger = InMemoryLogger()
    single = fit(tiny_model_dir, 1, logger=logger, lora=lora)
    spawn_two(worker, tiny_model_dir, str(tmp_path), strategy, lora)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]  # our own files
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert max((single[k] - v).abs().max().item() for k, v in initial.items()) > 1e-4  # the adapter moved
    for k, v in single.items():
        for r in ranks:
            torch.testing.assert_close(r["weights"][k], v, rtol=1e-4, atol=1e-6)
    h = logger.history
    assert h["loss/kl"][0] == 0.0 and h["loss/kl"][STEPS - 1] > 0
    for key in ("loss/pg", "loss/kl", "policy/grad_norm", "reward/mean"):
        for step in range(STEPS):
            assert abs(ranks[0]["history"][key][step] - h[key][step]) <= 1e-5 + 1e-4 * abs(h[key][step]), key
