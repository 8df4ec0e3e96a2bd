"""Built-in verifiable tasks generated on the fly: the embedded default needs no dataset download.

Every task enumerates its whole problem space deterministically, shuffles it with a seed and splits it
into a training split and a held-out split (never trained on). A small *warm-start* subset of the
training split serves the optional supervised warm start (see :class:`~lightning_rlvr.callbacks.SupervisedWarmStart`).

Tasks (answers are multi-token: several characters followed by EOS):

- ``addition``: ``"a+b="`` → ``str(a + b)`` with ``a, b ∈ [0, max_operand]`` (the quickstart: 0..49, so answers
  have 1–2 digits; calibrated in MEASUREMENTS.md §9).
- ``addition3``: ``"a+b+c="`` with single digits.
- ``reverse``: ``"rev abc="`` → the digits reversed (``num_digits`` digits; an easy smoke task).
"""

from __future__ import annotations

import itertools
import random
from typing import Literal, NamedTuple

__all__ = ["ArithmeticTask", "Problem", "TaskName"]

TaskName = Literal["addition", "addition3", "reverse"]


class Problem(NamedTuple):
    """One verifiable problem: the prompt text and its reference answer.

    A ``NamedTuple`` (immutable, hashable) rather than a frozen dataclass: Lightning passes every batch through
    ``apply_to_collection`` (e.g. DeepSpeed's precision plugin casting float tensors), which rejects frozen
    dataclasses and rebuilds named tuples.
    """

    prompt: str
    answer: str


class ArithmeticTask:
    """A built-in task with deterministic train / held-out / warm-start splits.

    Args:
        name: which task (see the module docstring).
        max_operand: largest operand of ``addition`` (inclusive).
        num_digits: digits of ``reverse``.
        held_out_fraction: share of the problem space kept for validation only.
        warm_start_fraction: share of the *whole* problem space (taken from the training split) used by the
            supervised warm start.
        seed: seed of the split.

    Example::

        >>> task = ArithmeticTask("addition", max_operand=9)
        >>> len(task.train) + len(task.held_out)
        100
        >>> task.train[0].prompt.endswith("=")
        True
    """

    def __init__(
        self,
        name: TaskName = "addition",
        max_operand: int = 49,
        num_digits: int = 3,
        held_out_fraction: float = 0.15,
        warm_start_fraction: float = 0.05,
        seed: int = 0,
    ) -> None:
        if name not in ("addition", "addition3", "reverse"):
            raise ValueError(f"unknown task name {name!r}; expected 'addition', 'addition3' or 'reverse'")
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        if not 1 <= num_digits <= 8:
            raise ValueError(f"num_digits must be in [1, 8], got {num_digits}")
        if not 0.0 < held_out_fraction < 1.0:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
        if not 0.0 <= warm_start_fraction < 1.0 - held_out_fraction:
            raise ValueError(f"warm_start_fraction must be in [0, 1 - held_out_fraction), got {warm_start_fraction}")
        self.name = name
        problems = self._enumerate(name, max_operand, num_digits)
        random.Random(seed).shuffle(problems)
        n_held = max(1, round(held_out_fraction * len(problems)))
        self.held_out: list[Problem] = problems[:n_held]
        self.train: list[Problem] = problems[n_held:]
        n_warm = round(warm_start_fraction * len(problems))
        self.warm_start: list[Problem] = self.train[:n_warm]

    @staticmethod
    def _enumerate(name: str, max_operand: int, num_digits: int) -> list[Problem]:
        if name == "addition":
            return [Problem(f"{a}+{b}=", str(a + b)) for a in range(max_operand + 1) for b in range(max_operand + 1)]
        if name == "addition3":
            return [Problem(f"{a}+{b}+{c}=", str(a + b + c)) for a, b, c in itertools.product(range(10), repeat=3)]
        # reverse: all digit strings when small, else a fixed sample of 20k of them
        space = 10**num_digits
        rng = random.Random(1234)
        numbers = range(space) if space <= 20_000 else rng.sample(range(space), 20_000)
        out = []
        for n in numbers:
            digits = str(n).zfill(num_digits)
            out.append(Problem(f"rev {digits}=", digits[::-1]))
        return out
