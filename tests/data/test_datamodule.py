"""RolloutDataModule: EOS cutting, reward hacking guards, dynamic sampling, overlong shaping, engine sync."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from lightning_rlvr.data import RolloutDataModule
from lightning_rlvr.tasks import Problem
from lightning_rlvr.verifiers import CallableVerifier
from tests.conftest import ListSource, ScriptedEngine, fake_policy

EOS, PAD, UNK, BOS = 2, 0, 3, 1


def digits(text: str) -> list[int]:
    return [4 + int(c) for c in text]  # '0' is token 4 in the tiny char tokenizer


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def make_dm(tokenizer, completions, problems=None, **kwargs):
    problems = problems or [Problem("5+7=", "12"), Problem("1+1=", "2")]
    dm = RolloutDataModule(source=ListSource(problems), engine=ScriptedEngine(completions), **kwargs)
    dm.connect(tokenizer, policy=fake_policy())
    return dm


def test_tokenizer_ids_assumed_by_these_tests(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (
        PAD, BOS, EOS, UNK)
    assert tokenizer("12", add_special_tokens=False).input_ids == digits("12")


def test_completions_are_cut_at_first_eos_and_guarded_against_reward_hacking(tokenizer):
    script = [
        digits("12") + [EOS, 7],           # correct; the token after EOS is dropped
        digits("12") + digits("34"),       # no EOS: truncated -> 0 even though it starts with "12"
        [PAD] + digits("12") + [EOS],      # special token inside the answer -> 0 ("<pad>12" read as "12")
        [digits("1")[0], UNK, digits("2")[0], EOS],  # "1<unk>2" -> 0
    ]
    problems = [Problem("5+7=", "12")]
    dm = make_dm(tokenizer, script, problems, prompts_per_step=1, group_size=4, max_new_tokens=4)
    batch = dm.rollout(problems)
    assert batch.scores.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert batch.truncated.tolist() == [False, True, False, False]
    assert batch.response_mask.sum(-1).tolist() == [3.0, 4.0, 4.0, 4.0]
    assert batch.completions[0] == "12"
    assert batch.completion_ids[0, :3].tolist() == digits("12") + [EOS]
    assert batch.stats["rollout/truncated"] == pytest.approx(0.25)
    assert batch.stats["rollout/invalid"] == pytest.approx(0.5)
    assert batch.stats["reward/accuracy"] == pytest.approx(0.25)
    # attention covers the real prompt tokens and the completion through EOS
    prompt = tokenizer("5+7=").input_ids
    assert batch.attention_mask[0].sum().item() == len(prompt) + 3
    assert batch.input_ids[0, batch.prompt_length - len(prompt) : batch.prompt_length].tolist() == prompt


def test_group_ids_and_zero_std_fraction(tokenizer):
    ok, bad = digits("12") + [EOS], digits("99") + [EOS]
    # group 0 ("5+7=" -> 12): [ok, bad] informative; group 1 ("1+1=" -> 2): [ok-for-12, bad] both wrong
    dm = make_dm(tokenizer, [ok, bad, ok, bad], prompts_per_step=2, group_size=2)
    batch = dm.rollout(dm.source.train_problems())
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert batch.stats["rollout/zero_std_groups"] == pytest.approx(0.5)


def test_dynamic_sampling_refills_until_enough_informative_groups(tokenizer):
    ok, bad = digits("12") + [EOS], digits("99") + [EOS]
    problems = [Problem("5+7=", "12"), Problem("1+1=", "2")]
    # round 1: group 0 informative, group 1 all wrong; round 2 (1 refill prompt, always "5+7=" here): informative
    dm = make_dm(tokenizer, [ok, bad, bad, bad, bad, ok], [Problem("5+7=", "12")] * 1, prompts_per_step=2,
                 group_size=2, dynamic_sampling=True, max_generation_rounds=3)
    batch = dm.rollout(problems)
    assert dm.engine.calls == [(2, 2), (1, 2)]
    assert batch.stats["rollout/generation_rounds"] == 2
    assert batch.stats["rollout/kept_groups"] == 2
    assert len(batch) == 4
    for g in batch.group_ids.unique():
        assert batch.rewards[batch.group_ids == g].std() > 0


def test_dynamic_sampling_stops_at_the_round_limit_with_a_warning(tokenizer):
    bad = digits("99") + [EOS]
    dm = make_dm(tokenizer, [bad], prompts_per_step=2, group_size=2, dynamic_sampling=True, max_generation_rounds=2)
    with pytest.warns(UserWarning, match="kept no informative group"):
        batch = dm.rollout(dm.source.train_problems())
    assert len(dm.engine.calls) == 2
    assert len(batch) == 4  # falls back to the last round (zero advantages)


def test_overlong_penalty_is_added_to_the_reward(tokenizer):
    # max_new_tokens 4, buffer 2: no penalty up to length 2, -(L-2)/2 beyond
    script = [digits("1") + [EOS], digits("12") + [EOS], digits("123") + [EOS]]
    problems = [Problem("0+12=", "12")]
    dm = make_dm(tokenizer, script, problems, prompts_per_step=1, group_size=3, max_new_tokens=4,
                 overlong_buffer=2, overlong_penalty_factor=1.0)
    batch = dm.rollout(problems)
    assert batch.scores.tolist() == [0.0, 1.0, 0.0]
    assert batch.rewards.tolist() == pytest.approx([0.0, 1.0 - 0.5, -1.0])


def test_engine_is_synced_only_when_the_policy_version_changes(tokenizer):
    dm = make_dm(tokenizer, [digits("12") + [EOS]], prompts_per_step=2, group_size=1)
    dm.rollout(dm.source.train_problems())
    dm.rollout(dm.source.train_problems())
    assert dm.engine.synced == [0]
    dm.policy_handle.policy_version = 3
    batch = dm.rollout(dm.source.train_problems())
    assert dm.engine.synced == [0, 3]
    assert batch.policy_version == 3


def test_verifier_errors_give_zero_reward_and_are_counted(tokenizer):
    def flaky(completion: str, answer: str) -> float:
        if completion == "99":
            raise RuntimeError("verifier bug")
        return float(completion == answer)

    ok, bad = digits("12") + [EOS], digits("99") + [EOS]
    problems = [Problem("5+7=", "12")]
    dm = make_dm(tokenizer, [ok, bad, bad, ok], problems, prompts_per_step=1, group_size=4,
                 verifier=CallableVerifier(flaky, isolation="inline"))
    with pytest.warns(UserWarning, match="verifier bug"):
        batch = dm.rollout(problems)
    assert batch.scores.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert batch.stats["reward/verifier_errors"] == 2


def test_evaluate_reports_greedy_correctness_and_pass_at_k(tokenizer):
    ok, bad = digits("12") + [EOS], digits("99") + [EOS]
    problems = [Problem("5+7=", "12")]
    # greedy call: 1 row (ok); sampled call: 4 rows with 1 correct -> pass@2 = 1 - C(3,2)/C(4,2) = 0.5
    dm = make_dm(tokenizer, [ok, ok, bad, bad, bad], problems, val_samples=4, val_k=2)
    result = dm.evaluate(problems)
    assert result["greedy_correct"].tolist() == [1.0]
    assert result["pass_at_k"].tolist() == pytest.approx([0.5])
    assert result["maj_at_k"].tolist() == [1.0]  # the first 2 samples, "12" and "99", tie: the first seen wins


@pytest.mark.parametrize("samples, k, majority", [(["99", "12", "12", "99"], 3, 1.0), (["99", "12", "99", "12"], 3, 0.0),
                                                  (["12", "99", "99", "12"], 4, 1.0)])
def test_majority_vote_over_the_first_k_samples(tokenizer, samples, k, majority):
    problems = [Problem("5+7=", "12")]
    rows = [digits("12") + [EOS]] + [digits(s) + [EOS] for s in samples]
    result = make_dm(tokenizer, rows, problems, val_samples=4, val_k=k).evaluate(problems)
    assert result["maj_at_k"].tolist() == [majority]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"group_size": 0}, "group_size"),
        ({"prompts_per_step": 0}, "prompts_per_step"),
        ({"overlong_buffer": 9, "max_new_tokens": 4}, "overlong_buffer"),
        ({"val_samples": 2, "val_k": 3}, "val_k"),
        ({"prompt_template": "no placeholder"}, "prompt_template"),
        ({"prompt_template": "{prompt} within \\boxed{}"}, "literal braces twice"),
        ({"temperature": 0.0}, "temperature"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"stop_token_ids": ["<|im_end|>"]}, "stop_token_ids"),
    ],
)
def test_invalid_arguments_are_rejected_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutDataModule(**kwargs)


def test_train_order_is_the_default_shuffle_and_resumes_mid_epoch():
    from torch.utils.data import DataLoader

    from lightning_rlvr import BuiltinTask

    data = RolloutDataModule(source=BuiltinTask("reverse", num_digits=3), prompts_per_step=8, group_size=2)
    torch.manual_seed(7)
    ours = [[p.prompt for p in batch] for batch in data.train_dataloader()]
    torch.manual_seed(7)  # what DataLoader(shuffle=True) draws from the global RNG: the run is unchanged by resuming
    problems = data.source.train_problems()
    reference = [[p.prompt for p in batch] for batch in
                 DataLoader(problems, batch_size=8, shuffle=True, drop_last=True, collate_fn=list)]
    assert ours == reference

    torch.manual_seed(7)
    iterator = iter(data.train_dataloader())
    for _ in range(3):
        next(iterator)
        data._shuffle.consumed += 8  # what rollout() counts for each trained batch
    state = data.state_dict()
    fresh = RolloutDataModule(source=BuiltinTask("reverse", num_digits=3), prompts_per_step=8, group_size=2)
    fresh.load_state_dict(state)
    torch.manual_seed(99)  # another process: the order comes from the checkpoint
    assert [[p.prompt for p in batch] for batch in fresh.train_dataloader()] == reference[3:]


def test_sharded_dynamic_sampling_runs_idle_rounds_until_every_rank_is_done(tokenizer, monkeypatch):
    """A sharded policy generates collectively: a rank that is done generates (and discards) until all are done."""
    import lightning_rlvr.data.dynamic_sampling as dynamic_sampling

    ok12, ok2, bad = digits("12") + [EOS], digits("2") + [EOS], digits("99") + [EOS]
    dm = make_dm(tokenizer, [ok12, bad, ok2, bad], prompts_per_step=2, group_size=2, dynamic_sampling=True,
                 max_generation_rounds=3)
    monkeypatch.setattr(dynamic_sampling, "world_size", lambda: 2)
    monkeypatch.setattr(dynamic_sampling, "is_sharded", lambda policy: True)
    others_done = iter([False, False, True])  # the other rank needs two more rounds
    asked = []
    monkeypatch.setattr(dynamic_sampling, "all_ranks_done",
                        lambda done, device: asked.append(done) or next(others_done))
    batch = dm.rollout(dm.source.train_problems())
    assert dm.engine.calls == [(2, 2), (1, 2), (1, 2)]  # one real round, then two idle rounds of one prompt
    assert asked == [True, True, True]
    assert batch.stats["rollout/generation_rounds"] == 1
    assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]  # idle rounds' completions are discarded


def test_unsharded_dynamic_sampling_never_synchronises_rounds(tokenizer, monkeypatch):
    ok12, ok2, bad = digits("12") + [EOS], digits("2") + [EOS], digits("99") + [EOS]
    dm = make_dm(tokenizer, [ok12, bad, ok2, bad], prompts_per_step=2, group_size=2, dynamic_sampling=True)

    import lightning_rlvr.data.dynamic_sampling as dynamic_sampling

    def no_collective(done, device):
        raise AssertionError("a replicated policy (DDP) generates independently: no collective is needed")

    monkeypatch.setattr(dynamic_sampling, "all_ranks_done", no_collective)
    assert len(dm.rollout(dm.source.train_problems())) == 4


CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_template_sends_the_templated_prompt_as_the_user_message(tokenizer):
    tokenizer.chat_template = CHAT
    ok = digits("12") + [EOS]
    dm = make_dm(tokenizer, [ok, ok], [Problem("5+7=", "12")], prompts_per_step=1, group_size=2,
                 prompt_template="{prompt}?", chat_template=True, system_prompt="be brief")
    problem = Problem("5+7=", "12")
    # The template rendered by hand; the chat text carries its own special tokens, so none are added.
    expected = tokenizer("<system>be brief<user>5+7=?<assistant>", add_special_tokens=False).input_ids
    assert dm.prompt_ids(problem) == expected
    batch = dm.rollout([problem])
    assert batch.input_ids[0, : batch.prompt_length].tolist() == expected
    assert batch.scores.tolist() == [1.0, 1.0]


def test_without_chat_template_the_prompt_gets_the_tokenizers_special_tokens(tokenizer):
    dm = make_dm(tokenizer, [digits("1") + [EOS]], prompt_template="{prompt}?")
    assert dm.prompt_ids(Problem("5+7=", "12")) == tokenizer("5+7=?", add_special_tokens=True).input_ids


def test_chat_template_needs_a_tokenizer_that_has_one(tokenizer):
    assert tokenizer.chat_template is None  # the built-in character tokenizer has none
    with pytest.raises(ValueError, match="has no chat template"):
        make_dm(tokenizer, [digits("1") + [EOS]], chat_template=True)


def test_system_prompt_without_chat_template_is_refused():
    with pytest.raises(ValueError, match="system_prompt needs chat_template"):
        RolloutDataModule(system_prompt="be brief")


def test_supervised_warm_start_trains_on_the_prompts_the_rollouts_see(tokenizer, tiny_model_dir):
    import types

    from transformers import AutoModelForCausalLM

    from lightning_rlvr.callbacks import SupervisedWarmStart

    tokenizer.chat_template = CHAT
    problems = [Problem("5+7=", "12"), Problem("1+1=", "2")]
    dm = make_dm(tokenizer, [digits("1") + [EOS]], problems, chat_template=True)
    seen = []
    dm.prompt_ids = lambda problem, original=dm.prompt_ids: seen.append(problem) or original(problem)
    dm.source.warm_start_problems = lambda: problems
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    module = types.SimpleNamespace(policy=policy, tokenizer=tokenizer, policy_version=0, ref_model=None)
    trainer = types.SimpleNamespace(strategy=None, datamodule=dm)
    SupervisedWarmStart(steps=1, batch_size=2).on_fit_start(trainer, module)
    assert seen == problems  # every warm-start prompt is built by the DataModule (chat template included)
