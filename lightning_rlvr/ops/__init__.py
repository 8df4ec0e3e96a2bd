"""Numerical kernels: chunked log-probabilities and entropy."""

from lightning_rlvr.ops.logprobs import TokenStats, naive_logprobs_and_entropy, token_logprobs_and_entropy

__all__ = ["TokenStats", "naive_logprobs_and_entropy", "token_logprobs_and_entropy"]
