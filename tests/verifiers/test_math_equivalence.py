"""MathVerifier on a table of answer pairs with known truth values, and a parser-hanging input under the runner."""

from __future__ import annotations

import time

import pytest

from lightning_rlvr.verifiers import MathVerifier, VerifierRunner
from lightning_rlvr.verifiers.base import _KILL_GRACE_S

# (completion, reference answer, mathematically equal?) — grouped by what they exercise.
TABLE = [
    # fractions and decimals
    (r"\boxed{\frac{1}{2}}", "0.5", True),
    (r"\boxed{0.5}", r"\frac{1}{2}", True),
    (r"\boxed{\dfrac{3}{4}}", "0.75", True),
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", True),
    (r"\boxed{1/3}", r"\frac{1}{3}", True),
    (r"\boxed{-\frac{5}{2}}", "-2.5", True),
    (r"\boxed{2.50}", "2.5", True),
    (r"\boxed{0}", "-0", True),
    # LaTeX expressions
    (r"\boxed{\sqrt{2}}", r"2^{1/2}", True),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", True),
    (r"\boxed{\pi}", r"\pi", True),
    (r"\boxed{x^2+2x+1}", r"(x+1)^2", True),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\sin(\pi/3)", True),
    (r"\boxed{10^3}", "1000", True),
    (r"\boxed{x=3}", "3", True),
    (r"\boxed{y = 2x + 1}", "2x+1", True),
    # units, percent, degrees, currency
    (r"\boxed{10\%}", r"10\%", True),
    (r"\boxed{5 \text{ cm}}", "5", True),
    (r"\boxed{12\text{ dollars}}", "12", True),
    (r"\boxed{90^\circ}", "90", True),
    (r"\boxed{\$5}", "5", True),
    ("it costs $18.", "18", True),
    # intervals and sets
    (r"\boxed{[1, 3)}", "[1,3)", True),
    (r"\boxed{(-\infty, 2]}", r"(-\infty,2]", True),
    (r"\boxed{2, 3}", "3, 2", True),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", True),
    # GSM8K-style and plain-text answers
    ("#### 1,234", "1234", True),
    ("#### 1234", "1,234", True),
    ("#### 72", "72", True),
    ("The answer is 42.", "42", True),
    # wrong answers
    (r"\boxed{0.33}", r"\frac{1}{3}", False),
    (r"\boxed{\frac{5}{2}}", "-2.5", False),
    (r"\boxed{3.14}", r"\pi", False),
    (r"\boxed{x^2+1}", r"(x+1)^2", False),
    (r"\boxed{(1, 3)}", "[1,3)", False),
    (r"\boxed{[0, 1]}", "[0,1)", False),
    (r"\boxed{7 \text{ cm}}", "5", False),
    ("#### 71", "72", False),
    ("so 41 apples", "42", False),
    (r"\boxed{1,2,4}", "1,2,3", False),
    (r"\boxed{-3}", "3", False),
    # malformed LaTeX or no answer
    (r"\boxed{\frac{1}{2}", "0.5", False),  # unbalanced: falls back to the last number, 2
    (r"\boxed{\frac{1}{}}", "1", False),
    (r"\boxed{\frac{}{}}", "0", False),
    (r"\boxed{}", "0", False),
    ("no answer here", "3", False),
]


def test_the_table_has_at_least_40_pairs_of_both_kinds():
    assert len(TABLE) >= 40
    assert sum(equal for *_, equal in TABLE) >= 15 and sum(not equal for *_, equal in TABLE) >= 15


@pytest.mark.parametrize(("completion", "reference", "equal"), TABLE, ids=lambda v: str(v)[:30])
def test_math_verifier_scores_each_pair_by_its_known_equivalence(completion, reference, equal):
    assert MathVerifier().score(completion, reference) == float(equal)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_input_that_hangs_the_parser_scores_zero_within_the_time_limit():
    # sympy evaluates 9^(9^(9^9)) exactly, in C where the worker's timer cannot interrupt it: more than 20 s
    # in-process (measured), i.e. forever for a reward. The runner kills the worker after the limit and a grace.
    hang = r"\boxed{9^{9^{9^{9}}}}"
    runner = VerifierRunner(MathVerifier(), timeout_s=2.0, num_workers=1)
    try:
        runner.score_batch([r"\boxed{1}"], ["1"])  # start the worker first: its start-up is not the call's time
        start = time.perf_counter()
        rewards, errors = runner.score_batch([hang], ["1"])
        elapsed = time.perf_counter() - start
        assert (rewards, errors) == ([0.0], 1)
        assert elapsed < 2.0 + _KILL_GRACE_S + 8.0  # the limit and the grace, plus a margin for a loaded machine
        # A call queued behind a hung one is not lost: it is scored in a fresh worker.
        assert runner.score_batch([hang, r"\boxed{\frac{1}{2}}"], ["1", "0.5"]) == ([0.0, 1.0], 1)
    finally:
        runner.close()
