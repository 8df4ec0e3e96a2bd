"""Numerical kernels: chunked log-probabilities and entropy, and the local nucleus statistics."""

from lightning_rlvr.ops.logprobs import (
    TokenStats,
    naive_logprobs_and_entropy,
    nucleus_entropy_and_gap,
    token_logprobs_and_entropy,
)

__all__ = ["TokenStats", "naive_logprobs_and_entropy", "nucleus_entropy_and_gap", "token_logprobs_and_entropy"]
