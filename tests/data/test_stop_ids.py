"""Completions end where they stop: every stop id of a two-stop-id chat checkpoint (``builtin:tiny-chat``).

Qwen2.5-Instruct and ``builtin:tiny-chat`` stop on ``<|im_end|>`` (the tokenizer's EOS) *and* ``<|endoftext|>``
(``generation_config.eos_token_id`` lists both). A row that ends on either is scored on its text, is not truncated,
and has ``response_mask = 1`` exactly through its stop id — through a scripted engine, HFEngine and validation
(the vLLM stand-in: tests/rollout/test_vllm_engine.py).
"""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from lightning_rlvr.data import RolloutDataModule
from lightning_rlvr.rollout import HFEngine, VLLMEngine
from lightning_rlvr.rollout.stops import end_of_completion, resolve_stop_token_ids
from lightning_rlvr.tasks import Problem
from lightning_rlvr.verifiers import CallableVerifier, ExactMatchVerifier
from tests.conftest import ListSource, ScriptedEngine, fake_policy
from tests.fake_vllm import FakeLLM, fake_sampling_params


@pytest.fixture(scope="module")
def chat(tiny_chat_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_dir)
    generation = GenerationConfig.from_pretrained(tiny_chat_dir)
    ids = types.SimpleNamespace(**{name: tokenizer.convert_tokens_to_ids(f"<|{name}|>")
                                   for name in ("im_end", "endoftext", "im_start", "pad")})
    return types.SimpleNamespace(tokenizer=tokenizer, generation=generation, dir=tiny_chat_dir, **vars(ids))


def text(chat, string: str) -> list[int]:
    return chat.tokenizer(string, add_special_tokens=False).input_ids


def make_dm(chat, completions, problems, tokenizer=None, **kwargs) -> RolloutDataModule:
    tokenizer = tokenizer or chat.tokenizer
    engine = ScriptedEngine(completions, pad_id=tokenizer.pad_token_id)
    dm = RolloutDataModule(source=ListSource(problems), engine=engine, chat_template=True, **kwargs)
    dm.connect(tokenizer, chat.generation, policy=fake_policy())
    return dm


def test_the_checkpoint_has_two_stop_ids_and_a_distinct_pad(chat):
    assert chat.generation.eos_token_id == [chat.im_end, chat.endoftext]
    assert chat.tokenizer.eos_token_id == chat.im_end
    assert chat.pad not in (chat.im_end, chat.endoftext)


def test_stop_ids_are_the_union_of_generation_config_tokenizer_and_user_ids():
    tokenizer = types.SimpleNamespace(eos_token_id=5)
    assert resolve_stop_token_ids(tokenizer, GenerationConfig(eos_token_id=[9, 5])) == (5, 9)
    assert resolve_stop_token_ids(tokenizer, GenerationConfig(eos_token_id=9)) == (5, 9)
    assert resolve_stop_token_ids(tokenizer, None, extra=[2, 5]) == (2, 5)
    assert resolve_stop_token_ids(types.SimpleNamespace(eos_token_id=None), {"eos_token_id": [3]}) == (3,)
    with pytest.raises(ValueError, match="no stop token"):
        resolve_stop_token_ids(types.SimpleNamespace(eos_token_id=None), GenerationConfig())


def test_end_of_completion_counts_the_first_stop_id_and_nothing_after():
    assert end_of_completion([4, 9, 7, 9], {9}) == (2, True)
    assert end_of_completion([9], [9, 3]) == (1, True)
    assert end_of_completion([4, 4], {9}) == (2, False)
    assert end_of_completion([], {9}) == (0, False)


def test_rows_ending_on_either_stop_id_are_scored_and_padding_is_never_trained(chat):
    problems = [Problem("5+7=", "12")]
    script = [
        text(chat, "12") + [chat.im_end],                      # the tokenizer's EOS
        text(chat, "12") + [chat.endoftext],                   # the other stop id: scored, not truncated
        text(chat, "12") + [chat.endoftext, chat.im_end, 77],  # cut at the first stop id
        text(chat, "1234567"),                                 # no stop id within max_new_tokens: truncated
        text(chat, "13") + [chat.endoftext],                   # ended, wrong answer
    ]
    dm = make_dm(chat, script, problems, verifier=ExactMatchVerifier(), prompts_per_step=1, group_size=5,
                 max_new_tokens=6)
    assert dm.stop_token_ids == (chat.endoftext, chat.im_end)
    batch = dm.rollout(problems)
    assert batch.scores.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert batch.truncated.tolist() == [False, False, False, True, False]
    assert batch.completions[:3] == ["12", "12", "12"] and batch.completions[4] == "13"
    assert batch.response_mask.sum(-1).tolist() == [3.0, 3.0, 3.0, 6.0, 3.0]
    response = batch.input_ids[:, batch.prompt_length:]
    for row, length in zip(range(len(batch)), [3, 3, 3, 6, 3]):
        assert response[row, :length].tolist() == script[row][:length]
        assert batch.response_mask[row, length:].sum() == 0  # nothing past the stop id is trained
        assert batch.attention_mask[row, batch.prompt_length + length:].sum() == 0
    assert batch.stats["rollout/truncated"] == pytest.approx(1 / 5)


def test_with_padding_that_is_a_stop_id_rows_still_end_at_their_first_stop(chat, tiny_chat_dir):
    # Qwen2.5-Instruct pads with <|endoftext|>, one of its stop ids: where a row ends cannot be read off its padding.
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_dir)
    tokenizer.pad_token = "<|endoftext|>"
    problems = [Problem("5+7=", "12")]
    script = [text(chat, "12") + [chat.im_end], text(chat, "7") + [chat.endoftext], text(chat, "1234")]
    dm = make_dm(chat, script, problems, tokenizer=tokenizer, prompts_per_step=1, group_size=3, max_new_tokens=4)
    batch = dm.rollout(problems)
    assert batch.response_mask.sum(-1).tolist() == [3.0, 2.0, 4.0]  # the padded tail is never in the mask
    assert batch.input_ids[1, batch.prompt_length + 2:].eq(chat.endoftext).all()  # padded with the stop id
    assert batch.truncated.tolist() == [False, False, True]
    assert batch.scores.tolist() == [1.0, 0.0, 0.0]


def test_special_tokens_and_padded_vocabulary_ids_inside_an_answer_score_zero(chat):
    problems = [Problem("5+7=", "12")]
    beyond = len(chat.tokenizer)  # embedding rows past the tokenizer (Qwen pads its vocabulary to 64s)
    assert beyond < AutoModelForCausalLM.from_pretrained(chat.dir).config.vocab_size
    script = [text(chat, "1") + [chat.im_start] + text(chat, "2") + [chat.im_end],
              text(chat, "1") + [beyond] + text(chat, "2") + [chat.im_end],
              text(chat, "12") + [chat.im_end]]
    dm = make_dm(chat, script, problems, prompts_per_step=1, group_size=3, max_new_tokens=5)
    batch = dm.rollout(problems)
    assert batch.scores.tolist() == [0.0, 0.0, 1.0]
    assert batch.stats["rollout/invalid"] == pytest.approx(2 / 3)


def test_user_stop_token_ids_end_completions_too(chat):
    problems = [Problem("5+7=", "12")]
    newline = text(chat, "\n")
    assert len(newline) == 1
    dm = make_dm(chat, [text(chat, "12") + newline + text(chat, "99")], problems, stop_token_ids=newline,
                 prompts_per_step=1, group_size=1, max_new_tokens=6)
    batch = dm.rollout(problems)
    assert (batch.completions, batch.scores.tolist(), batch.response_mask.sum().item()) == (["12"], [1.0], 3.0)


def test_validation_scores_rows_ending_on_either_stop_id(chat):
    problems = [Problem("5+7=", "12"), Problem("1+1=", "2")]
    right, other_stop = text(chat, "12") + [chat.endoftext], text(chat, "2") + [chat.endoftext]
    # greedy: one row per problem, both end on <|endoftext|>; then 4 samples per problem for pass@k / maj@k
    script = [right, other_stop,
              right, text(chat, "12") + [chat.im_end], text(chat, "3") + [chat.endoftext], text(chat, "12"),
              other_stop, text(chat, "5") + [chat.im_end], text(chat, "5") + [chat.endoftext], text(chat, "2")]
    dm = make_dm(chat, script, problems, val_samples=4, val_k=2, max_new_tokens=3)
    result = dm.evaluate(problems)
    assert result["greedy_correct"].tolist() == [1.0, 1.0]
    # problem 0: 2 of 4 samples correct -> pass@2 = 1 - C(2,2)/C(4,2) = 5/6; problem 1: 1 of 4 -> 1 - C(3,2)/C(4,2)
    assert result["pass_at_k"].tolist() == pytest.approx([5 / 6, 1 - 3 / 6])
    # maj@2 over the first two samples: "12","12" -> right; "2","5" -> a tie broken by first occurrence ("2")
    assert result["maj_at_k"].tolist() == [1.0, 1.0]


def test_the_datamodule_refuses_an_engine_that_stops_on_an_unknown_id(chat):
    class Stray(ScriptedEngine):
        def generate(self, prompts, n, sampling):
            out = super().generate(prompts, n, sampling)
            out.stopped[:] = True  # claims to have stopped, on a digit
            return out

    problems = [Problem("5+7=", "12")]
    dm = make_dm(chat, [text(chat, "12")], problems, prompts_per_step=1, group_size=1, max_new_tokens=2)
    dm.engine = Stray([text(chat, "12")])
    with pytest.raises(RuntimeError, match="not a stop id"):
        dm.rollout(problems)


ENGINES = {
    "hf_own_loop": lambda: HFEngine(),
    "hf_transformers_generate": lambda: HFEngine(use_cache=False),
    "vllm_stand_in": lambda: VLLMEngine(llm_factory=FakeLLM, sampling_params_factory=fake_sampling_params),
}


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_rows_end_on_either_stop_id_of_the_chat_checkpoint(chat, engine):
    """A random-init policy at a high temperature (2, the most vLLM allows): both stop ids occur, and each row ends where its first one is.

    HFEngine stops on the stop ids it is given; the vLLM stand-in, like vLLM, on the tokenizer's EOS and the
    checkpoint's generation config by itself, plus the ids it is given.
    """
    policy = AutoModelForCausalLM.from_pretrained(chat.dir)
    problems = [Problem(f"{a}+{b}=", str(a + b)) for a, b in [(3, 4), (12, 30), (7, 7), (40, 2)]]
    seen: list[str] = []

    def accept_everything(completion: str, answer: str) -> float:
        seen.append(completion)
        return 1.0

    dm = RolloutDataModule(source=ListSource(problems), engine=ENGINES[engine](),
                           verifier=CallableVerifier(accept_everything), chat_template=True,
                           prompts_per_step=4, group_size=16, max_new_tokens=24, temperature=2.0)
    dm.connect(chat.tokenizer, chat.generation, policy=fake_policy(policy))
    torch.manual_seed(0)
    batch = dm.rollout(problems)
    stops = {chat.im_end, chat.endoftext}
    special = set(chat.tokenizer.all_special_ids)
    response = batch.input_ids[:, batch.prompt_length:]
    ended_on = []
    for row in range(len(batch)):
        length = int(batch.response_mask[row].sum())
        tokens = response[row, :length].tolist()
        stop_positions = [i for i, t in enumerate(tokens) if t in stops]
        if batch.truncated[row]:
            assert not stop_positions and length == 24
            assert batch.scores[row] == 0.0
            continue
        assert stop_positions == [length - 1]  # exactly one stop id, the last trained token
        ended_on.append(tokens[-1])
        answer = tokens[:-1]
        assert batch.completions[row] == chat.tokenizer.decode(answer)
        invalid = any(t in special or t >= len(chat.tokenizer) for t in answer)
        assert batch.scores[row] == (0.0 if invalid else 1.0)
    assert {chat.im_end, chat.endoftext} <= set(ended_on), "the sample should end on both stop ids"
    assert batch.stats["rollout/truncated"] == pytest.approx(batch.truncated.float().mean().item())


def test_math_verifier_scores_real_boxed_answers_through_the_chat_path(chat):
    """The character model has no backslash; the chat tokenizer writes real LaTeX, which math-verify must read."""
    from lightning_rlvr.verifiers import MathVerifier

    problems = [Problem("Simplify \\frac{34}{68}.", "He computes 34/68.\n#### \\frac{1}{2}")]
    completions = {
        "So the answer is \\boxed{\\frac{1}{2}}.": 1.0,
        "Halving gives \\boxed{0.5}": 1.0,                   # equivalent, not equal
        "\\boxed{\\dfrac{2}{4}}": 1.0,
        "The answer is \\boxed{\\frac{1}{3}}.": 0.0,
        "I think it is \\boxed{\\frac{1}{2}": 0.0,           # unbalanced box: auto falls back to the last number 2
    }
    ends = [chat.im_end, chat.endoftext, chat.im_end, chat.endoftext, chat.im_end]
    script = [text(chat, completion) + [end] for completion, end in zip(completions, ends)]
    dm = make_dm(chat, script, problems, verifier=MathVerifier(extract="auto", extract_reference=True),
                 prompt_template="{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
                 prompts_per_step=1, group_size=len(script), max_new_tokens=max(len(s) for s in script),
                 verifier_workers=1)
    try:
        batch = dm.rollout(problems)
    finally:
        dm.teardown("fit")
    assert batch.completions == list(completions)
    assert batch.scores.tolist() == list(completions.values())
    prompt = chat.tokenizer.decode(dm.prompt_ids(problems[0]))
    assert prompt == ("<|im_start|>user\nSimplify \\frac{34}{68}.\nPlease reason step by step, and put your final "
                      "answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")


def test_the_warm_start_teaches_answers_that_end_on_the_datamodules_end_token(chat):
    from lightning_rlvr.callbacks import SupervisedWarmStart

    problems = [Problem("5+7=", "12"), Problem("1+1=", "2")]
    dm = make_dm(chat, [text(chat, "1")], problems)
    assert dm.end_token_id == chat.im_end and dm.end_token_id in dm.stop_token_ids
    policy = AutoModelForCausalLM.from_pretrained(chat.dir)
    seen = []
    policy.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"]), with_kwargs=True)
    SupervisedWarmStart(steps=2, batch_size=4).fit(policy, chat.tokenizer, problems, dm.prompt_ids, dm.end_token_id)
    def unpadded(row: list[int]) -> tuple[int, ...]:
        start = next(i for i, t in enumerate(row) if t != chat.pad)
        return tuple(row[start:])

    rows = {unpadded(row.tolist()) for ids in seen for row in ids}
    expected = {tuple(dm.prompt_ids(p) + text(chat, p.answer) + [chat.im_end]) for p in problems}
    assert rows == expected  # each row: the chat prompt, the answer, <|im_end|>
