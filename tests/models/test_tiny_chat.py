"""builtin:tiny-chat: a real-shaped instruct checkpoint (Qwen2, byte-level BPE, ChatML, two stop ids), offline."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from lightning_rlvr.models import TinyModelConfig, build_tiny_chat_model, build_tiny_chat_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_dir):
    return AutoTokenizer.from_pretrained(tiny_chat_dir)


def test_it_is_a_qwen2_checkpoint_with_the_special_tokens_of_qwen_instruct(tiny_chat_dir, tokenizer):
    config = json.loads((Path(tiny_chat_dir) / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is True
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"])
    assert ids == list(range(ids[0], ids[0] + 4)) and ids[-1] == len(tokenizer) - 1  # after the BPE vocabulary
    endoftext, im_start, im_end, pad = ids
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (im_end, pad, None)
    assert set(tokenizer.all_special_ids) == set(ids)
    generation = GenerationConfig.from_pretrained(tiny_chat_dir)
    assert generation.eos_token_id == [im_end, endoftext] and generation.pad_token_id == pad
    assert pad not in generation.eos_token_id
    # The embedding is padded to a multiple of 64 rows, like Qwen's: ids past the tokenizer exist in the model.
    assert config["vocab_size"] % 64 == 0 and config["vocab_size"] > len(tokenizer)


def test_the_chat_template_renders_chatml(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
                        "<|im_start|>assistant\n")
    full = messages + [{"role": "assistant", "content": "5"}]
    assert tokenizer.apply_chat_template(full, tokenize=False).endswith("<|im_start|>assistant\n5<|im_end|>\n")
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens are single ids
    assert tokenizer.decode(ids) == rendered


def test_digits_are_single_tokens_and_merges_were_learned(tokenizer):
    assert [tokenizer.decode([i]) for i in tokenizer("1234", add_special_tokens=False).input_ids] == list("1234")
    words = tokenizer(" answer within \\boxed{", add_special_tokens=False).input_ids
    assert len(words) < len(" answer within \\boxed{") / 2  # byte pairs were merged into longer tokens


@pytest.mark.parametrize("seed", range(5))
def test_arbitrary_utf8_round_trips(tokenizer, seed):
    rng = random.Random(seed)
    pools = ["abcxyzABC 0123456789", "éüßçøåñ", "日本語中文한국어", "∑∫√πθ≤≥→∞", "🙂🚀🧮👍🏽", "\n\t  ", "\\{}^_$&%#"]
    text = "".join(rng.choice(rng.choice(pools)) for _ in range(200))
    text = unicodedata.normalize("NFC", text)  # the tokenizer normalises to NFC, as Qwen2's does
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < len(tokenizer) for i in ids)


@pytest.mark.parametrize("latex", [
    r"The answer is \boxed{\frac{1}{2}}.",
    r"\boxed{\dfrac{\sqrt{3}}{2}}",
    r"$x^{2} + y_{1} \le \infty$, so \boxed{[0, 1)}",
    r"\left( \frac{a}{b} \right) \cdot 10\% = \boxed{\{1, 2\}}",
])
def test_latex_round_trips(tokenizer, latex):
    assert tokenizer.decode(tokenizer(latex, add_special_tokens=False).input_ids) == latex


def test_save_and_reload_round_trip(tiny_chat_dir, tmp_path, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_dir)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    sample = "<|im_start|>user\n12+34= \\boxed{46} 日本<|im_end|>\n"
    assert reloaded(sample).input_ids == tokenizer(sample).input_ids
    assert reloaded.chat_template == tokenizer.chat_template
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == again.generation_config.eos_token_id


def test_the_build_is_deterministic_and_the_shape_configurable(tmp_path, tiny_chat_dir):
    first, second = build_tiny_chat_tokenizer(), build_tiny_chat_tokenizer()
    assert first.get_vocab() == second.get_vocab()
    text = "Please reason step by step, and put your final answer within \\boxed{}."
    assert first(text).input_ids == second(text).input_ids
    path = build_tiny_chat_model(tmp_path, TinyModelConfig(hidden_size=32, num_attention_heads=2,
                                                           num_key_value_heads=1, seed=3))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.hidden_size == 32
    default = AutoModelForCausalLM.from_pretrained(tiny_chat_dir)
    assert default.config.max_position_embeddings == 2048  # chat prompts are long


def test_rlvr_module_builds_it_by_name():
    from lightning_rlvr import RLVRModule

    module = RLVRModule(model="builtin:tiny-chat", tiny_model={"hidden_size": 32, "num_attention_heads": 2,
                                                                "num_key_value_heads": 1})
    assert module.tokenizer.eos_token == "<|im_end|>"
    assert module.generation_config.eos_token_id == module.tokenizer.convert_tokens_to_ids(
        ["<|im_end|>", "<|endoftext|>"])
    module.configure_model()
    assert module.policy.config.hidden_size == 32 and module.policy.config.max_position_embeddings == 2048
