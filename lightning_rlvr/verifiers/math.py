"""Math final-answer verifier: extract the final answer, check equivalence with math-verify.

Extraction (``extract``):

- ``"boxed"``: the content of the last ``\\boxed{...}`` (balanced braces);
- ``"hash"``: the text after the last ``####`` (GSM8K style);
- ``"last_number"``: the last number in the text;
- ``"auto"``: the first of boxed → hash → last number that finds something.

Equivalence uses ``math_verify.parse`` / ``verify`` (symbolic and numeric: ``\\frac{1}{2}`` equals ``0.5``).
math-verify's own timeouts use ``signal.alarm`` and so work only in a main thread; they are switched off
here and the time limit is enforced by :class:`~lightning_rlvr.verifiers.base.VerifierRunner`, which runs
this verifier in worker processes (``isolation = "process"``) under a per-call timer.
"""

from __future__ import annotations

import logging
import re
from typing import Literal

from lightning_rlvr.verifiers.base import Verifier

__all__ = ["MathVerifier", "extract_answer"]

Extraction = Literal["boxed", "hash", "last_number", "auto"]
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # unbalanced


def extract_answer(text: str, mode: Extraction = "auto") -> str | None:
    """The final answer in ``text`` by ``mode``, or ``None`` if there is none.

    Example::

        >>> extract_answer("so the answer is \\\\boxed{\\\\frac{1}{2}}.")
        '\\\\frac{1}{2}'
        >>> extract_answer("... #### 1,234")
        '1,234'
    """
    if mode in ("boxed", "auto"):
        boxed = _last_boxed(text)
        if boxed is not None or mode == "boxed":
            return boxed
    if mode in ("hash", "auto"):
        idx = text.rfind("####")
        after = text[idx + 4 :].strip() if idx >= 0 else ""
        if after or mode == "hash":
            return after or None
    if mode in ("last_number", "auto"):
        numbers = _NUMBER.findall(text)
        return numbers[-1] if numbers else None
    raise ValueError(f"unknown extraction mode {mode!r}")


class MathVerifier(Verifier):
    """Reward 1 if the completion's final answer is mathematically equal to the reference answer.

    Args:
        extract: how to find the completion's final answer (see module docstring).
        extract_reference: also run extraction on the reference answer (for references that are full
            solutions, e.g. GSM8K's ``"... #### 72"``); otherwise the reference is used as is.

    Example::

        >>> MathVerifier().score("x = \\\\boxed{0.5}", "\\\\frac{1}{2}")
        1.0
    """

    isolation = "process"

    def __init__(self, extract: Extraction = "auto", extract_reference: bool = False) -> None:
        if extract not in ("boxed", "hash", "last_number", "auto"):
            raise ValueError(f"MathVerifier.extract must be boxed, hash, last_number or auto; got {extract!r}")
        self.extract = extract
        self.extract_reference = extract_reference

    def answer_key(self, completion: str) -> str:
        """The extracted final answer (commas and spaces dropped), or the normalised text when none is found."""
        extracted = extract_answer(completion, self.extract)
        return "".join(extracted.replace(",", "").split()) if extracted is not None else " ".join(completion.split())

    @staticmethod
    def _as_math(text: str) -> str:
        text = text.replace("\\$", "")  # an escaped dollar is a currency sign, not a math delimiter: \$5 is 5
        text = text.replace(",", "") if re.fullmatch(r"-?[\d,]+(\.\d+)?", text) else text
        # math-verify parses LaTeX inside math delimiters; a bare answer is wrapped.
        return text if "$" in text else f"${text}$"

    def score(self, completion: str, answer: str) -> float:
        from math_verify import parse, verify

        # math-verify warns on every call that its own timeouts are off; the runner enforces them.
        logging.getLogger("math_verify").setLevel(logging.ERROR)

        predicted = extract_answer(completion, self.extract)
        if predicted is None:
            return 0.0
        reference = extract_answer(answer, self.extract) if self.extract_reference else answer
        if reference is None:
            raise ValueError(f"no final answer could be extracted from the reference {answer!r}")
        gold = parse(self._as_math(reference), parsing_timeout=None)
        pred = parse(self._as_math(predicted), parsing_timeout=None)
        return float(verify(gold, pred, timeout_seconds=None))
