"""Shared fixtures: the tiny offline model saved once per session, a scripted engine, an in-memory logger."""

from __future__ import annotations

import os
import types

import pytest
import torch

from lightning_rlvr.data.sources import PromptSource
from lightning_rlvr.loggers import InMemoryLogger
from lightning_rlvr.models import TinyModelConfig, build_tiny_chat_model, build_tiny_model
from lightning_rlvr.rollout.base import GenerationOutput, RolloutEngine, SamplingConfig

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A saved tiny Llama + char tokenizer directory (loaded with from_pretrained like a real checkpoint)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), TinyModelConfig(seed=0))


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory) -> str:
    """A saved ``builtin:tiny-chat`` checkpoint: Qwen2, byte-level BPE, ChatML, stop ids [<|im_end|>, <|endoftext|>]."""
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


MemoryLogger = InMemoryLogger


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """Destroy a default process group a test initialised in the pytest process (a one-device FSDP fit does).

    The two-rank tests fork this process (tests/two_ranks.py): a forked rank would inherit the group as initialised,
    skip joining its own, and wait forever in its first collective.
    """
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture
def memory_logger() -> MemoryLogger:
    return MemoryLogger()


class ScriptedEngine(RolloutEngine):
    """Returns pre-scripted completion token ids (one list per generated row), cycling through a script."""

    def __init__(self, completions: list[list[int]], pad_id: int = 0) -> None:
        self.completions = completions
        self.pad_id = pad_id
        self.calls: list[tuple[int, int]] = []
        self.synced: list[int] = []
        self._cursor = 0

    def sync(self, policy, version: int) -> None:
        self.synced.append(version)

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> GenerationOutput:
        self.calls.append((len(prompts), n))
        rows = []
        for _ in range(len(prompts) * n):
            rows.append(self.completions[self._cursor % len(self.completions)])
            self._cursor += 1
        # Like a real engine: each row ends at its first stop id or at the generation limit.
        ids, lengths, stopped = self.right_pad([r[: sampling.max_new_tokens] for r in rows], self.pad_id,
                                               sampling.stop_token_ids)
        prompt_ids, prompt_mask = self.left_pad(prompts, self.pad_id)
        return GenerationOutput(prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0), ids,
                                lengths, stopped)


class ListSource(PromptSource):
    """The same given problems for training and held out."""

    def __init__(self, problems):
        self.problems = problems

    def train_problems(self):
        return self.problems

    def held_out_problems(self):
        return self.problems


def fake_policy(policy=None, policy_version: int = 0):
    """A :class:`~lightning_rlvr.data.policy_handle.PolicyHandle` without a LightningModule: what
    ``RolloutDataModule.connect(..., policy=...)`` needs of the policy outside a fit."""
    return types.SimpleNamespace(policy=policy, policy_version=policy_version, device=torch.device("cpu"),
                                 wants_behaviour_stats=lambda: False, rollout_steps_left=lambda: None)
