"""Offline model builders (the embedded default policies) and model loading."""

from lightning_rlvr.models.tiny import TinyModelConfig, build_tiny_model, build_tiny_tokenizer
from lightning_rlvr.models.tiny_chat import build_tiny_chat_model, build_tiny_chat_tokenizer

__all__ = ["TinyModelConfig", "build_tiny_chat_model", "build_tiny_chat_tokenizer", "build_tiny_model",
           "build_tiny_tokenizer"]
