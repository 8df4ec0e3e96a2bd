"""A tiny causal LM and character tokenizer, built offline and saved as a normal Hugging Face directory.

The embedded default of lightning_rlvr needs no download: :func:`build_tiny_model` writes a
``tokenizers`` character-level tokenizer (wrapped as a transformers fast tokenizer) and a randomly
initialised Llama (≈77k parameters at the defaults) with ``save_pretrained``, and the trainer then loads
that directory with ``AutoTokenizer/AutoModelForCausalLM.from_pretrained(path)`` exactly as it would
a real checkpoint.

Example::

    >>> import tempfile
    >>> path = build_tiny_model(tempfile.mkdtemp())
    >>> from transformers import AutoTokenizer
    >>> AutoTokenizer.from_pretrained(path).decode([4, 5])
    '01'
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["SPECIAL_TOKENS", "TinyModelConfig", "build_tiny_model", "build_tiny_tokenizer", "seeded_init"]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# Characters of the built-in tasks (arithmetic, digit manipulation) plus letters for user tasks.
DEFAULT_CHARACTERS = "0123456789+-*/=()<>., abcdefghijklmnopqrstuvwxyz?:"


@dataclass
class TinyModelConfig:
    """Shape of the built-in tiny Llama policy (defaults: MEASUREMENTS.md §9, trains in minutes on 2 cores).

    Attributes:
        hidden_size: model width.
        num_hidden_layers: transformer blocks.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention).
        intermediate_size: MLP width.
        max_position_embeddings: longest prompt + completion, in characters.
        seed: random-init seed (the weights are a pure function of it).
        initializer_range: std of the random init (transformers' default 0.02). A LoRA run keeps the embeddings
            and the tied output head frozen: at 0.02 their logits cannot leave the uniform distribution.
    """

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 64
    seed: int = 0
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name not in ("seed", "initializer_range") and value < 1:
                raise ValueError(f"TinyModelConfig.{name} must be >= 1, got {value}")
        if self.initializer_range <= 0:
            raise ValueError(f"TinyModelConfig.initializer_range must be > 0, got {self.initializer_range}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("TinyModelConfig.hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("TinyModelConfig.num_attention_heads must be divisible by num_key_value_heads")


def build_tiny_tokenizer(characters: str = DEFAULT_CHARACTERS):
    """A character-level fast tokenizer: every character is one token, BOS prepended, left padding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if len(set(characters)) != len(characters):
        raise ValueError("tokenizer characters must be unique")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in characters:
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def seeded_init(model_class, model_config, seed: int):
    """``model_class(model_config)`` with weights drawn from ``seed``, leaving the global RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(model_config)


def build_tiny_model(directory: str | Path, config: TinyModelConfig | None = None,
                     characters: str = DEFAULT_CHARACTERS) -> str:
    """Build the tiny tokenizer + random-init Llama and ``save_pretrained`` both into ``directory``.

    Llama rather than Qwen2: transformers 5 maps the ``qwen2`` model type to its byte-level ``Qwen2Tokenizer``
    on reload, which would silently replace this character tokenizer (dropping spaces); for ``llama`` the saved
    ``tokenizer.json`` is used as written.

    Returns:
        The directory path, ready for ``from_pretrained``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = config or TinyModelConfig()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(characters)
    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = seeded_init(LlamaForCausalLM, model_config, config.seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)
