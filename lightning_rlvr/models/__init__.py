"""Offline model builders (the embedded default policy) and model loading."""

from lightning_rlvr.models.tiny import TinyModelConfig, build_tiny_model, build_tiny_tokenizer

__all__ = ["TinyModelConfig", "build_tiny_model", "build_tiny_tokenizer"]
