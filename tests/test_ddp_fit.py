"""A 2-process CPU DDP fit (gloo) with global batch B makes the same losses and parameter update as one process."""

from __future__ import annotations

import os
import socket

import lightning.pytorch as pl
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from lightning_rlvr import RLVRModule, RolloutDataModule
from lightning_rlvr.callbacks import ClipCov, TopEntropyTokens
from lightning_rlvr.data.sources import PromptSource
from lightning_rlvr.loggers import InMemoryLogger
from lightning_rlvr.rollout.base import GenerationOutput, RolloutEngine
from lightning_rlvr.tasks import Problem
from lightning_rlvr.verifiers import CallableVerifier

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
        return GenerationOutput(prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0), ids)


class Digits(PromptSource):
    def train_problems(self):
        return [Problem(f"{i}{i + 3}=", str(i)) for i in range(PROMPTS)]

    def held_out_problems(self):
        return []


def odd_length(completion: str, answer: str) -> float:
    return float(len(completion) % 2)


class RankShards(RolloutDataModule):
    """Rank r trains prompts [r·B/W, (r+1)·B/W) every step: one process sees the same global batch in rank order."""

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        problems = self.source.train_problems()
        share = len(problems) // world
        return DataLoader([problems[rank * share:(rank + 1) * share]] * STEPS, batch_size=None, collate_fn=list)


def fit(model_dir: str, world: int, logger=None) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    module = RLVRModule(model=model_dir, learning_rate=1e-2, max_grad_norm=0.05)  # clipping active: the norm matters
    token_ids = [module.tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]
    engine = PromptSeededEngine(token_ids, module.tokenizer.eos_token_id, module.tokenizer.pad_token_id)
    data = RankShards(source=Digits(), engine=engine, verifier=CallableVerifier(odd_length), prompts_per_step=PROMPTS // world,
                      group_size=GROUP, max_new_tokens=4, val_samples=0)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", max_steps=STEPS,
                         logger=logger or False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
                         use_distributed_sampler=False,
                         callbacks=[TopEntropyTokens(ratio=0.5), ClipCov(ratio=0.2, lower=-1.0, upper=5.0, seed=3)])
    trainer.fit(module, data)
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


def worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    logger = InMemoryLogger()
    weights = fit(model_dir, 2, logger)
    torch.save({"weights": weights, "history": logger.history}, os.path.join(out_dir, f"rank{rank}.pt"))


def test_two_process_ddp_equals_one_process_with_the_global_batch(tiny_model_dir, tmp_path):
    logger = InMemoryLogger()
    single = fit(tiny_model_dir, 1, logger)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, tiny_model_dir, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]  # our own files
    initial = RLVRModule(model=tiny_model_dir)
    initial.configure_model()
    moved = max((single[k] - v).abs().max().item() for k, v in initial.policy.state_dict().items())
    assert moved > 1e-4  # the update is not trivially zero
    for k, v in single.items():
        for r in ranks:
            torch.testing.assert_close(r["weights"][k], v, rtol=1e-4, atol=1e-6)
    h = logger.history
    assert any(h["reward/mean"][s] not in (0.0, 1.0) for s in h["reward/mean"])  # informative groups
    assert all(h["clip_cov/selected_fraction"][s] > 0 for s in range(STEPS))  # Clip-Cov detaches tokens
    assert all(0 < h["top_entropy/selected_fraction"][s] < 1 for s in range(STEPS))
    for key in ("loss/pg", "loss/total", "policy/grad_norm", "policy/clipfrac_high", "policy/ppo_kl", "reward/mean"):
        for step in range(STEPS):
            assert abs(ranks[0]["history"][key][step] - h[key][step]) <= 1e-5 + 1e-4 * abs(h[key][step]), key
