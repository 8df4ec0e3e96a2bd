"""reasoning-gym as a prompt source and verifier: its procedural tasks, held-out split and answer scoring.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ (Apache-2.0) generates verifiable problems on the
fly, over 100 task families, each scored by its own ``score_answer``. :class:`ReasoningGymSource` takes any of its
dataset names with that dataset's config fields and seed; :class:`ReasoningGymVerifier` scores a completion the way
reasoning-gym does: the text of the last ``<answer>...</answer>`` (``reasoning_gym.utils.extract_answer``) passed to
the dataset's ``score_answer(answer, entry)``, which may give partial credit (a completion counts as correct above
0.5). The answer-format convention goes into the prompt: one of reasoning-gym's own instructions
(``reasoning_gym.utils.SYSTEM_PROMPTS``; ``"default"`` asks for step-by-step reasoning and then the answer between
the tags, ``"direct"`` for the tagged answer alone), before the question.

A problem's reference answer is ``{"answer": ..., "index": i}`` as JSON: reasoning-gym derives item ``i`` from the
seed alone, so the verifier regenerates the whole entry (with the metadata ``score_answer`` may need) in its own
worker, and checks that it still has the same answer (a different reasoning-gym version or config is named, not
silently mis-scored).

Needs ``pip install 'lightning_rlvr[reasoning-gym]'``.

Example::

    >>> source = ReasoningGymSource("basic_arithmetic", config={"min_terms": 2, "max_terms": 2, "max_digits": 1},
    ...                             size=200, held_out_size=20)
    >>> verifier = source.default_verifier()
    >>> problem = source.held_out_problems()[0]
    >>> verifier.score("<answer>" + verifier.reference(problem.answer) + "</answer>", problem.answer)
    1.0
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from functools import lru_cache
from typing import Any, Literal

from lightning_rlvr.data.sources import PromptSource
from lightning_rlvr.tasks import Problem
from lightning_rlvr.verifiers.base import Verifier

__all__ = ["AnswerExtraction", "ReasoningGymSource", "ReasoningGymVerifier"]

#: How :class:`ReasoningGymVerifier` finds the answer in a completion.
AnswerExtraction = Literal["answer_tag", "last_number", "whole"]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError("ReasoningGymSource needs reasoning-gym: pip install 'lightning_rlvr[reasoning-gym]'"
                          ) from err
    return reasoning_gym


@lru_cache(maxsize=8)
def _dataset(name: str, config_json: str, seed: int, size: int):
    """The reasoning-gym dataset (built once per process: verifier workers rebuild it from these plain fields)."""
    from reasoning_gym.factory import create_dataset

    return create_dataset(name, seed=seed, size=size, **json.loads(config_json))


def _check_config(name: str, config: dict[str, Any]) -> None:
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ValueError(f"ReasoningGymSource: unknown reasoning-gym dataset {name!r}; known: "
                         f"{', '.join(sorted(DATASETS))}")
    fields = {f.name for f in dataclasses.fields(DATASETS[name][1])} - {"seed", "size"}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(f"ReasoningGymSource: {name} has no config field {', '.join(unknown)} (its fields: "
                         f"{', '.join(sorted(fields))}; seed and size are arguments of the source)")


class ReasoningGymVerifier(Verifier):
    """Scores a completion with the reasoning-gym dataset's own ``score_answer``.

    ``reward = score_answer(extract(completion), entry)`` in [0, 1], where ``entry`` is the dataset's item at the
    reference's index, regenerated from the dataset's name, config and seed.

    Args:
        dataset: the reasoning-gym dataset name.
        config: its config fields (as given to ``reasoning_gym.create_dataset``).
        seed: the dataset seed.
        size: the dataset size.
        extraction: ``"answer_tag"`` (reasoning-gym's convention: the last ``<answer>...</answer>``; none scores 0),
            ``"last_number"`` (the last number in the completion, for models that cannot yet follow the tag format)
            or ``"whole"`` (the whole stripped completion).
    """

    isolation = "thread"  # reasoning-gym's scorers are pure Python; a thread bounds a slow one without a process

    def __init__(self, dataset: str, config: dict[str, Any] | None = None, seed: int = 0, size: int = 1000,
                 extraction: AnswerExtraction = "answer_tag") -> None:
        if extraction not in ("answer_tag", "last_number", "whole"):
            raise ValueError(f"ReasoningGymVerifier: extraction must be answer_tag, last_number or whole, got "
                             f"{extraction!r}")
        _reasoning_gym()
        config = dict(config or {})
        _check_config(dataset, config)
        self.dataset, self.config, self.seed, self.size, self.extraction = dataset, config, seed, size, extraction
        self._config_json = json.dumps(config, sort_keys=True)

    def _data(self):
        return _dataset(self.dataset, self._config_json, self.seed, self.size)

    def extract(self, completion: str) -> str | None:
        """The completion's answer by ``extraction`` (``None``: it gives none)."""
        if self.extraction == "answer_tag":
            from reasoning_gym.utils import extract_answer

            return extract_answer(completion)
        if self.extraction == "last_number":
            numbers = _NUMBER.findall(completion)
            return numbers[-1] if numbers else None
        return completion.strip()

    @staticmethod
    def reference(answer: str) -> str:
        """The reference answer's text (``answer`` is the source's JSON reference)."""
        return json.loads(answer)["answer"]

    def score(self, completion: str, answer: str) -> float:
        reference = json.loads(answer)
        data = self._data()
        entry = data[int(reference["index"])]
        if entry["answer"] != reference["answer"]:
            raise ValueError(f"{self.dataset} item {reference['index']} now has the answer {entry['answer']!r}, the "
                             f"problem says {reference['answer']!r}: not the dataset the problems came from (another "
                             f"reasoning-gym version, config or seed)")
        return float(data.score_answer(self.extract(completion), entry))

    def answer_key(self, completion: str) -> str:
        extracted = self.extract(completion)
        return " ".join((extracted if extracted is not None else completion).split())


class ReasoningGymSource(PromptSource):
    """Problems from a reasoning-gym dataset, with a held-out split that never shares a question with training.

    The dataset's ``size`` items are generated, duplicates of a question dropped (small problem spaces repeat), and
    the unique questions shuffled with ``seed``: the first ``held_out_size`` are held out, the rest are trained on.
    Each prompt is ``instruction + "\\n\\n" + question`` (just the question without an instruction).

    Args:
        dataset: a reasoning-gym dataset name (``basic_arithmetic``, ``chain_sum``, ``gsm_symbolic``, ...).
        config: that dataset's config fields (``min_terms``, ``max_digits``, ...; an unknown field is an error that
            lists the known ones).
        seed: the dataset seed (the items) and the split's shuffle.
        size: items generated (before duplicates are dropped).
        held_out_size: unique questions held out for validation.
        answer_format: the key of the reasoning-gym instruction put before each question
            (``reasoning_gym.utils.SYSTEM_PROMPTS``: ``default``, ``direct``, ``simple``, ``chain_of_draft``,
            ``DeepSeekZero``), or ``None`` for the bare question.
        extraction: how the default verifier finds the answer (see :class:`ReasoningGymVerifier`).
    """

    def __init__(self, dataset: str, config: dict[str, Any] | None = None, seed: int = 0, size: int = 1000,
                 held_out_size: int = 100, answer_format: str | None = "default",
                 extraction: AnswerExtraction = "answer_tag") -> None:
        _reasoning_gym()
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if answer_format is not None and answer_format not in SYSTEM_PROMPTS:
            raise ValueError(f"ReasoningGymSource: answer_format must be one of {sorted(SYSTEM_PROMPTS)} or None, got "
                             f"{answer_format!r}")
        if size < 2 or held_out_size < 1:
            raise ValueError(f"ReasoningGymSource: need size >= 2 and held_out_size >= 1, got {size}, {held_out_size}")
        config = dict(config or {})
        self.verifier = ReasoningGymVerifier(dataset, config, seed, size, extraction)  # checks name and config
        instruction = SYSTEM_PROMPTS[answer_format].strip() + "\n\n" if answer_format is not None else ""
        try:
            data = _dataset(dataset, json.dumps(config, sort_keys=True), seed, size)
        except (AssertionError, TypeError, ValueError) as err:  # reasoning-gym validates its configs with asserts
            raise ValueError(f"ReasoningGymSource: reasoning-gym refused {dataset} with config {config}: {err}"
                             ) from err
        first_index: dict[str, int] = {}
        for index in range(len(data)):
            first_index.setdefault(data[index]["question"], index)
        unique = list(first_index.items())
        random.Random(seed).shuffle(unique)
        if len(unique) <= held_out_size:
            raise ValueError(f"ReasoningGymSource: {dataset} gave {len(unique)} distinct questions in {size} items, "
                             f"not enough to hold out {held_out_size} and train on the rest; raise size or widen the "
                             f"config")
        problems = [Problem(instruction + question, json.dumps({"answer": data[index]["answer"], "index": index}))
                    for question, index in unique]
        self._held_out, self._train = problems[:held_out_size], problems[held_out_size:]

    def train_problems(self) -> list[Problem]:
        return self._train

    def held_out_problems(self) -> list[Problem]:
        return self._held_out

    def default_verifier(self) -> ReasoningGymVerifier:
        """The dataset's own scorer (the DataModule uses it when no verifier is given)."""
        return self.verifier
