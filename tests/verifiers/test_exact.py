"""ExactMatchVerifier: whitespace stripping and case sensitivity options."""

from __future__ import annotations

import pytest

from lightning_rlvr.verifiers import ExactMatchVerifier, VerifierRunner


def test_default_strips_surrounding_whitespace_of_both_sides():
    v = ExactMatchVerifier()
    assert v.score(" 42\n", "42") == 1.0
    assert v.score("42", "\t42  ") == 1.0


def test_strip_false_compares_raw_text():
    v = ExactMatchVerifier(strip=False)
    assert v.score(" 42", "42") == 0.0
    assert v.score("42\n", "42") == 0.0
    assert v.score(" 42", " 42") == 1.0


def test_internal_whitespace_is_never_ignored():
    assert ExactMatchVerifier().score("4 2", "42") == 0.0


def test_default_is_case_sensitive():
    assert ExactMatchVerifier().score("Yes", "yes") == 0.0
    assert ExactMatchVerifier().score("yes", "yes") == 1.0


def test_case_insensitive_option_ignores_case_on_both_sides():
    v = ExactMatchVerifier(case_sensitive=False)
    assert v.score("YES", "yes") == 1.0
    assert v.score("yes", "YeS") == 1.0
    assert v.score("yes", "no") == 0.0


def test_strip_and_case_options_combine():
    assert ExactMatchVerifier(strip=True, case_sensitive=False).score("  ABC ", "abc") == 1.0
    assert ExactMatchVerifier(strip=False, case_sensitive=False).score("  ABC ", "abc") == 0.0


@pytest.mark.parametrize("completion,answer", [("42", "42"), ("41", "42"), ("", "")])
def test_score_is_a_float_indicator(completion, answer):
    value = ExactMatchVerifier().score(completion, answer)
    assert type(value) is float
    assert value == float(completion == answer)


def test_exact_match_runs_inline_through_runner():
    v = ExactMatchVerifier()
    assert v.isolation == "inline"
    runner = VerifierRunner(v, timeout_s=1.0)
    try:
        rewards, errors = runner.score_batch(["1", " 2 ", "3"], ["1", "2", "4"])
    finally:
        runner.close()
    assert rewards == [1.0, 1.0, 0.0]
    assert errors == 0
