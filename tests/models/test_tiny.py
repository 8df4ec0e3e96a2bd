"""build_tiny_model: an offline Hugging Face directory (char tokenizer + seeded random Llama)."""

from __future__ import annotations

import pytest
import torch

from lightning_rlvr.models import TinyModelConfig, build_tiny_model, build_tiny_tokenizer
from lightning_rlvr.models.tiny import DEFAULT_CHARACTERS, SPECIAL_TOKENS

SMALL = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=32, max_position_embeddings=32)


def _ref_ids(text: str) -> list[int]:
    """Independent reference: BOS, then one id per character (specials first, then DEFAULT_CHARACTERS)."""
    return [SPECIAL_TOKENS.index("<bos>")] + [len(SPECIAL_TOKENS) + DEFAULT_CHARACTERS.index(ch) for ch in text]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "default": build_tiny_model(root / "default"),
        "seed0": build_tiny_model(root / "seed0", TinyModelConfig(**SMALL, seed=0)),
        "seed0_again": build_tiny_model(root / "seed0_again", TinyModelConfig(**SMALL, seed=0)),
        "seed1": build_tiny_model(root / "seed1", TinyModelConfig(**SMALL, seed=1)),
    }


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs["default"])


def _load_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


# ----------------------------------------------------------------------------- directory and loading
def test_build_writes_a_loadable_directory(model_dirs, tmp_path):
    path = build_tiny_model(tmp_path / "nested" / "dir")
    assert path == str(tmp_path / "nested" / "dir")
    names = {p.name for p in (tmp_path / "nested" / "dir").iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    model = _load_model(path)
    assert model.config.model_type == "llama"


def test_loaded_model_has_the_configured_shape(model_dirs, tokenizer):
    model = _load_model(model_dirs["seed0"])
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.max_position_embeddings) == tuple(SMALL.values())
    assert cfg.vocab_size == len(SPECIAL_TOKENS) + len(DEFAULT_CHARACTERS) == len(tokenizer)
    assert model.get_input_embeddings().weight.shape == (cfg.vocab_size, 16)
    assert cfg.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_model_special_token_ids_match_tokenizer(model_dirs, tokenizer):
    model = _load_model(model_dirs["default"])
    for cfg in (model.config, model.generation_config):
        assert cfg.bos_token_id == tokenizer.bos_token_id
        assert cfg.eos_token_id == tokenizer.eos_token_id
        assert cfg.pad_token_id == tokenizer.pad_token_id


# ----------------------------------------------------------------------------- tokenizer
def test_special_token_ids_are_distinct(tokenizer):
    ids = [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id]
    assert ids == [SPECIAL_TOKENS.index(t) for t in ("<pad>", "<bos>", "<eos>", "<unk>")]
    assert len(set(ids)) == 4


def test_tokenizer_is_character_level_with_bos(tokenizer):
    ids = tokenizer("12+7=")["input_ids"]
    assert len(ids) == 1 + 5
    assert ids == _ref_ids("12+7=")
    assert tokenizer.convert_ids_to_tokens(ids) == ["<bos>", "1", "2", "+", "7", "="]


def test_decode_round_trips(tokenizer):
    for text in ["12+7=", "0", "49+49=98", "(3*4)-2/1"]:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode([4, 5]) == "01"


def test_left_padding(tokenizer):
    assert tokenizer.padding_side == "left"
    batch = tokenizer(["1", "123"], padding=True)
    pad, bos = tokenizer.pad_token_id, tokenizer.bos_token_id
    assert batch["input_ids"] == [[pad, pad, bos, _ref_ids("1")[1]], _ref_ids("123")]
    assert batch["attention_mask"] == [[0, 0, 1, 1], [1, 1, 1, 1]]


@pytest.mark.parametrize("text", ["12+7=", "rev 123=", "what is 3+4?", "Z1"])
def test_reloaded_tokenizer_encodes_like_the_built_tokenizer(tokenizer, text):
    # Regression: with a qwen2 config, transformers 5 reloads the directory as Qwen2Tokenizer, whose byte-level
    # pre-tokenizer drops spaces ("rev 123=" -> "rev123=") and unknown characters instead of mapping to <unk>.
    built = build_tiny_tokenizer()
    assert tokenizer(text)["input_ids"] == built(text)["input_ids"]


def test_built_tokenizer_reference_encoding():
    built = build_tiny_tokenizer()
    assert built("rev 123=")["input_ids"] == _ref_ids("rev 123=")
    assert built("Z1")["input_ids"] == [SPECIAL_TOKENS.index("<bos>"), SPECIAL_TOKENS.index("<unk>"), 5]


def test_tokenizer_rejects_duplicate_characters():
    with pytest.raises(ValueError, match="unique"):
        build_tiny_tokenizer("0123456789+=1")


# ----------------------------------------------------------------------------- weights
def _state(path) -> dict[str, torch.Tensor]:
    return _load_model(path).state_dict()


def test_weights_are_a_function_of_the_seed(model_dirs):
    a, b, c = _state(model_dirs["seed0"]), _state(model_dirs["seed0_again"]), _state(model_dirs["seed1"])
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    random_init = [n for n in a if a[n].dim() >= 2]  # weight matrices (norms are all ones)
    assert random_init
    assert all(not torch.equal(a[n], c[n]) for n in random_init)


def test_build_leaves_global_torch_rng_untouched(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", TinyModelConfig(**SMALL, seed=9))
    assert torch.equal(torch.rand(4), expected)


def test_reloading_gives_identical_logits(model_dirs, tokenizer):
    inputs = tokenizer(["12+7=", "3+4="], padding=True, return_tensors="pt")
    with torch.no_grad():
        first = _load_model(model_dirs["default"])(**inputs).logits
        second = _load_model(model_dirs["default"])(**inputs).logits
    assert first.shape == (2, inputs["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(first).all()
    assert torch.equal(first, second)


# ----------------------------------------------------------------------------- config validation
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"hidden_size": 0}, "hidden_size must be >= 1"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"intermediate_size": -1}, "intermediate_size"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"hidden_size": 66, "num_attention_heads": 4}, "divisible by num_attention_heads"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "divisible by num_key_value_heads"),
    ],
)
def test_invalid_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TinyModelConfig(**kwargs)


def test_seed_may_be_any_integer():
    assert TinyModelConfig(seed=0).seed == 0
    assert TinyModelConfig(seed=-5).seed == -5
