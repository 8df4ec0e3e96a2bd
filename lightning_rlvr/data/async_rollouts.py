"""Asynchronous rollouts (``RolloutDataModule(max_policy_lag=k)``, ``k >= 1``): generation overlaps training.

At each step the batch generated in the background for it is trained on, and the queue of background generations is
topped up to the next ``k`` steps (their prompts are known from the resumable shuffle's order; the first step of an
epoch has none ahead). The newest one is generated with the weights as they are at the start of this step, so a step
trains on a rollout of a policy at most ``k`` steps old.

The generations run one after the other in a background thread on the engine's own copy of the weights, each with a
``torch.Generator`` of its own, seeded from ``data.seed``, the global seed (``seed_everything``) and the rank
(``HFEngine(weights="copy")`` decodes in that thread, sharing the interpreter with training; a ``ProcessEngine``
decodes in its own process while the thread waits). With ``k > 1`` a generation queued behind others gets a snapshot
of the policy (a deep copy, synced into the engine right before it runs and dropped then: at most ``k − 1`` alive at
once). The queue never runs past the fit: it holds no more steps than ``max_steps`` and ``limit_train_batches``
leave. A failed background generation is raised in the training thread at the next step, validation or checkpoint.
When the fit fails (an exception, Ctrl+C), :meth:`LaggedRollouts.abort` cancels what has not started and does not
wait for the generation in progress: the thread is a daemon, and the DataModule aborts the engine (a
``ProcessEngine``'s process is killed). The batch's ``engine_logprobs`` are the generating policy's log-probs and it
carries no behaviour statistics, so the trainer's old policy is the current one and ``RLVRModule(engine_is_cap=...)``
importance-corrects the staleness. Anything else that uses the engine (validation, probes) waits for the background
generations first. Under DDP each rank runs its own background generations on its own engine; the background does no
collective (the reward-component names are united over ranks when the batch is built, in the training thread). A
policy sharded across ranks (FSDP2, ZeRO-3) cannot be copied into ``HFEngine`` or ``ProcessEngine``;
``VLLMServerEngine`` gathers its weights for the push (a collective, in the training thread), so it takes a lag of 1.
"""

from __future__ import annotations

import copy
import hashlib
import math
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, replace

import torch

from lightning_rlvr.data.batch import RolloutBatch
from lightning_rlvr.data.policy_handle import EngineWeights, PolicyHandle
from lightning_rlvr.data.scoring import GeneratedRollout
from lightning_rlvr.rollout.base import RolloutEngine, SamplingConfig
from lightning_rlvr.tasks import Problem

__all__ = ["LaggedRollouts", "mixed_seed", "steps_left"]

#: ``generate(problems, version, sampling, refill_seed)``: one rollout's rounds with the engine's current weights
#: (dynamic sampling's refills drawn from a sampler seeded with ``refill_seed``).
Generate = Callable[[list[Problem], int, SamplingConfig, int], GeneratedRollout]


def steps_left(trainer, handle: PolicyHandle) -> float:
    """Rollout steps left in this fit and epoch, the current one included (``inf`` when nothing bounds them):
    ``max_steps`` through the policy's :meth:`~lightning_rlvr.data.policy_handle.PolicyHandle.rollout_steps_left`,
    and the epoch's batches once ``limit_train_batches`` applied."""
    if trainer is None:
        return math.inf
    left = handle.rollout_steps_left()
    left = math.inf if left is None else left
    epoch_batches = trainer.num_training_batches
    if math.isfinite(epoch_batches):  # `ready` counts this epoch's batches so far, the current one included
        left = min(left, epoch_batches - trainer.fit_loop.epoch_loop.batch_progress.current.ready + 1)
    return left


def mixed_seed(*parts: int) -> int:
    """A 63-bit seed that depends on every part (nearby tuples give unrelated seeds)."""
    digest = hashlib.sha256(",".join(str(int(part)) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class _Worker:
    """Runs submitted calls one after the other in a daemon thread.

    A daemon, unlike ``ThreadPoolExecutor``'s threads (which the interpreter joins at exit): after a failed fit the
    process exits without waiting for the generation in progress.
    """

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="rollout", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def stop(self) -> None:
        """Let the thread end after the call it runs (calls still queued must have been cancelled)."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue  # cancelled before it started
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to the training thread through the future
                future.set_exception(err)
            del call, future, fn, args  # a snapshot among the arguments is not kept alive until the next call


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
        seed: ``data.seed``; the ``n``-th background generation's sampler (and its refill sampler) is seeded with
            :func:`mixed_seed` of it, the global seed, the rank and ``n`` (:meth:`for_run` sets the last two).
        engine: generates; it holds its own weights.
        weights: what the engine holds.
        generate: one rollout's rounds.
    """

    def __init__(self, lag: int, seed: int, engine: RolloutEngine, weights: EngineWeights, generate: Generate) -> None:
        self.lag = lag
        self.seed = seed
        self.global_seed = 0
        self.rank = 0
        self.engine = engine
        self.weights = weights
        self.generate = generate
        self.generations = 0  # background generations so far: each one's sampler seed
        self.pending: deque[_Prefetch] = deque()
        self._queued_version: int | None = None  # what the engine holds once the queue has run
        self._worker: _Worker | None = None

    def for_run(self, global_seed: int, rank: int) -> None:
        """Seed the background samplers for this run's global seed (``seed_everything``) and this rank."""
        self.global_seed, self.rank = int(global_seed), int(rank)

    def take(self, problems: list[Problem], handle: PolicyHandle, sampling: SamplingConfig) -> GeneratedRollout:
        """This step's rollout: generated ahead when an earlier step foresaw these prompts, else now."""
        pending = self.pending.popleft() if self.pending else None
        if pending is not None and pending.matches(problems):
            return pending.future.result()  # re-raises what went wrong in the background
        # prompts not foreseen (never expected): what was generated ahead is dropped
        if pending is not None:
            self.pending.appendleft(pending)
        self._drop_pending()
        return self.submit(problems, handle, sampling).result()

    def top_up(self, upcoming: Callable[[int], list[Problem] | None], handle: PolicyHandle,
               sampling: SamplingConfig) -> None:
        """Queue generations up to ``lag`` steps ahead; ``upcoming(n)`` gives the prompts of the ``n``-th step after
        this one, or ``None`` past the epoch's end or the fit's last step (a next epoch's first step generates in
        the foreground)."""
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
        snapshot: list[torch.nn.Module] = []  # emptied by the sync, so that the copy dies before the generation
        if not self.pending:  # the thread is idle
            self.weights.sync(self.engine, handle)
        elif self._queued_version != version:
            snapshot.append(copy.deepcopy(handle.policy))
        self._queued_version = version
        self.generations += 1
        seed = mixed_seed(self.seed, self.global_seed, self.rank, self.generations)
        # the decoding loop's float32 stats give the log-probs for free; where it has none (bf16), the engine scores
        sampling = replace(sampling, behaviour_stats=True, logprobs=True)
        if self._worker is None:
            self._worker = _Worker()
        return self._worker.submit(self._run, problems, version, sampling, snapshot, seed, handle.device)

    def as_lagged(self, batch: RolloutBatch) -> RolloutBatch:
        """A batch of rows generated in the background: its ``engine_logprobs`` are the generating policy's log-probs
        and it carries no behaviour stats, so the trainer's old policy is the current one and the gap is
        importance-corrected."""
        if batch.engine_logprobs is None:
            raise RuntimeError(f"max_policy_lag={self.lag}: {type(self.engine).__name__} returned no log-probs of the "
                               f"policy that generated the batch (SamplingConfig.logprobs asks for them)")
        return replace(batch, behaviour_logprobs=None, behaviour_entropy=None, behaviour_sbar=None)

    def _run(self, problems: list[Problem], version: int, sampling: SamplingConfig,
             snapshot: list[torch.nn.Module], seed: int, device: torch.device) -> GeneratedRollout:
        if device.type == "cuda":  # the current CUDA device is per thread (cuda:0 in a new one): the rank's
            torch.cuda.set_device(device)
        if snapshot:
            self.engine.sync(snapshot.pop(), version)
            self.weights.version = version  # only once the engine holds it
        self.engine.generator = torch.Generator(device=device).manual_seed(seed)
        return self.generate(problems, version, sampling, seed)

    def wait(self) -> None:
        """Let the background generations finish before anything else uses the engine (validation, probes, a
        checkpoint); their rows are kept for the steps they were made for.

        Raises:
            RuntimeError: a background generation failed (its exception is the cause).
        """
        for pending in self.pending:
            _raise_failure(pending.future)
        self.engine.generator = None  # evaluations and probes draw from torch's global random stream, as at lag 0

    def shutdown(self) -> None:
        """The fit's end: cancel what has not started, let the generation in progress finish and stop the thread."""
        self._drop_pending(check=False)
        self._stop_worker()

    def abort(self) -> None:
        """The fit failed: cancel what has not started and stop the thread, without waiting for the generation in
        progress (the thread is a daemon; abort the engine to end it)."""
        for pending in self.pending:
            pending.future.cancel()
        self.pending.clear()
        self._stop_worker()
        self.engine.generator = None

    def _drop_pending(self, check: bool = True) -> None:
        """Cancel the queued generations that have not started and wait for the one in progress (``check``: raise
        if it failed)."""
        for pending in self.pending:
            if not pending.future.cancel() and check:
                _raise_failure(pending.future)
            elif not pending.future.cancelled():
                pending.future.exception()
        self.pending.clear()

    def _stop_worker(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None


def _raise_failure(future: Future) -> None:
    """Wait for ``future``; raise in this thread what it raised in the background."""
    try:
        error = future.exception()
    except CancelledError:
        return
    if error is not None:
        raise RuntimeError(f"a background generation failed: {error!r}") from error
