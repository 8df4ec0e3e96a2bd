"""Exact-match verifier: reward 1 if the completion equals the reference answer."""

from __future__ import annotations

from lightning_rlvr.verifiers.base import Verifier

__all__ = ["ExactMatchVerifier"]


class ExactMatchVerifier(Verifier):
    """``reward = 1[normalise(completion) == normalise(answer)]``.

    Args:
        strip: ignore leading/trailing whitespace.
        case_sensitive: compare case-sensitively.

    Example::

        >>> ExactMatchVerifier().score(" 42", "42")
        1.0
    """

    isolation = "inline"  # a pure, total function: no pool needed

    def __init__(self, strip: bool = True, case_sensitive: bool = True) -> None:
        self.strip = strip
        self.case_sensitive = case_sensitive

    def _normalise(self, text: str) -> str:
        text = text.strip() if self.strip else text
        return text if self.case_sensitive else text.lower()

    def score(self, completion: str, answer: str) -> float:
        return float(self._normalise(completion) == self._normalise(answer))

    def answer_key(self, completion: str) -> str:
        return self._normalise(completion)
