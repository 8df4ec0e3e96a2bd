"""Asynchronous rollouts (``RolloutDataModule(max_policy_lag=k)``, ``k >= 1``): generation overlaps training.

At each step the batch generated in the background for it is trained on, and the queue of background generations is
topped up to the next ``k`` steps (their prompts are known from the resumable shuffle's order; the first step of an
epoch has none ahead). The newest one is generated with the weights as they are at the start of this step, so a step
trains on a rollout of a policy at most ``k`` steps old.

The generations run one after the other in a background thread on the engine's own copy of the weights, each with a
``torch.Generator`` of its own (``HFEngine(weights="copy")`` decodes in that thread, sharing the interpreter with
training; a ``ProcessEngine`` decodes in its own process while the thread waits). With ``k > 1`` a generation queued
behind others gets a snapshot of the policy (a deep copy, up to ``k − 1`` alive at once), synced into the engine right
before it runs. The batch's ``engine_logprobs`` are the generating policy's log-probs and it carries no behaviour
statistics, so the trainer's old policy is the current one and ``RLVRModule(engine_is_cap=...)`` importance-corrects
the staleness. Anything else that uses the engine (validation, probes, a checkpoint) waits for the background
generations first. Under DDP each rank runs its own background generations on its own engine; the background does no
collective (the reward-component names are united over ranks when the batch is built, in the training thread). A
policy sharded across ranks (FSDP2, ZeRO-3) cannot be copied into ``HFEngine`` or ``ProcessEngine``;
``VLLMServerEngine`` gathers its weights for the push (a collective, in the training thread), so it takes a lag of 1.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from lightning_rlvr.data.batch import RolloutBatch
from lightning_rlvr.data.policy_handle import EngineWeights, PolicyHandle
from lightning_rlvr.data.scoring import GeneratedRollout
from lightning_rlvr.rollout.base import RolloutEngine, SamplingConfig
from lightning_rlvr.tasks import Problem

__all__ = ["LaggedRollouts"]

#: ``generate(problems, version, sampling)``: one rollout's rounds with the engine's current weights.
Generate = Callable[[list[Problem], int, SamplingConfig], GeneratedRollout]


@dataclass
class _Prefetch:
    """A rollout generating in the background for an upcoming step's prompts."""

    problems: list[Problem]
    future: Future

    def matches(self, problems: list[Problem]) -> bool:
        return [(p.prompt, p.answer) for p in self.problems] == [(p.prompt, p.answer) for p in problems]


class LaggedRollouts:
    """The queue of background generations for the next ``lag`` steps, in step order.

    Args:
        lag: ``k``, the most steps a rollout's policy may trail the one that trains on it.
        seed: seeds the background generations' samplers (``seed · 1000003 + n`` for the ``n``-th generation).
        engine: generates; it holds its own weights.
        weights: what the engine holds.
        generate: one rollout's rounds.
    """

    def __init__(self, lag: int, seed: int, engine: RolloutEngine, weights: EngineWeights, generate: Generate) -> None:
        self.lag = lag
        self.seed = seed
        self.engine = engine
        self.weights = weights
        self.generate = generate
        self.generations = 0  # background generations so far: each one's sampler seed
        self.pending: deque[_Prefetch] = deque()
        self._executor: ThreadPoolExecutor | None = None

    def take(self, problems: list[Problem], handle: PolicyHandle, sampling: SamplingConfig) -> GeneratedRollout:
        """This step's rollout: generated ahead when an earlier step foresaw these prompts, else now."""
        pending = self.pending.popleft() if self.pending else None
        if pending is not None and pending.matches(problems):
            return pending.future.result()  # re-raises what went wrong in the background
        # prompts not foreseen (never expected): what was generated ahead is dropped
        for dropped in ([pending] if pending is not None else []) + list(self.pending):
            dropped.future.exception()
        self.pending.clear()
        return self.submit(problems, handle, sampling).result()

    def top_up(self, upcoming: Callable[[int], list[Problem] | None], handle: PolicyHandle,
               sampling: SamplingConfig) -> None:
        """Queue generations up to ``lag`` steps ahead; ``upcoming(n)`` gives the prompts of the ``n``-th step after
        this one, or ``None`` past the epoch's end (its successor's first step generates in the foreground)."""
        while len(self.pending) < self.lag:
            problems = upcoming(len(self.pending) + 1)
            if problems is None:
                break
            self.pending.append(_Prefetch(problems, self.submit(problems, handle, sampling)))

    def submit(self, problems: list[Problem], handle: PolicyHandle, sampling: SamplingConfig) -> Future:
        """Generate ``problems`` in the background with the weights as they are now and a sampler of its own (the
        training thread keeps torch's global random stream).

        With no generation queued the weights are synced into the engine here, in the calling thread. Behind queued
        ones the engine's weights belong to those until they finish, so a snapshot of the policy is taken here and
        synced in the background right before this generation.
        """
        version = int(handle.policy_version)
        snapshot = None
        if not self.pending:
            self.weights.sync(self.engine, handle)
        elif self.weights.version != version:
            snapshot = copy.deepcopy(handle.policy)
            self.weights.version = version  # what the engine holds once the queue has run
        self.generations += 1
        seed = self.seed * 1_000_003 + self.generations
        # the decoding loop's float32 stats give the log-probs for free; where it has none (bf16), the engine scores
        sampling = replace(sampling, behaviour_stats=True, logprobs=True)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        return self._executor.submit(self._run, problems, version, sampling, snapshot, seed, handle.device)

    def as_lagged(self, batch: RolloutBatch) -> RolloutBatch:
        """A batch of rows generated in the background: its ``engine_logprobs`` are the generating policy's log-probs
        and it carries no behaviour stats, so the trainer's old policy is the current one and the gap is
        importance-corrected."""
        if batch.engine_logprobs is None:
            raise RuntimeError(f"max_policy_lag={self.lag}: {type(self.engine).__name__} returned no log-probs of the "
                               f"policy that generated the batch (SamplingConfig.logprobs asks for them)")
        return replace(batch, behaviour_logprobs=None, behaviour_entropy=None, behaviour_sbar=None)

    def _run(self, problems: list[Problem], version: int, sampling: SamplingConfig,
             snapshot: torch.nn.Module | None, seed: int, device: torch.device) -> GeneratedRollout:
        if snapshot is not None:
            self.engine.sync(snapshot, version)
        self.engine.generator = torch.Generator(device=device).manual_seed(seed)
        return self.generate(problems, version, sampling)

    def wait(self) -> None:
        """Let the background generations finish before anything else uses the engine (validation, probes, a
        checkpoint's refill-sampler state); their rows are kept for the steps they were made for."""
        for pending in self.pending:
            pending.future.exception()
        self.engine.generator = None  # evaluations and probes draw from torch's global random stream, as at lag 0

    def shutdown(self) -> None:
        """Finish what is queued, drop it and stop the thread."""
        if self._executor is not None:
            self.wait()
            self.pending.clear()
            self._executor.shutdown()
            self._executor = None
