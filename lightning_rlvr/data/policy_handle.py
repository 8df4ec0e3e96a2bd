"""What the DataModule needs of the policy being trained, handed to it once per fit instead of read off the trainer."""

from __future__ import annotations

from typing import Protocol

import torch

from lightning_rlvr.rollout.base import RolloutEngine

__all__ = ["EngineWeights", "PolicyHandle"]


class PolicyHandle(Protocol):
    """The policy as the rollout sees it (:class:`~lightning_rlvr.RLVRModule` is one).

    Attributes:
        policy: the model the engine generates with, or copies its weights from.
        policy_version: counts the optimizer steps applied to ``policy``; a rollout records the version it came from.
        device: where the policy's tensors live.
    """

    policy: torch.nn.Module | None
    policy_version: int

    @property
    def device(self) -> torch.device: ...

    def wants_behaviour_stats(self) -> bool:
        """Whether the step would run a no-grad pass for the behaviour policy's statistics that the engine can
        compute while decoding instead."""
        ...

    def rollout_steps_left(self) -> int | None:
        """Rollout steps left in the fit, the current one included (``None``: unbounded); the background queue of
        ``max_policy_lag`` generates no rollout past them."""
        ...


class EngineWeights:
    """The policy version the engine holds, so that weights are pushed only when they changed."""

    def __init__(self) -> None:
        self.version: int | None = None  # None: the engine holds no weights of ours (not synced yet, or closed)

    def sync(self, engine: RolloutEngine, handle: PolicyHandle) -> int:
        """Push the policy into ``engine`` if its version moved; the version the engine generates with."""
        version = int(handle.policy_version)
        if self.version != version:
            engine.sync(handle.policy, version)
            self.version = version
        return version
