"""Verifier interface and a runner that survives verifiers which crash or hang.

A :class:`Verifier` maps ``(completion_text, reference_answer)`` to a scalar reward. The
:class:`VerifierRunner` calls it for a whole batch and guarantees that training goes on whatever the
verifier does: an exception, a non-finite reward or a call past its time limit gives reward 0 and is
counted (logged as ``reward/verifier_errors``).

How a verifier runs is its ``isolation``:

- ``"inline"``: called directly in the trainer process; for pure, total functions (exact match).
- ``"thread"``: in a thread pool, each call waited for at most ``timeout_s``. A thread cannot be killed:
  a hung call is abandoned (its thread leaks until it returns) and a fresh pool takes over.
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
from typing import Literal

from lightning.pytorch.utilities import rank_zero_warn

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
        self._pool: cf.Executor | None = None
        self._warned = False

    # -- pools ---------------------------------------------------------------------------------------------
    def _get_pool(self) -> cf.Executor:
        if self._pool is None:
            if self.verifier.isolation == "process":
                context = multiprocessing.get_context("spawn")
                self._pool = cf.ProcessPoolExecutor(self.num_workers, mp_context=context)
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

    def _score_pooled(self, completions, answers) -> tuple[list[float], int]:
        pool = self._get_pool()
        in_process = self.verifier.isolation == "process"
        if in_process:
            futures = [pool.submit(_score_in_worker, self.verifier, c, a, self.timeout_s)
                       for c, a in zip(completions, answers)]
        else:
            futures = [pool.submit(self.verifier.score, c, a) for c, a in zip(completions, answers)]
        # Calls run num_workers at a time, so the batch needs at most this long if every call keeps its limit.
        rounds = math.ceil(len(futures) / self.num_workers)
        deadline = time.monotonic() + self.timeout_s * rounds + (5.0 if in_process else 0.5)
        rewards, errors, hung = [], 0, False
        for i, future in enumerate(futures):
            try:
                value, failed = self._check(float(future.result(timeout=max(0.0, deadline - time.monotonic()))), i)
            except cf.TimeoutError:
                self._warn(f"exceeded its time limit of {self.timeout_s}s")
                value, failed, hung = 0.0, True, True
            except _CallTimeout:
                self._warn(f"exceeded its time limit of {self.timeout_s}s")
                value, failed = 0.0, True
            except cf.process.BrokenProcessPool as err:
                self._warn(f"worker process died ({err})")
                value, failed, hung = 0.0, True, True
            except Exception as err:  # noqa: BLE001
                self._warn(f"raised {type(err).__name__}: {err}")
                value, failed = 0.0, True
            rewards.append(value)
            errors += failed
        if hung:
            self._discard_pool()
        return rewards, errors
