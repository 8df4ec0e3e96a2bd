"""The shared-prompt forward: the same outputs and gradients as one forward over the full rows, with each distinct
prompt encoded once (counted at the embedding layer)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_rlvr.ops.shared_prompt import completion_positions_output, prompt_groups
from lightning_rlvr.rollout.base import RolloutEngine

GROUP_SIZES = (4, 1, 3, 2)  # the last group repeats the first prompt, not adjacent to it
DISTINCT_PROMPTS = 3


def rows(vocab: int, width: int = 5, seed: int = 0):
    """Left-padded prompts of different lengths in runs, completions right-padded after a random length."""
    generator = torch.Generator().manual_seed(seed)
    distinct = [[1, 7, 8, 9, 10, 11], [1, 12, 13], [1, 14, 15, 16, 17], [1, 7, 8, 9, 10, 11]]
    prompts = [p for p, size in zip(distinct, GROUP_SIZES) for _ in range(size)]
    prompt_ids, prompt_mask = RolloutEngine.left_pad(prompts, pad_id=0)
    completion = torch.randint(3, vocab, (len(prompts), width), generator=generator)
    lengths = torch.randint(1, width + 1, (len(prompts),), generator=generator)
    completion_mask = (torch.arange(width) < lengths[:, None]).long()
    input_ids = torch.cat([prompt_ids, completion * completion_mask], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    return input_ids, attention_mask, position_ids, prompt_ids.shape[1]


@pytest.fixture
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()


def count_embedded_rows(model) -> list[tuple[int, int]]:
    shapes: list[tuple[int, int]] = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)))
    return shapes


def test_prompt_groups_are_the_rows_with_equal_prompts():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [5, 6, 7], [0, 5, 6], [0, 5, 6], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1]] * 6)
    mask[4, 0] = 1  # same tokens, other padding: another prompt
    first_rows, group_of_row = prompt_groups(ids, mask)
    for row in range(len(ids)):
        same = [other for other in range(len(ids))
                if torch.equal(ids[other], ids[row]) and torch.equal(mask[other], mask[row])]
        assert first_rows[group_of_row[row]] == min(same)
        assert all(group_of_row[other] == group_of_row[row] for other in same)
    assert len(first_rows) == 3 and first_rows.sort().values.tolist() == [0, 2, 4]
    assert prompt_groups(ids[1:3], mask[1:3]) is None  # nothing repeats


@pytest.mark.parametrize("width", [5, 1])
@pytest.mark.parametrize("decoder", [False, True])
def test_outputs_and_gradients_equal_the_full_forward(model, width, decoder):
    input_ids, attention_mask, position_ids, prompt_length = rows(model.config.vocab_size, width)
    module = model.get_decoder() if decoder else model
    weights = None
    outputs, grads = [], []
    for share in (False, True):
        model.zero_grad()
        out = completion_positions_output(module, input_ids, attention_mask, position_ids, prompt_length, share)
        if weights is None:
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out * weights).sum().backward()
        outputs.append(out.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    features = module.config.hidden_size if decoder else model.config.vocab_size
    assert outputs[0].shape == (len(input_ids), width, features)
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    scale = grads[0].abs().max()
    assert scale > 0
    torch.testing.assert_close(grads[1], grads[0], atol=5e-6 * scale, rtol=1e-4)  # float32 rounding of sums


def test_each_run_of_a_prompt_is_encoded_once(model):
    input_ids, attention_mask, position_ids, prompt_length = rows(model.config.vocab_size)
    shapes = count_embedded_rows(model)
    completion_positions_output(model, input_ids, attention_mask, position_ids, prompt_length)
    width = input_ids.shape[1] - prompt_length
    assert shapes == [(DISTINCT_PROMPTS, prompt_length), (len(input_ids), width - 1)]
    shapes.clear()
    completion_positions_output(model, input_ids, attention_mask, position_ids, prompt_length, share_prompts=False)
    assert shapes == [(len(input_ids), input_ids.shape[1])]


def test_without_a_repeated_prompt_it_is_one_plain_forward(model):
    input_ids, attention_mask, position_ids, prompt_length = rows(model.config.vocab_size)
    distinct = torch.tensor([0, 4, 5])
    shapes = count_embedded_rows(model)
    completion_positions_output(model, input_ids[distinct], attention_mask[distinct], position_ids[distinct],
                                prompt_length)
    assert shapes == [(3, input_ids.shape[1])]


def test_gradient_checkpointing_is_refused_with_the_setting_to_change(model):
    model.gradient_checkpointing_enable()
    model.train()
    input_ids, attention_mask, position_ids, prompt_length = rows(model.config.vocab_size)
    with pytest.raises(RuntimeError, match="share_prompt_forward=False"):
        completion_positions_output(model, input_ids, attention_mask, position_ids, prompt_length)


@pytest.mark.parametrize("decoder", [False, True])
def test_min_saving_shares_only_when_the_repeated_prompt_tokens_times_the_parameters_reach_it(model, decoder):
    module = model.get_decoder() if decoder else model
    input_ids, attention_mask, position_ids, prompt_length = rows(model.config.vocab_size)
    body = sum(p.numel() for p in module.parameters()) - model.get_input_embeddings().weight.numel()
    saving = (len(input_ids) - DISTINCT_PROMPTS) * prompt_length * body  # the rows that repeat a prompt
    shapes = count_embedded_rows(model)
    for min_saving, shares in ((saving, True), (saving + 1, False)):
        shapes.clear()
        completion_positions_output(module, input_ids, attention_mask, position_ids, prompt_length,
                                    min_saving=min_saving)
        assert (shapes[0][0] == DISTINCT_PROMPTS) == shares, (min_saving, shapes)
        assert len(shapes) == (2 if shares else 1)
