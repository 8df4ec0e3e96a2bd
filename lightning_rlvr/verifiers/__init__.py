"""Verifiers: score completions against reference answers (exact match, math, sandboxed code, user callables)."""

from lightning_rlvr.verifiers.base import (
    RESERVED_REWARD_NAMES,
    CallableVerifier,
    Isolation,
    Score,
    Verdict,
    Verifier,
    VerifierRunner,
)
from lightning_rlvr.verifiers.code import CodeVerifier
from lightning_rlvr.verifiers.exact import ExactMatchVerifier
from lightning_rlvr.verifiers.math import MathVerifier, extract_answer

__all__ = [
    "RESERVED_REWARD_NAMES",
    "CallableVerifier",
    "CodeVerifier",
    "ExactMatchVerifier",
    "Isolation",
    "MathVerifier",
    "Score",
    "Verdict",
    "Verifier",
    "VerifierRunner",
    "extract_answer",
]
