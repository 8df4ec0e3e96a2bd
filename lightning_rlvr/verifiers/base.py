"""Verifier interface and a runner that survives verifiers which crash or hang.

A :class:`Verifier` maps ``(completion_text, reference_answer)`` to a scalar reward. The
:class:`VerifierRunner` calls it for a whole batch and guarantees that training goes on whatever the
verifier does: an exception, a non-finite reward or a call past its time limit gives reward 0 and is
counted (logged as ``reward/verifier_errors``).

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
from collections.abc import Callable, Sequence

# Imported by name: concurrent.futures loads its process module lazily, so cf.process may not exist yet.
from concurrent.futures.process import BrokenProcessPool
from typing import Literal

__all__ = ["CallableVerifier", "Isolation", "Verifier", "VerifierRunner"]

Isolation = Literal["inline", "thread", "process"]


class Verifier(ABC):
    """Scores one completion against its reference answer. Subclasses implement :meth:`score`.

    ``isolation`` (class or instance attribute) says how :class:`VerifierRunner` calls it.
    """

    isolation: Isolation = "thread"

    @abstractmethod
    def score(self, completion: str, answer: str) -> float:
        """Reward of ``completion`` (text up to, not including, the first EOS) given ``answer``."""

    def answer_key(self, completion: str) -> str:
        """The answer a completion gives, as a key for majority voting (maj@k): equal keys = the same answer.

        Default: the whitespace-normalised text. Called in the trainer process, so it must be cheap and total.
        """
        return " ".join(completion.split())


class CallableVerifier(Verifier):
    """Wraps a user function ``fn(completion, answer) -> float`` (or an import path ``"pkg.mod:fn"``).

    Args:
        fn: the function, or ``"module:function"`` so that it can be named in YAML.
        isolation: how to run it (default ``"thread"``: user code may hang).
    """

    def __init__(self, fn: Callable[[str, str], float] | str, isolation: Isolation = "thread") -> None:
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

    def score(self, completion: str, answer: str) -> float:
        return float(self.fn(completion, answer))


class _CallTimeout(Exception):
    pass


# After its in-worker timer, how long a process-isolated call may take to come back before its worker is killed.
_KILL_GRACE_S = 2.0


def _ping(verifier: Verifier, index: int) -> int:
    # Receiving the verifier unpickles it in the worker, which imports its module (and whatever that imports).
    return index


def _raise_timeout(signum, frame):  # pragma: no cover - runs in a worker process
    raise _CallTimeout()


def _score_in_worker(verifier: Verifier, completion: str, answer: str, timeout_s: float) -> float:
    """Runs in a worker process's main thread: a real per-call time limit via an interval timer."""
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return float(verifier.score(completion, answer))
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

    def _check(self, value: float, index: int) -> tuple[float, bool]:
        if not math.isfinite(value):
            self._warn(f"returned a non-finite reward {value} for completion {index}")
            return 0.0, True
        return value, False

    def score_batch(self, completions: Sequence[str], answers: Sequence[str]) -> tuple[list[float], int]:
        """Rewards for a batch and the number of calls that failed (raised, hung or were non-finite)."""
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        if self.verifier.isolation == "inline":
            return self._score_inline(completions, answers)
        return self._score_pooled(completions, answers)

    def _score_inline(self, completions, answers) -> tuple[list[float], int]:
        rewards, errors = [], 0
        for i, (c, a) in enumerate(zip(completions, answers)):
            try:
                value, failed = self._check(float(self.verifier.score(c, a)), i)
            except Exception as err:  # noqa: BLE001 - any verifier failure is a zero reward
                self._warn(f"raised {type(err).__name__}: {err}")
                value, failed = 0.0, True
            rewards.append(value)
            errors += failed
        return rewards, errors

    def _outcome(self, future: cf.Future, index: int) -> tuple[float, bool]:
        """A finished call's reward and whether it failed (raised, timed out, non-finite, or its worker died)."""
        try:
            return self._check(float(future.result()), index)
        except _CallTimeout:
            self._warn(f"exceeded its time limit of {self.timeout_s}s")
        except BrokenProcessPool as err:
            self._warn(f"worker process died ({err})")
        except Exception as err:  # noqa: BLE001 - any verifier failure is a zero reward
            self._warn(f"raised {type(err).__name__}: {err}")
        return 0.0, True

    def _score_pooled(self, completions, answers) -> tuple[list[float], int]:
        if self.verifier.isolation == "process":
            return self._score_processes(completions, answers)
        rewards = [0.0] * len(completions)
        errors = 0
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
                rewards[index], failed = self._outcome(future, index)
                errors += failed
            now = time.monotonic()
            overdue = {f for f in not_done if futures[f] in started and now - started[futures[f]] > self.timeout_s}
            if not overdue:
                continue
            self._warn(f"exceeded its time limit of {self.timeout_s}s")
            for future in overdue:
                rewards[futures[future]] = 0.0
                errors += 1
            not_done -= overdue
            # Calls queued behind a hung one get a fresh pool; calls already running keep running.
            requeue = [futures[f] for f in list(not_done) if f.cancel()]
            not_done = {f for f in not_done if not f.cancelled()}
            self._discard_pool()
            if requeue:
                not_done |= submit(requeue)
        return rewards, errors

    def _score_processes(self, completions, answers) -> tuple[list[float], int]:
        """Process isolation: at most one call in flight per worker, so a call past its limit is the stuck one.

        The in-worker timer ends a call at ``timeout_s``. A worker stuck in C code, where the timer cannot
        interrupt it (sympy raising a huge integer to a huge power), is killed ``_KILL_GRACE_S`` later with its
        pool; the stuck call scores 0 and the calls that were in flight on other workers or still waiting go on
        in a fresh pool.
        """
        rewards = [0.0] * len(completions)
        errors = 0
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
                rewards[index], failed = self._outcome(future, index)
                errors += failed
                broken |= isinstance(future.exception(), BrokenProcessPool)
            now = time.monotonic()
            stuck = [f for f, (_, handed) in running.items() if now - handed > self.timeout_s + _KILL_GRACE_S]
            if stuck:
                self._warn(f"exceeded its time limit of {self.timeout_s}s and was killed")
                for future in stuck:
                    index, _ = running.pop(future)
                    rewards[index], errors = 0.0, errors + 1
            if stuck or broken:
                waiting = [index for index, _ in running.values()] + waiting  # innocent calls in flight: again
                running = {}
                self._discard_pool()
        return rewards, errors
