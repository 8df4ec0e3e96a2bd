"""Prompt sources: where the verifiable problems come from (built-in tasks or local files).

A source provides three lists of :class:`~lightning_rlvr.tasks.Problem`: the training split, the held-out
split (validation only) and an optional warm-start subset (supervised warm start).
"""

from __future__ import annotations

import json
import random
from abc import ABC, abstractmethod
from pathlib import Path

from lightning_rlvr.tasks import ArithmeticTask, Problem, TaskName
from lightning_rlvr.verifiers.base import Verifier

__all__ = ["BuiltinTask", "FileSource", "PromptSource", "load_problems"]


class PromptSource(ABC):
    """Supplies the problems of a run."""

    @abstractmethod
    def train_problems(self) -> list[Problem]:
        """Problems to train on."""

    @abstractmethod
    def held_out_problems(self) -> list[Problem]:
        """Problems for validation only."""

    def warm_start_problems(self) -> list[Problem]:
        """Problems with known answers for a supervised warm start (empty: no warm start possible)."""
        return []

    def default_verifier(self) -> Verifier | None:
        """The verifier a source's answers are meant for, used when the DataModule is given none (``None``: exact
        match)."""
        return None


class BuiltinTask(PromptSource):
    """A built-in arithmetic task generated on the fly (see :class:`~lightning_rlvr.tasks.ArithmeticTask`).

    Args:
        name: ``addition``, ``addition3`` or ``reverse``.
        max_operand: largest operand of ``addition``.
        num_digits: digits of ``reverse``.
        held_out_fraction: share of the problem space held out.
        warm_start_fraction: share of the problem space used for the warm start.
        seed: split seed.
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
        self.task = ArithmeticTask(name, max_operand, num_digits, held_out_fraction, warm_start_fraction, seed)

    def train_problems(self) -> list[Problem]:
        return self.task.train

    def held_out_problems(self) -> list[Problem]:
        return self.task.held_out

    def warm_start_problems(self) -> list[Problem]:
        return self.task.warm_start


def _load_dataset_directory(path: Path, split: str) -> list:
    """Rows of a Hugging Face ``datasets`` directory (``save_to_disk``); a ``DatasetDict`` gives ``split``."""
    try:
        import datasets
    except ImportError as err:  # pragma: no cover
        raise ImportError(f"{path} is a directory: reading a Hugging Face datasets directory needs "
                          f"`pip install 'lightning_rlvr[datasets]'`") from err
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise ValueError(f"{path}: not a Hugging Face datasets directory (written by save_to_disk): {err}") from err
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"{path}: no split {split!r}; the dataset has {sorted(loaded)}")
        loaded = loaded[split]
    return loaded.to_list()


def load_problems(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer",
                  split: str = "train") -> list[Problem]:
    """Read problems from a ``.jsonl`` / ``.parquet`` file or a Hugging Face ``datasets`` directory.

    The answer field may hold a list or an object (a code problem's tests); it is kept as its JSON text, which
    :class:`~lightning_rlvr.verifiers.CodeVerifier` reads.

    A ``datasets`` directory (``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``) is read with
    ``datasets.load_from_disk``; of a ``DatasetDict`` the ``split`` is taken.

    Raises:
        ValueError: naming the file and line (1-based; row for parquet and datasets) of a malformed row or missing
            field, or a missing split.
        FileNotFoundError: if the path does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    if path.is_dir():
        rows = _load_dataset_directory(path, split)
        where = "row"
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:  # pragma: no cover
            raise ImportError("reading parquet needs pyarrow: pip install 'lightning_rlvr[parquet]'") from err
        rows = pq.read_table(path).to_pylist()
        where = "row"
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open(encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, start=1):
                if not line.strip():
                    rows.append(None)
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from err
        where = "line"
    else:
        raise ValueError(f"{path}: unsupported dataset format {path.suffix!r}; expected .jsonl or .parquet")
    problems = []
    for index, row in enumerate(rows, start=1):
        if row is None:
            continue
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{where} {index}: expected an object, got {type(row).__name__}")
        for field in (prompt_field, answer_field):
            if field not in row:
                raise ValueError(f"{path}:{where} {index}: missing field {field!r} (has {sorted(row)})")
            if row[field] is None:
                raise ValueError(f"{path}:{where} {index}: field {field!r} is null")
        answer = row[answer_field]
        # Structured references (a code problem's list of tests) stay machine-readable: JSON, not Python's repr.
        answer = json.dumps(answer) if isinstance(answer, (list, dict)) else str(answer)
        problems.append(Problem(str(row[prompt_field]), answer))
    if not problems:
        raise ValueError(f"{path}: no problems found")
    return problems


class FileSource(PromptSource):
    """Problems from local ``.jsonl`` / ``.parquet`` files or Hugging Face ``datasets`` directories.

    Args:
        train_path: training file or ``datasets`` directory.
        held_out_path: held-out file or directory (may be ``train_path`` for a ``DatasetDict`` with both splits);
            if ``None``, ``held_out_fraction`` of the training problems are held out.
        prompt_field: name of the prompt field.
        answer_field: name of the reference-answer field.
        held_out_fraction: share held out when there is no held-out file.
        warm_start_fraction: share of the training problems (with their answers) usable for a warm start.
        seed: split seed.
        train_split: the split of a ``DatasetDict`` directory to train on.
        held_out_split: the split of a ``DatasetDict`` directory to hold out.
    """

    def __init__(
        self,
        train_path: str,
        held_out_path: str | None = None,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        held_out_fraction: float = 0.1,
        warm_start_fraction: float = 0.0,
        seed: int = 0,
        train_split: str = "train",
        held_out_split: str = "test",
    ) -> None:
        problems = load_problems(train_path, prompt_field, answer_field, train_split)
        if held_out_path is not None:
            held_out = load_problems(held_out_path, prompt_field, answer_field, held_out_split)
            self._train, self._held_out = problems, held_out
        else:
            if not 0.0 < held_out_fraction < 1.0:
                raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
            shuffled = list(problems)
            random.Random(seed).shuffle(shuffled)
            n_held = max(1, round(held_out_fraction * len(shuffled)))
            self._held_out, self._train = shuffled[:n_held], shuffled[n_held:]
            if not self._train:
                raise ValueError(f"{train_path}: too few problems to hold out {held_out_fraction:.0%}")
        self._warm = self._train[: round(warm_start_fraction * len(self._train))]

    def train_problems(self) -> list[Problem]:
        return self._train

    def held_out_problems(self) -> list[Problem]:
        return self._held_out

    def warm_start_problems(self) -> list[Problem]:
        return self._warm
