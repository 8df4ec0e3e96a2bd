"""Verifiers: score completions against reference answers (exact match, math, user callables)."""

from lightning_rlvr.verifiers.base import CallableVerifier, Isolation, Verifier, VerifierRunner
from lightning_rlvr.verifiers.exact import ExactMatchVerifier
from lightning_rlvr.verifiers.math import MathVerifier, extract_answer

__all__ = [
    "CallableVerifier",
    "ExactMatchVerifier",
    "Isolation",
    "MathVerifier",
    "Verifier",
    "VerifierRunner",
    "extract_answer",
]
