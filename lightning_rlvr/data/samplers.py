"""The prompt dataset and its resumable shuffles: where training stands in an epoch, so that a resume continues it."""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

from lightning_rlvr.rng import set_rng_state
from lightning_rlvr.tasks import Problem

__all__ = ["ProblemDataset", "ResumableDistributedShuffle", "ResumableShuffle", "as_list", "resumable_shuffle"]


class ProblemDataset(Dataset):
    """A list of problems as a map-style dataset."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems

    def __len__(self) -> int:
        return len(self.problems)

    def __getitem__(self, index: int) -> Problem:
        return self.problems[index]


class ResumableShuffle(Sampler[int]):
    """``RandomSampler`` order (a per-epoch seed drawn from torch's global RNG), plus where the epoch stands.

    It draws exactly what ``RandomSampler(shuffle=True)`` draws, so runs are unchanged by it; after a resume it
    replays the interrupted epoch's permutation from its stored seed, starting after the prompts already trained.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.epoch_seed: int | None = None
        self.consumed = 0  # prompts of the current epoch handed to a rollout
        self._resume: tuple[int, int] | None = None

    def position(self) -> dict:
        return {"epoch_seed": self.epoch_seed, "consumed": self.consumed}

    def resume(self, position: dict, inside_epoch: bool) -> None:
        if inside_epoch:  # else the next epoch's seed is drawn from the (restored) global RNG, as it would have been
            self._resume = (position["epoch_seed"], position["consumed"])

    def __len__(self) -> int:
        return self.size  # the full epoch: Lightning's restored batch counter covers the skipped part

    def __iter__(self):
        if self._resume is not None:
            (seed, start), self._resume = self._resume, None
        else:
            seed, start = int(torch.empty((), dtype=torch.int64).random_().item()), 0
        self.epoch_seed, self.consumed = seed, start
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.order = torch.randperm(self.size, generator=generator).tolist()
        yield from self.order[start:]

    def upcoming(self, count: int) -> list[int] | None:
        """The indices of the next ``count`` prompts of this epoch, or ``None`` past its end."""
        return _upcoming(self, count)

    def resume_from(self, restored: dict, prompts_per_step: int) -> bool:
        """Continue the epoch a checkpoint (a DataModule ``state_dict``) was written in; when it had no full step
        left, set the checkpoint's RNG states so that the next epoch's shuffle draws what it would have drawn.
        Whether the checkpoint's RNG states are used up."""
        return _resume_from(self, restored, prompts_per_step, started="epoch_seed")


class ResumableDistributedShuffle(DistributedSampler):
    """Lightning's ``DistributedSampler`` order (seeded by ``PL_GLOBAL_SEED`` and the epoch, disjoint rank shards),
    plus where the epoch stands, so a multi-rank resume continues the interrupted epoch.

    Being a ``DistributedSampler``, Lightning keeps it instead of injecting its own, and calls ``set_epoch`` on it.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.consumed = 0  # this rank's prompts of the current epoch handed to a rollout
        self.started = False
        self._resume: tuple[int, int] | None = None

    def position(self) -> dict:
        return {"epoch": self.epoch if self.started else None, "seed": self.seed, "consumed": self.consumed}

    def resume(self, position: dict, inside_epoch: bool) -> None:
        self.seed = position["seed"]  # the run's order, even if the resumed process was seeded differently
        if inside_epoch:
            self._resume = (position["epoch"], position["consumed"])

    def __iter__(self):
        start = 0
        if self._resume is not None:
            (epoch, consumed), self._resume = self._resume, None
            start = consumed if epoch == self.epoch else 0
        self.started, self.consumed = True, start
        self.order = list(super().__iter__())
        yield from self.order[start:]

    def upcoming(self, count: int) -> list[int] | None:
        """The indices of this rank's next ``count`` prompts of this epoch, or ``None`` past its end."""
        return _upcoming(self, count)

    def resume_from(self, restored: dict, prompts_per_step: int) -> bool:
        """As :meth:`ResumableShuffle.resume_from`, for this rank's shard."""
        return _resume_from(self, restored, prompts_per_step, started="epoch")


def resumable_shuffle(dataset: ProblemDataset, distributed_sampler_kwargs: dict | None
                      ) -> ResumableShuffle | ResumableDistributedShuffle:
    """The training sampler: one process's shuffle, or this rank's shard of Lightning's distributed order (seeded by
    ``PL_GLOBAL_SEED``) when ``distributed_sampler_kwargs`` (``num_replicas``, ``rank``) are given."""
    if distributed_sampler_kwargs is not None:
        return ResumableDistributedShuffle(dataset, seed=int(os.getenv("PL_GLOBAL_SEED", "0")),
                                           **distributed_sampler_kwargs)
    return ResumableShuffle(len(dataset))


def _resume_from(sampler, restored: dict, prompts_per_step: int, started: str) -> bool:
    if restored.get(started) is None:  # written before the epoch started
        return False
    inside_epoch = restored["consumed"] + prompts_per_step <= len(sampler)
    sampler.resume(restored, inside_epoch)
    if not inside_epoch:
        set_rng_state(restored["rng"])
    return not inside_epoch


def _upcoming(sampler, count: int) -> list[int] | None:
    order = getattr(sampler, "order", None)
    if order is None or sampler.consumed + count > len(order):
        return None
    return order[sampler.consumed : sampler.consumed + count]


def as_list(items: list[Problem]) -> list[Problem]:
    """The collate function: a batch of prompts stays a list of problems (the rollout builds the tensors)."""
    return list(items)
