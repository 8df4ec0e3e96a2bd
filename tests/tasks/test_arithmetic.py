"""ArithmeticTask: deterministic, disjoint train / held-out splits covering the whole problem space."""

from __future__ import annotations

import itertools
import re

import pytest

from lightning_rlvr.tasks import ArithmeticTask, Problem


def _all(task: ArithmeticTask) -> list[Problem]:
    return task.train + task.held_out


def _expected_prompts(name: str, max_operand: int = 49, num_digits: int = 3) -> set[str]:
    if name == "addition":
        return {f"{a}+{b}=" for a in range(max_operand + 1) for b in range(max_operand + 1)}
    if name == "addition3":
        return {f"{a}+{b}+{c}=" for a, b, c in itertools.product(range(10), repeat=3)}
    return {"rev " + "".join(d) + "=" for d in itertools.product("0123456789", repeat=num_digits)}


@pytest.mark.parametrize("max_operand", [1, 9, 49])
def test_addition_splits_cover_the_whole_space_disjointly(max_operand):
    task = ArithmeticTask("addition", max_operand=max_operand)
    train, held = [p.prompt for p in task.train], [p.prompt for p in task.held_out]
    assert len(train) + len(held) == (max_operand + 1) ** 2
    assert len(set(train)) == len(train) and len(set(held)) == len(held)
    assert not set(train) & set(held)
    assert set(train) | set(held) == _expected_prompts("addition", max_operand)


@pytest.mark.parametrize("name", ["addition3", "reverse"])
def test_other_tasks_cover_their_whole_space(name):
    task = ArithmeticTask(name, num_digits=3)
    prompts = [p.prompt for p in _all(task)]
    assert len(prompts) == 1000 == len(set(prompts))
    assert set(prompts) == _expected_prompts(name, num_digits=3)
    assert not {p.prompt for p in task.train} & {p.prompt for p in task.held_out}


@pytest.mark.parametrize("fraction,space,expected", [(0.15, 2500, 375), (0.1, 100, 10), (0.01, 4, 1)])
def test_held_out_size_is_the_rounded_fraction_at_least_one(fraction, space, expected):
    max_operand = int(space**0.5) - 1
    task = ArithmeticTask("addition", max_operand=max_operand, held_out_fraction=fraction, warm_start_fraction=0.0)
    assert len(task.held_out) == expected
    assert len(task.train) == space - expected


def test_addition_answers_are_correct():
    for p in _all(ArithmeticTask("addition", max_operand=49)):
        m = re.fullmatch(r"(\d+)\+(\d+)=", p.prompt)
        assert m, p.prompt
        assert p.answer == str(int(m.group(1)) + int(m.group(2)))


def test_addition3_answers_are_correct():
    for p in _all(ArithmeticTask("addition3")):
        m = re.fullmatch(r"(\d)\+(\d)\+(\d)=", p.prompt)
        assert m, p.prompt
        assert p.answer == str(sum(int(g) for g in m.groups()))


@pytest.mark.parametrize("num_digits", [1, 3])
def test_reverse_answers_are_reversed_digits(num_digits):
    problems = _all(ArithmeticTask("reverse", num_digits=num_digits))
    assert len(problems) == 10**num_digits
    for p in problems:
        m = re.fullmatch(rf"rev (\d{{{num_digits}}})=", p.prompt)
        assert m, p.prompt
        assert p.answer == "".join(reversed(m.group(1)))
    if num_digits == 3:
        assert Problem("rev 007=", "700") in problems  # leading zeros are kept


def test_reverse_large_space_is_a_fixed_sample_of_20k():
    a = ArithmeticTask("reverse", num_digits=5, seed=0)
    b = ArithmeticTask("reverse", num_digits=5, seed=1)
    prompts = [p.prompt for p in _all(a)]
    assert len(prompts) == 20_000 == len(set(prompts))
    assert set(prompts) == {p.prompt for p in _all(b)}  # the sample does not depend on the split seed
    for p in _all(a)[:500]:
        digits = p.prompt[4:-1]
        assert len(digits) == 5 and digits.isdigit() and p.answer == digits[::-1]


@pytest.mark.parametrize("name", ["addition", "addition3", "reverse"])
def test_splits_are_deterministic_for_a_seed(name):
    a, b = ArithmeticTask(name, seed=3), ArithmeticTask(name, seed=3)
    assert a.train == b.train and a.held_out == b.held_out and a.warm_start == b.warm_start


@pytest.mark.parametrize("name", ["addition", "addition3", "reverse"])
def test_splits_differ_for_another_seed(name):
    a, b = ArithmeticTask(name, seed=0), ArithmeticTask(name, seed=1)
    assert set(a.held_out) != set(b.held_out)
    assert set(a.train) | set(a.held_out) == set(b.train) | set(b.held_out)


def test_warm_start_is_a_subset_of_train_sized_from_whole_space():
    task = ArithmeticTask("addition", max_operand=19, held_out_fraction=0.2, warm_start_fraction=0.1)
    assert len(task.warm_start) == round(0.1 * 400) == 40
    assert set(task.warm_start) <= set(task.train)
    assert not set(task.warm_start) & set(task.held_out)


def test_zero_warm_start_fraction_gives_empty_warm_start():
    assert ArithmeticTask("addition", max_operand=9, warm_start_fraction=0.0).warm_start == []


def test_problem_is_frozen():
    p = Problem("1+1=", "2")
    with pytest.raises(AttributeError):
        p.answer = "3"  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"name": "multiplication"}, "unknown task"),
        ({"max_operand": 0}, "max_operand"),
        ({"num_digits": 0}, "num_digits"),
        ({"num_digits": 9}, "num_digits"),
        ({"held_out_fraction": 0.0}, "held_out_fraction"),
        ({"held_out_fraction": 1.0}, "held_out_fraction"),
        ({"warm_start_fraction": -0.1}, "warm_start_fraction"),
        ({"held_out_fraction": 0.5, "warm_start_fraction": 0.5}, "warm_start_fraction"),
    ],
)
def test_invalid_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)
