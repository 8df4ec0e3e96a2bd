"""ReasoningGymSource and ReasoningGymVerifier: reasoning-gym's tasks, a disjoint held-out split, its own scoring."""

from __future__ import annotations

import builtins
import json
import re

import pytest

from lightning_rlvr.data import ReasoningGymSource, ReasoningGymVerifier, RolloutDataModule
from lightning_rlvr.verifiers import ExactMatchVerifier

pytest.importorskip("reasoning_gym")

SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
        "allow_negation": False, "allow_parentheses": False}


def operands(prompt: str) -> tuple[int, int]:
    a, b = re.search(r"(\d+) \+ (\d+)", prompt).groups()
    return int(a), int(b)


@pytest.fixture(scope="module")
def sums() -> ReasoningGymSource:
    return ReasoningGymSource("basic_arithmetic", config=SUMS, seed=1, size=600, held_out_size=40,
                              answer_format="direct")


def test_the_held_out_split_shares_no_question_with_training_and_answers_are_the_sums(sums):
    train, held_out = sums.train_problems(), sums.held_out_problems()
    assert len(held_out) == 40 and len(train) > 50
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
    assert len({p.prompt for p in train}) == len(train)  # duplicates dropped
    for problem in train + held_out:
        a, b = operands(problem.prompt)
        assert ReasoningGymVerifier.reference(problem.answer) == str(a + b)  # computed here, not by reasoning-gym


def test_the_prompt_carries_reasoning_gyms_answer_format(sums):
    from reasoning_gym.utils import SYSTEM_PROMPTS

    prompt = sums.train_problems()[0].prompt
    assert prompt.startswith(SYSTEM_PROMPTS["direct"].strip() + "\n\n") and "<answer>" in prompt
    bare = ReasoningGymSource("basic_arithmetic", config=SUMS, seed=1, size=100, held_out_size=5, answer_format=None)
    assert re.fullmatch(r"Calculate \d+ \+ \d+\.", bare.train_problems()[0].prompt)


def test_the_verifier_scores_the_tagged_answer_and_nothing_else(sums):
    verifier = sums.default_verifier()
    problem = sums.held_out_problems()[0]
    right = str(sum(operands(problem.prompt)))
    wrong = str(sum(operands(problem.prompt)) + 1)
    assert verifier.score(f"thinking... <answer>{right}</answer>", problem.answer) == 1.0
    assert verifier.score(f"<answer>{wrong}</answer>", problem.answer) == 0.0
    assert verifier.score(f"The answer is {right}.", problem.answer) == 0.0  # reasoning-gym's convention: tags
    assert verifier.score(f"<answer>{wrong}</answer> then <answer>{right}</answer>", problem.answer) == 1.0  # last
    assert verifier.answer_key(f"so <answer> {right} </answer>") == right


def test_last_number_extraction_scores_a_model_that_does_not_write_tags():
    source = ReasoningGymSource("basic_arithmetic", config=SUMS, seed=1, size=100, held_out_size=5,
                                answer_format=None, extraction="last_number")
    problem = source.held_out_problems()[0]
    a, b = operands(problem.prompt)
    verifier = source.default_verifier()
    assert verifier.score(f"{a} + {b} = {a + b}", problem.answer) == 1.0
    assert verifier.score(f"{a} + {b} = {a + b + 1}", problem.answer) == 0.0
    assert verifier.score("I cannot say.", problem.answer) == 0.0


def test_a_reference_from_another_dataset_is_named_not_misscored(sums):
    verifier = ReasoningGymVerifier("basic_arithmetic", SUMS, seed=2, size=600)  # another seed: other items
    mismatched = next(p for p in sums.held_out_problems()
                      if verifier._data()[json.loads(p.answer)["index"]]["answer"] != json.loads(p.answer)["answer"])
    with pytest.raises(ValueError, match="not the dataset the problems came from"):
        verifier.score("<answer>1</answer>", mismatched.answer)


def test_the_datamodule_scores_with_the_sources_verifier_unless_given_another(sums):
    assert isinstance(RolloutDataModule(source=sums).verifier, ReasoningGymVerifier)
    assert isinstance(RolloutDataModule(source=sums, verifier=ExactMatchVerifier()).verifier, ExactMatchVerifier)


def test_bad_configurations_say_what_is_wrong():
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset 'basic_arithmetics'.*basic_arithmetic"):
        ReasoningGymSource("basic_arithmetics")
    with pytest.raises(ValueError, match="no config field max_digit .*max_digits"):
        ReasoningGymSource("basic_arithmetic", config={"max_digit": 1})
    with pytest.raises(ValueError, match="reasoning-gym refused basic_arithmetic"):
        ReasoningGymSource("basic_arithmetic", config={"min_terms": 3, "max_terms": 2})
    with pytest.raises(ValueError, match="answer_format must be one of"):
        ReasoningGymSource("basic_arithmetic", answer_format="terse")
    with pytest.raises(ValueError, match="distinct questions"):  # 50 items cannot hold out 100 questions
        ReasoningGymSource("basic_arithmetic", config=SUMS, size=50, held_out_size=100)
    with pytest.raises(ValueError, match="extraction must be"):
        ReasoningGymVerifier("basic_arithmetic", extraction="boxed")


def test_a_missing_extra_names_it(monkeypatch):
    real_import = builtins.__import__

    def no_reasoning_gym(name, *args, **kwargs):
        if name == "reasoning_gym" or name.startswith("reasoning_gym."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_reasoning_gym)
    with pytest.raises(ImportError, match=r"pip install 'lightning_rlvr\[reasoning-gym\]'"):
        ReasoningGymSource("basic_arithmetic")
