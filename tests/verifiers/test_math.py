"""extract_answer modes and MathVerifier equivalences (math-verify), plus one run in process isolation."""

from __future__ import annotations

import pytest

from lightning_rlvr.verifiers import MathVerifier, VerifierRunner, extract_answer

# ----------------------------------------------------------------------------- extract_answer: boxed


def test_boxed_extracts_content_with_nested_braces():
    text = r"so the answer is \boxed{\frac{1}{2}}."
    assert extract_answer(text, "boxed") == r"\frac{1}{2}"
    assert extract_answer(r"\boxed{ {a}{ {b} } }", "boxed") == "{a}{ {b} }"


def test_boxed_last_boxed_wins():
    assert extract_answer(r"first \boxed{1}, then \boxed{2}", "boxed") == "2"
    assert extract_answer(r"\boxed{\sqrt{4}} then \boxed{x^{2}}", "boxed") == "x^{2}"


def test_boxed_unbalanced_returns_none():
    assert extract_answer(r"\boxed{\frac{1}{2}", "boxed") is None
    assert extract_answer(r"\boxed{3", "boxed") is None


def test_boxed_absent_returns_none():
    assert extract_answer("the answer is 3", "boxed") is None


def test_hash_takes_text_after_last_marker_stripped():
    assert extract_answer("reasoning #### 5\n more #### 72 \n", "hash") == "72"
    assert extract_answer("... #### 1,234", "hash") == "1,234"


def test_hash_absent_or_empty_returns_none():
    assert extract_answer("no marker 12", "hash") is None
    assert extract_answer("marker but nothing ####   ", "hash") is None


@pytest.mark.parametrize(
    "text,expected",
    [
        ("a 1 then 22 then 333", "333"),
        ("it is -7", "-7"),
        ("pi is about 3.14", "3.14"),
        ("total 1,234 apples", "1,234"),
        ("a ratio of 3/4", "3/4"),
        ("5-3=2", "2"),
    ],
)
def test_last_number_finds_the_last_number(text, expected):
    assert extract_answer(text, "last_number") == expected


def test_last_number_absent_returns_none():
    assert extract_answer("no digits at all", "last_number") is None


def test_last_number_does_not_include_a_trailing_comma():
    # Regression: a number regex ``-?\d[\d,]*`` swallowed a comma that ends the clause ("12, so ...") and
    # returned "12," — not a number.
    assert extract_answer("the answer is 12, so we are done", "last_number") == "12"


def test_auto_prefers_boxed_over_hash_and_number():
    assert extract_answer(r"#### 5 and \boxed{7} then 9", "auto") == "7"


def test_auto_falls_back_to_hash_then_last_number():
    assert extract_answer("#### 5 then 9", "auto") == "5 then 9"
    assert extract_answer("only numbers 4 and 9", "auto") == "9"
    assert extract_answer("nothing here", "auto") is None


def test_auto_unbalanced_boxed_falls_back():
    assert extract_answer(r"\boxed{3 #### 8", "auto") == "8"
    assert extract_answer(r"\boxed{3", "auto") == "3"


def test_auto_empty_hash_falls_back_to_last_number():
    # Regression: auto is "the first of boxed -> hash -> last number that finds something"; an empty "####"
    # finds nothing, and auto once returned None there instead of trying last_number.
    assert extract_answer("the answer is 42 ####", "auto") == "42"


def test_extract_answer_unknown_mode_raises():
    with pytest.raises(ValueError, match="unknown extraction mode"):
        extract_answer("1", "bogus")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- MathVerifier


def test_math_verifier_fraction_equals_decimal():
    v = MathVerifier()
    assert v.score(r"so \boxed{\frac{1}{2}}", "0.5") == 1.0
    assert v.score(r"x = \boxed{0.5}", r"\frac{1}{2}") == 1.0


def test_math_verifier_thousands_separator_is_ignored():
    v = MathVerifier()
    assert v.score("... #### 1,234", "1234") == 1.0
    assert v.score("the total is 1234", "1,234") == 1.0


def test_math_verifier_wrong_answer_scores_zero():
    v = MathVerifier()
    assert v.score(r"\boxed{3}", "4") == 0.0
    assert v.score(r"\boxed{\frac{1}{3}}", "0.5") == 0.0


def test_math_verifier_no_answer_scores_zero():
    assert MathVerifier().score("I do not know", "4") == 0.0
    # boxed-only extraction ignores bare numbers
    assert MathVerifier(extract="boxed").score("the answer is 4", "4") == 0.0


def test_math_verifier_extract_reference_gsm8k_style():
    reference = "Natalia sold 48/2 = 24 clips in May.\nAltogether she sold 48+24 = 72 clips.\n#### 72"
    v = MathVerifier(extract_reference=True)
    assert v.score("She sold 72 clips in total.", reference) == 1.0
    assert v.score(r"\boxed{72}", reference) == 1.0
    assert v.score("She sold 71 clips in total.", reference) == 0.0


def test_math_verifier_extract_reference_without_answer_raises():
    with pytest.raises(ValueError, match="no final answer"):
        MathVerifier(extract="hash", extract_reference=True).score("#### 3", "no marker in reference")


def test_math_verifier_rejects_unknown_extraction():
    with pytest.raises(ValueError, match="extract"):
        MathVerifier(extract="first_number")  # type: ignore[arg-type]


def test_math_verifier_default_isolation_is_process():
    assert MathVerifier().isolation == "process"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_math_verifier_in_process_isolation_gives_correct_rewards():
    # The only MathVerifier test that spawns worker processes (a few seconds of start-up).
    # timeout_s is generous so that the worker start-up (spawn + imports) fits in the batch deadline.
    runner = VerifierRunner(MathVerifier(), timeout_s=10.0, num_workers=1)
    try:
        rewards, errors = runner.score_batch(
            [r"so \boxed{\frac{1}{2}}", "#### 1,234", r"\boxed{7}", "no idea"],
            ["0.5", "1234", "8", "3"],
        )
    finally:
        runner.close()
    assert rewards == [1.0, 1.0, 0.0, 0.0]
    assert errors == 0
