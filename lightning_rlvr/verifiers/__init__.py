"""Verifiers: score completions against reference answers (exact match, math, sandboxed code, user callables)."""

from lightning_rlvr.verifiers.base import CallableVerifier, Isolation, Verifier, VerifierRunner
from lightning_rlvr.verifiers.code import CodeVerifier
from lightning_rlvr.verifiers.exact import ExactMatchVerifier
from lightning_rlvr.verifiers.math import MathVerifier, extract_answer

__all__ = [
    "CallableVerifier",
    "CodeVerifier",
    "ExactMatchVerifier",
    "Isolation",
    "MathVerifier",
    "Verifier",
    "VerifierRunner",
    "extract_answer",
]
