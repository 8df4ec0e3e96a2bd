"""When a completion has ended: the one definition shared by the engines, the DataModule, validation and the warm start.

A completion ends at its first *stop id*, or is *truncated* when it reaches the generation limit without one.
The stop ids are

    generation_config.eos_token_id (an int or a list)  ∪  tokenizer.eos_token_id  ∪  user stop_token_ids

— the set vLLM stops on (its ``SamplingParams`` adds the generation config's EOS ids to the tokenizer's EOS) and
transformers' ``generate`` stops on (the generation config's list). Instruct checkpoints list several: Qwen2.5-Instruct
``<|im_end|>`` and ``<|endoftext|>``, Llama-3-Instruct three. The stop id itself belongs to the completion (the
policy learns to emit it); nothing after it does, whatever its id — Qwen's padding token is one of its stop ids, so
where a row ends can never be read back from its padding: engines report each row's length and whether it
stopped (:class:`~lightning_rlvr.rollout.GenerationOutput`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["end_of_completion", "resolve_stop_token_ids"]


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def resolve_stop_token_ids(tokenizer: Any = None, generation_config: Any = None,
                           extra: Iterable[int] = ()) -> tuple[int, ...]:
    """The sorted stop ids: ``generation_config.eos_token_id ∪ tokenizer.eos_token_id ∪ extra``.

    Args:
        tokenizer: anything with ``eos_token_id`` (``None`` or an unset id adds nothing).
        generation_config: a ``transformers.GenerationConfig`` (or a dict) whose ``eos_token_id`` is an int or a list.
        extra: further ids (``RolloutDataModule(stop_token_ids=...)``).

    Raises:
        ValueError: if the union is empty (nothing could end a completion) or holds a negative id.

    Example::

        >>> from types import SimpleNamespace
        >>> resolve_stop_token_ids(SimpleNamespace(eos_token_id=7), {"eos_token_id": [7, 3]}, extra=[11])
        (3, 7, 11)
    """
    eos = generation_config.get("eos_token_id") if isinstance(generation_config, dict) else \
        getattr(generation_config, "eos_token_id", None)
    ids = set(_as_ids(eos)) | set(_as_ids(getattr(tokenizer, "eos_token_id", None))) | set(_as_ids(list(extra)))
    if not ids:
        raise ValueError("no stop token: neither the tokenizer nor the generation config has an eos_token_id and no "
                         "stop_token_ids were given, so no completion could end")
    if min(ids) < 0:
        raise ValueError(f"stop token ids must be >= 0, got {sorted(ids)}")
    return tuple(sorted(ids))


def end_of_completion(tokens: Sequence[int], stop_ids: Iterable[int]) -> tuple[int, bool]:
    """``(length, stopped)`` of a generated token sequence: cut after its first stop id.

    ``length`` counts the stop id (it is part of the completion); ``stopped`` is ``False`` when no stop id occurs,
    i.e. the completion ran to the generation limit (truncated) and ``length == len(tokens)``.

    Example::

        >>> end_of_completion([5, 6, 3, 0, 0], {3, 7})
        (3, True)
        >>> end_of_completion([5, 6, 8], {3, 7})
        (3, False)
    """
    stops = stop_ids if isinstance(stop_ids, (set, frozenset)) else set(stop_ids)
    for position, token in enumerate(tokens):
        if token in stops:
            return position + 1, True
    return len(tokens), False
