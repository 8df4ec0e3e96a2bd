"""Verifier interface and a runner that survives verifiers which crash or hang.

A :class:`Verifier` maps ``(completion_text, reference_answer)`` to a scalar reward, or to a dict of named
reward components (``{"correct": 1.0, "format": 0.1}``) whose sum is the reward; the DataModule logs each
component's batch mean as ``reward/<name>``. The :class:`VerifierRunner` calls it for a whole batch and
guarantees that training goes on whatever the verifier does: an exception, a non-finite reward or a call past
its time limit gives reward 0 (and no components) and is counted (logged as ``reward/verifier_errors``).

How a verifier runs is its ``isolation``:

- ``"inline"``: called directly in the trainer process; for pure, total functions (exact match).
- ``"thread"``: in a thread pool, each call given at most ``timeout_s`` from the moment it starts. A thread
  cannot be killed: a hung call is abandoned (its thread leaks until it returns) and the calls queued behind
  it move to a fresh pool.
- ``"process"``: in a pool of spawned worker processes. Each call runs in the worker's main thread
  under a ``SIGALRM`` timer (so libraries that rely on ``signal.alarm``, such as math-verify, work
  there), and if a worker stops responding the whole pool is killed and rebuilt.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import math
import multiprocessing
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

# Imported by name: concurrent.futures loads its process module lazily, so cf.process may not exist yet.
from concurrent.futures.process import BrokenProcessPool
from typing import Literal

__all__ = ["RESERVED_REWARD_NAMES", "CallableVerifier", "Isolation", "Score", "Verdict", "Verifier", "VerifierRunner"]

Isolation = Literal["inline", "thread", "process"]

#: What a verifier's ``score`` returns: a reward, or named reward components summed into the reward.
Score = float | Mapping[str, float]

#: Metric names under ``reward/`` that the DataModule logs itself; a reward component may not take one.
RESERVED_REWARD_NAMES = frozenset({"mean", "accuracy", "verifier_errors"})


@dataclass(frozen=True)
class Verdict:
    """One completion's verification.

    Attributes:
        reward: the reward (the sum of ``components`` when the verifier returned components).
        components: the named components, empty for a verifier that returns a float (and after a failure).
        failed: the verifier raised, hung, returned a non-finite value, or its worker died (reward 0).
    """

    reward: float
    components: dict[str, float] = field(default_factory=dict)
    failed: bool = False


_FAILED = Verdict(0.0, {}, True)


def _as_score(value: Score) -> Score:
    """A verifier's return value as plain, picklable data: a float or a ``{name: float}`` dict."""
    if isinstance(value, Mapping):
        return {str(name): float(component) for name, component in value.items()}
    return float(value)


class Verifier(ABC):
    """Scores one completion against its reference answer. Subclasses implement :meth:`score`.

    ``isolation`` (class or instance attribute) says how :class:`VerifierRunner` calls it.
    """

    isolation: Isolation = "thread"

    @abstractmethod
    def score(self, completion: str, answer: str) -> Score:
        """Reward of ``completion`` (text up to, not including, the first stop token) given ``answer``.

        Returns a float, or a dict of named components (``{"correct": 1.0, "format": 0.1}``) whose sum is the
        reward; each is logged as ``reward/<name>``. A name must be a non-empty string without ``/`` and not one of
        :data:`RESERVED_REWARD_NAMES`.
        """

    def answer_key(self, completion: str) -> str:
        """The answer a completion gives, as a key for majority voting (maj@k): equal keys = the same answer.

        Default: the whitespace-normalised text. Called in the trainer process, so it must be cheap and total.
        """
        return " ".join(completion.split())


class CallableVerifier(Verifier):
    """Wraps a user function ``fn(completion, answer) -> float | dict[str, float]`` (or ``"pkg.mod:fn"``).

    Args:
        fn: the function, or ``"module:function"`` so that it can be named in YAML.
        isolation: how to run it (default ``"thread"``: user code may hang).
    """

    def __init__(self, fn: Callable[[str, str], Score] | str, isolation: Isolation = "thread") -> None:
        if isinstance(fn, str):
            module_name, sep, attr = fn.partition(":")
            if not sep:
                raise ValueError(f"CallableVerifier expects 'module:function', got {fn!r}")
            fn = getattr(importlib.import_module(module_name), attr)
        if not callable(fn):
            raise TypeError(f"CallableVerifier needs a callable, got {type(fn).__name__}")
        if isolation not in ("inline", "thread", "process"):
            raise ValueError(f"isolation must be 'inline', 'thread' or 'process', got {isolation!r}")
        self.fn = fn
        self.isolation = isolation

    def score(self, completion: str, answer: str) -> Score:
        return _as_score(self.fn(completion, answer))


class _CallTimeout(Exception):
    pass


# After its in-worker timer, how long a process-isolated call may take to come back before its worker is killed.
_KILL_GRACE_S = 2.0


def _ping(verifier: Verifier, index: int) -> int:
    # Receiving the verifier unpickles it in the worker, which imports its module (and whatever that imports).
    return index


def _raise_timeout(signum, frame):  # pragma: no cover - runs in a worker process
    raise _CallTimeout()


def _score_in_worker(verifier: Verifier, completion: str, answer: str, timeout_s: float) -> Score:
    """Runs in a worker process's main thread: a real per-call time limit via an interval timer."""
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return _as_score(verifier.score(completion, answer))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


class VerifierRunner:
    """Scores batches with a verifier; failures become reward 0 and are counted.

    Args:
        verifier: the verifier.
        timeout_s: per-call time limit (thread and process isolation).
        num_workers: threads or processes in the pool.
    """

    def __init__(self, verifier: Verifier, timeout_s: float = 5.0, num_workers: int = 2) -> None:
        if timeout_s <= 0:
            raise ValueError(f"verifier timeout_s must be > 0, got {timeout_s}")
        if num_workers < 1:
            raise ValueError(f"verifier num_workers must be >= 1, got {num_workers}")
        self.verifier = verifier
        self.timeout_s = float(timeout_s)
        self.num_workers = int(num_workers)
        self.startup_timeout_s = 120.0
        self._pool: cf.Executor | None = None
        self._warned = False

    # -- pools ---------------------------------------------------------------------------------------------
    def _get_pool(self) -> cf.Executor:
        if self._pool is None:
            if self.verifier.isolation == "process":
                context = multiprocessing.get_context("spawn")
                pool = cf.ProcessPoolExecutor(self.num_workers, mp_context=context)
                # Start every worker and import the verifier's modules there (unpickling it) before any call's
                # time limit starts counting: a cold worker can take seconds (torch, sympy) to get to the call.
                warmups = [pool.submit(_ping, self.verifier, i) for i in range(self.num_workers)]
                done, pending = cf.wait(warmups, timeout=self.startup_timeout_s)
                if pending:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise RuntimeError(f"verifier worker processes did not start within {self.startup_timeout_s}s")
                self._pool = pool
            else:
                self._pool = cf.ThreadPoolExecutor(self.num_workers, thread_name_prefix="verifier")
        return self._pool

    def _discard_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if isinstance(pool, cf.ProcessPoolExecutor):
            for process in list(getattr(pool, "_processes", {}).values()):
                process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stops the worker pool (idempotent)."""
        self._discard_pool()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self._discard_pool()
        except Exception:
            pass

    # -- scoring -------------------------------------------------------------------------------------------
    def _warn(self, message: str) -> None:
        # Imported here: spawned verifier workers import this module and should not pay for Lightning.
        from lightning.pytorch.utilities import rank_zero_warn

        if not self._warned:
            rank_zero_warn(f"{type(self.verifier).__name__}: {message} (reward 0; counted in reward/verifier_errors)")
            self._warned = True

    def _check(self, value: Score, index: int) -> Verdict:
        """The verdict of one returned value; a malformed component name is the verifier's bug and raises."""
        try:
            value = _as_score(value)
        except (TypeError, ValueError) as err:
            self._warn(f"returned {value!r} for completion {index}, not a float or a dict of floats ({err})")
            return _FAILED
        components = value if isinstance(value, dict) else {}
        for name in components:
            if not name or "/" in name or name in RESERVED_REWARD_NAMES:
                raise ValueError(f"{type(self.verifier).__name__} returned a reward component named {name!r}: "
                                 f"names are logged as reward/<name>, so they must be non-empty, without '/', and "
                                 f"not one of {sorted(RESERVED_REWARD_NAMES)}")
        reward = sum(components.values()) if isinstance(value, dict) else value
        if not math.isfinite(reward):
            self._warn(f"returned a non-finite reward {value} for completion {index}")
            return _FAILED
        return Verdict(reward, components)

    def verify_batch(self, completions: Sequence[str], answers: Sequence[str]) -> list[Verdict]:
        """One :class:`Verdict` per completion: its reward, its named components, whether the call failed."""
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        if self.verifier.isolation == "inline":
            return self._score_inline(completions, answers)
        if self.verifier.isolation == "process":
            return self._score_processes(completions, answers)
        return self._score_threads(completions, answers)

    def score_batch(self, completions: Sequence[str], answers: Sequence[str]) -> tuple[list[float], int]:
        """Rewards for a batch and the number of calls that failed (raised, hung or were non-finite)."""
        verdicts = self.verify_batch(completions, answers)
        return [v.reward for v in verdicts], sum(v.failed for v in verdicts)

    def _score_inline(self, completions, answers) -> list[Verdict]:
        verdicts = []
        for i, (c, a) in enumerate(zip(completions, answers)):
            try:
                value = self.verifier.score(c, a)
            except Exception as err:  # noqa: BLE001 - any verifier failure is a zero reward
                self._warn(f"raised {type(err).__name__}: {err}")
                verdicts.append(_FAILED)
                continue
            verdicts.append(self._check(value, i))
        return verdicts

    def _outcome(self, future: cf.Future, index: int) -> Verdict:
        """A finished call's verdict (failed if it raised, timed out, was non-finite, or its worker died)."""
        try:
            value = future.result()
        except _CallTimeout:
            self._warn(f"exceeded its time limit of {self.timeout_s}s")
        except BrokenProcessPool as err:
            self._warn(f"worker process died ({err})")
        except Exception as err:  # noqa: BLE001 - any verifier failure is a zero reward
            self._warn(f"raised {type(err).__name__}: {err}")
        else:
            return self._check(value, index)
        return _FAILED

    def _score_threads(self, completions, answers) -> list[Verdict]:
        verdicts = [_FAILED] * len(completions)
        futures: dict[cf.Future, int] = {}
        started: dict[int, float] = {}  # when each call began (its own time limit)

        def timed_call(index: int) -> float:
            started[index] = time.monotonic()
            return self.verifier.score(completions[index], answers[index])

        def submit(indices) -> set[cf.Future]:
            pool = self._get_pool()
            new = {pool.submit(timed_call, i): i for i in indices}
            futures.update(new)
            return set(new)

        not_done = submit(range(len(completions)))
        while not_done:
            done, not_done = cf.wait(not_done, timeout=0.05, return_when=cf.FIRST_COMPLETED)
            for future in done:
                index = futures[future]
                verdicts[index] = self._outcome(future, index)
            now = time.monotonic()
            overdue = {f for f in not_done if futures[f] in started and now - started[futures[f]] > self.timeout_s}
            if not overdue:
                continue
            self._warn(f"exceeded its time limit of {self.timeout_s}s")
            for future in overdue:
                verdicts[futures[future]] = _FAILED
            not_done -= overdue
            # Calls queued behind a hung one get a fresh pool; calls already running keep running.
            requeue = [futures[f] for f in list(not_done) if f.cancel()]
            not_done = {f for f in not_done if not f.cancelled()}
            self._discard_pool()
            if requeue:
                not_done |= submit(requeue)
        return verdicts

    def _score_processes(self, completions, answers) -> list[Verdict]:
        """Process isolation: at most one call in flight per worker, so a call past its limit is the stuck one.

        The in-worker timer ends a call at ``timeout_s``. A worker stuck in C code, where the timer cannot
        interrupt it (sympy raising a huge integer to a huge power), is killed ``_KILL_GRACE_S`` later with its
        pool; the stuck call scores 0 and the calls that were in flight on other workers or still waiting go on
        in a fresh pool.
        """
        verdicts = [_FAILED] * len(completions)
        waiting = list(range(len(completions)))
        running: dict[cf.Future, tuple[int, float]] = {}  # future -> (call index, when it was handed to a worker)
        while waiting or running:
            pool = self._get_pool()
            while waiting and len(running) < self.num_workers:
                index = waiting.pop(0)
                future = pool.submit(_score_in_worker, self.verifier, completions[index], answers[index],
                                     self.timeout_s)
                running[future] = (index, time.monotonic())
            done, _ = cf.wait(running, timeout=0.05, return_when=cf.FIRST_COMPLETED)
            broken = False
            for future in done:
                index, _ = running.pop(future)
                verdicts[index] = self._outcome(future, index)
                broken |= isinstance(future.exception(), BrokenProcessPool)
            now = time.monotonic()
            stuck = [f for f, (_, handed) in running.items() if now - handed > self.timeout_s + _KILL_GRACE_S]
            if stuck:
                self._warn(f"exceeded its time limit of {self.timeout_s}s and was killed")
                for future in stuck:
                    index, _ = running.pop(future)
                    verdicts[index] = _FAILED
            if stuck or broken:
                waiting = [index for index, _ in running.values()] + waiting  # innocent calls in flight: again
                running = {}
                self._discard_pool()
        return verdicts
