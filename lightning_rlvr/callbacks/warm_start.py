"""Supervised warm start: a few teacher-forced steps on known answers before RL begins.

RL from a random initialisation learns multi-token answers too slowly for a CPU quickstart
(MEASUREMENTS.md §9: ``a+b=`` with operands 0..49 stays near 0 held-out accuracy after 4 minutes of pure
RL), while 100 supervised steps on 5% of the problems give the policy the format and a held-out accuracy of
≈0.04–0.12 from which GRPO climbs past 0.6. The warm start trains on ``prompt → answer + end`` with the
cross-entropy of the answer tokens only, with its own AdamW (the RL optimizer's state is untouched). The prompt is
the rollouts' own (prompt and chat templates) and ``end`` the DataModule's
:attr:`~lightning_rlvr.data.RolloutDataModule.end_token_id`: the tokenizer's EOS (``<|im_end|>`` for a ChatML
checkpoint), one of the stop ids the rollouts cut at.

It runs once, in ``on_fit_start`` (after the policy is built and placed on its device, before the sanity
validation, so the first logged ``val/accuracy`` is the RL starting point), and never again after a resume:
its ``completed`` flag is part of the checkpoint.

**Reference model.** The warm start plays the role of SFT, and RLHF's reference is the SFT model, not the
checkpoint before it: with ``reset_reference=True`` (default) a frozen reference (loaded for a KL term or for an
intervention that reads reference log-probs, e.g. EP-GRPO) is set to the warmed-up policy, so ``KL = 0`` and
``log π − log π_ref = 0`` where RL begins. Left at the pre-warm-start weights, the log-ratio is large from step 0
(EP-GRPO's ``tanh(d/τ)`` saturates at ±1 on every token). Checkpoints never hold the reference (it is rebuilt
from ``model`` on load), so after a resume the warm start is replayed *on the reference only*, with the same
seed, inside a forked RNG (the training run's random streams are untouched); a fingerprint of the reference
stored in the checkpoint checks the replay (bitwise on CPU; on GPU non-deterministic kernels may differ
slightly, which is reported as a warning).

**LoRA policies** (``RLVRModule(lora=...)``) have no reference model: their reference is the policy with its
adapter switched off. The warm start trains the adapter. With ``reset_reference=True`` it is then merged into the
base weights and RL starts a fresh adapter, so the reference (adapter off) is the warmed-up policy, as above; the
module keeps the merged adapter and merges it again when a checkpoint is loaded (no replay). With
``reset_reference=False`` RL continues the warm-start adapter and the reference stays the checkpoint before it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_rlvr.lora import adapter_state, is_lora, merge_adapter_state, reset_adapter
from lightning_rlvr.sharding import is_dtensor, is_sharded

__all__ = ["SupervisedWarmStart"]


class SupervisedWarmStart(Callback):
    """Teacher-forced warm start on the prompt source's ``warm_start_problems()``.

    Args:
        steps: optimizer steps (0 disables).
        batch_size: examples per step (sampled with replacement from the warm-start problems).
        learning_rate: AdamW learning rate of the warm start.
        seed: sampling seed (identical on every rank, so DDP replicas stay identical).
        reset_reference: set a loaded frozen reference model to the warmed-up policy (module docstring);
            ``False`` keeps the reference at the pre-warm-start weights.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[SupervisedWarmStart(steps=100)], logger=False)
    """

    def __init__(self, steps: int = 100, batch_size: int = 64, learning_rate: float = 1e-3, seed: int = 0,
                 reset_reference: bool = True) -> None:
        if steps < 0:
            raise ValueError(f"SupervisedWarmStart: steps must be >= 0, got {steps}")
        if batch_size < 1:
            raise ValueError(f"SupervisedWarmStart: batch_size must be >= 1, got {batch_size}")
        if learning_rate <= 0:
            raise ValueError(f"SupervisedWarmStart: learning_rate must be > 0, got {learning_rate}")
        self.steps = steps
        self.batch_size = batch_size
        self.learning_rate = learning_rate
        self.seed = seed
        self.reset_reference = bool(reset_reference)
        self.completed = False
        self.final_loss: float | None = None
        self.reference_fingerprint: list[float] | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(steps=self.steps, batch_size=self.batch_size, learning_rate=self.learning_rate)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"completed": self.completed, "final_loss": self.final_loss,
                "reference_fingerprint": self.reference_fingerprint}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.completed = bool(state_dict["completed"])
        self.final_loss = state_dict.get("final_loss")
        self.reference_fingerprint = state_dict.get("reference_fingerprint")

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.steps == 0:
            return
        if isinstance(trainer.strategy, DeepSpeedStrategy):
            # Its own AdamW over the policy's parameters would see no gradients: DeepSpeed keeps them in its
            # partitions and steps only its own optimizer.
            raise ValueError("SupervisedWarmStart does not run under DeepSpeedStrategy: warm-start the model "
                             "beforehand (e.g. one process, or DDP/FSDP) and train from that checkpoint")
        policy = pl_module.policy
        merge_into_base = is_lora(policy) and self.reset_reference
        if merge_into_base and is_sharded(policy):
            raise ValueError("SupervisedWarmStart(reset_reference=True) merges a LoRA policy's warm-start adapter into "
                             "its base weights, which are sharded here: warm-start without sharding, or pass "
                             "reset_reference=False (the adapter keeps the warm start; the reference: the checkpoint)")
        reference = getattr(pl_module, "ref_model", None) if self.reset_reference else None
        if self.completed:  # a LoRA policy's merged warm start came back with the checkpoint (RLVRModule)
            if reference is not None:
                self._replay_on_reference(trainer, pl_module, reference)
            return
        problems = self._problems(trainer)
        self.final_loss = self.fit(policy, pl_module.tokenizer, problems, trainer.datamodule.prompt_ids,
                                   trainer.datamodule.end_token_id)
        pl_module.policy_version += 1  # weights changed: engines with their own copy must resync
        if reference is not None:
            reference.load_state_dict(policy.state_dict())
            self.reference_fingerprint = fingerprint(reference)
        if merge_into_base:
            # The warmed-up policy becomes the base (the reference, adapter off) and RL trains a fresh adapter; the
            # adapter merged is kept by the module and merged again when a checkpoint is loaded.
            state = adapter_state(policy)
            merge_adapter_state(policy, state)
            reset_adapter(policy, pl_module.hparams.lora["seed"])
            pl_module.merged_adapters.append(state)
        self.completed = True
        becomes = "; reference = warmed-up policy" if reference is not None or merge_into_base else ""
        rank_zero_info(f"SupervisedWarmStart: {self.steps} steps on {len(problems)} problems, "
                       f"final loss {self.final_loss:.3f}{becomes}")

    @staticmethod
    def _problems(trainer: "pl.Trainer") -> list:
        problems = trainer.datamodule.source.warm_start_problems()
        if not problems:
            raise ValueError("SupervisedWarmStart: the prompt source has no warm-start problems "
                             "(set warm_start_fraction > 0)")
        return problems

    def _replay_on_reference(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                             reference: torch.nn.Module) -> None:
        """After a resume: rebuild the post-warm-start reference by replaying the warm start on it."""
        device = next(reference.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            trainable = {name for name, p in pl_module.policy.named_parameters() if p.requires_grad}
            for name, parameter in reference.named_parameters():  # the same parameters train as in the original
                parameter.requires_grad_(name in trainable)
            try:
                self.fit(reference, pl_module.tokenizer, self._problems(trainer), trainer.datamodule.prompt_ids,
                         trainer.datamodule.end_token_id)
            finally:
                reference.requires_grad_(False).eval()
        replayed = fingerprint(reference)
        if self.reference_fingerprint is not None and replayed != self.reference_fingerprint:
            rank_zero_warn(f"SupervisedWarmStart: the replayed reference differs from the original run's "
                           f"(fingerprint {replayed} vs {self.reference_fingerprint}); non-deterministic kernels "
                           f"make the replay inexact, so KL / reference log-ratios differ slightly after this resume")

    def fit(self, policy: torch.nn.Module, tokenizer, problems, prompt_ids: Callable | None = None,
            end_token_id: int | None = None) -> float:
        """Run the warm start on ``policy``; returns the last step's loss.

        ``prompt_ids(problem)`` gives the prompt tokens exactly as the rollouts see them (the DataModule's
        :meth:`~lightning_rlvr.data.RolloutDataModule.prompt_ids`: prompt template, chat template); by default the
        bare prompt with the tokenizer's special tokens. ``end_token_id`` ends every answer (the DataModule's
        :attr:`~lightning_rlvr.data.RolloutDataModule.end_token_id`, a stop id); by default the tokenizer's EOS.
        """
        end_token_id = tokenizer.eos_token_id if end_token_id is None else end_token_id
        device = next(policy.parameters()).device
        examples = []
        for problem in problems:
            prompt = (prompt_ids(problem) if prompt_ids is not None
                      else tokenizer(problem.prompt, add_special_tokens=True).input_ids)
            answer = tokenizer(problem.answer, add_special_tokens=False).input_ids + [end_token_id]
            examples.append((prompt, answer))
        pad = tokenizer.pad_token_id
        optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=self.learning_rate)
        generator = torch.Generator().manual_seed(self.seed)
        was_training = policy.training
        policy.train()
        loss = torch.tensor(float("nan"))
        for _ in range(self.steps):
            picks = torch.randint(len(examples), (self.batch_size,), generator=generator).tolist()
            rows = [examples[i][0] + examples[i][1] for i in picks]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            attention = torch.zeros_like(ids)
            labels = torch.full_like(ids, -100)
            for j, i in enumerate(picks):
                prompt, answer = examples[i]
                start = width - len(prompt) - len(answer)  # left padding, as at generation time
                ids[j, start:] = torch.tensor(prompt + answer)
                attention[j, start:] = 1
                labels[j, width - len(answer):] = torch.tensor(answer)
            ids, attention, labels = ids.to(device), attention.to(device), labels.to(device)
            positions = (attention.cumsum(-1) - 1).clamp_min(0)
            logits = policy(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        policy.train(was_training)
        return float(loss.detach())


def fingerprint(module: torch.nn.Module) -> list[float]:
    """``[Σθ, Σ|θ|, Σθ²]`` over all parameters in float64: equal for bitwise-equal weights, cheap to store.

    FSDP2 shards are gathered first (a collective: every rank calls it).
    """
    flat = [(p.full_tensor() if is_dtensor(p) else p).detach().double() for p in module.parameters()]
    return [float(sum(p.sum() for p in flat)), float(sum(p.abs().sum() for p in flat)),
            float(sum(p.square().sum() for p in flat))]
