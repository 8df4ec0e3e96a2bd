"""``builtin:tiny-chat``: a tiny instruct checkpoint built offline, shaped like Qwen2.5-Instruct.

Where ``builtin:tiny`` is a character model with one EOS, this one has what a user's first real checkpoint has:

- a **byte-level BPE tokenizer** trained at build time with ``tokenizers`` (Qwen2's pre-tokenizer regex, so digits
  are single tokens, NFC normalisation, byte-level decoding: any UTF-8 text round-trips) on text covering the built-in
  tasks, math word problems and LaTeX answers (``\\boxed{\\frac{1}{2}}``), saved as a ``Qwen2Tokenizer``;
- the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (EOS, the end of an assistant turn) and a
  pad token ``<|pad|>`` distinct from every stop id, and a **ChatML chat template**;
- **two stop ids**: ``generation_config.eos_token_id = [<|im_end|>, <|endoftext|>]``, as Qwen2.5-Instruct ships, with
  its sampling defaults (temperature 0.7, top-p 0.8, top-k 20, repetition penalty 1.05; the engines sample with the
  DataModule's settings instead);
- a random-init **Qwen2** model (attention biases, tied embeddings) whose embedding matrix is padded to a multiple
  of 64 rows, as Qwen's is: ids past the tokenizer's vocabulary exist in the model and can be sampled.

:func:`build_tiny_chat_model` writes it with ``save_pretrained``; it loads with ``from_pretrained(path)`` like any
checkpoint (``RLVRModule(model="builtin:tiny-chat")`` builds it in a temporary directory).

Example::

    >>> import tempfile
    >>> from transformers import AutoTokenizer
    >>> tokenizer = AutoTokenizer.from_pretrained(build_tiny_chat_model(tempfile.mkdtemp()))
    >>> tokenizer.apply_chat_template([{"role": "user", "content": "2+3="}], add_generation_prompt=True,
    ...                               tokenize=False)
    '<|im_start|>user\\n2+3=<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from lightning_rlvr.models.tiny import TinyModelConfig, seeded_init

__all__ = ["CHAT_MODEL_SHAPE", "CHAT_SPECIAL_TOKENS", "CHAT_TEMPLATE", "build_tiny_chat_model",
           "build_tiny_chat_tokenizer"]

# The character model's shape, with room for chat prompts (several times longer) and long completions.
CHAT_MODEL_SHAPE = TinyModelConfig(max_position_embeddings=2048)

# In Qwen's order, after the BPE vocabulary; then the pad token, which Qwen does not have (it pads with a stop id).
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

# ChatML as Qwen2.5-Instruct writes it, without tools and without a default system message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Text the BPE merges are learned from (besides the generated task text): the prompt templates of the shipped configs,
# math word problems, LaTeX answers and the chat roles. Kept short: the vocabulary is small on purpose.
_CORPUS = r"""
system user assistant You are a helpful assistant.
Please reason step by step, and put your final answer within \boxed{}.
Put the final answer after ####.
The answer is \boxed{12}. So the final answer is \boxed{\frac{1}{2}}. Therefore the answer is \boxed{-3}.
\boxed{\frac{3}{4}} \boxed{\sqrt{2}} \boxed{2\sqrt{3}} \boxed{\pi} \boxed{3.5} \boxed{x^2+1} \boxed{(1, 2)}
\boxed{[0, 1)} \boxed{\frac{\pi}{6}} \boxed{10\%} \boxed{\dfrac{7}{8}} \boxed{x = 4} \boxed{\{1, 2, 3\}}
\frac{a}{b} \cdot \times \div \left( \right) \le \ge \neq \infty \sum_{i=1}^{n} i = \frac{n(n+1)}{2} x_1 y^{2}
Let x be the number of apples. Then 3x + 5 = 20, so x = 5. #### 5
Tom has 26 apples and buys 28 more. How many apples does he have? He has 26 + 28 = 54 apples. #### 54
A box holds 4 pens. How many pens are in 18 boxes? 4 * 18 = 72. #### 72
What is the value of the expression? Simplify the fraction. Find the sum of the numbers. Compute the product.
If a train travels 60 miles per hour for 2 hours, how far does it go? It goes 60 * 2 = 120 miles. #### 120
def solve(a, b): return a + b
"""


def _training_text() -> list[str]:
    from lightning_rlvr.tasks.arithmetic import ArithmeticTask

    text = [line for line in _CORPUS.splitlines() if line.strip()]
    for name in ("addition", "addition3", "reverse"):
        text += [problem.prompt + problem.answer for problem in ArithmeticTask._enumerate(name, 49, 3)]
    return text


def build_tiny_chat_tokenizer(vocab_size: int = 512):
    """Train the byte-level BPE (``vocab_size`` tokens before the special ones) and wrap it as a ``Qwen2Tokenizer``.

    The pipeline is the one transformers' ``Qwen2Tokenizer`` builds (NFC, Qwen2's split regex, byte-level without
    a prefix space), so the saved tokenizer reloads as exactly this tokenizer. Training is deterministic.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    backend.train_from_iterator(_training_text(), trainer)
    vocab = backend.get_vocab()
    merges = [tuple(pair) for pair in json.loads(backend.to_str())["model"]["merges"]]
    for token in CHAT_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    endoftext, im_start, im_end, pad = CHAT_SPECIAL_TOKENS
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token=im_end, pad_token=pad, unk_token=None,
                               bos_token=None, extra_special_tokens=[endoftext, im_start])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_chat_model(directory: str | Path, config: TinyModelConfig | None = None, vocab_size: int = 512) -> str:
    """Build the tokenizer and a random-init Qwen2 of ``config``'s shape, ``save_pretrained`` both into ``directory``.

    Args:
        directory: where to write the checkpoint.
        config: the model's shape and init seed (default :data:`CHAT_MODEL_SHAPE`).
        vocab_size: BPE tokens learned before the four special tokens.

    Returns:
        The directory path, ready for ``from_pretrained``.
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = config or CHAT_MODEL_SHAPE
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_chat_tokenizer(vocab_size)
    endoftext, _, im_end, pad = tokenizer.convert_tokens_to_ids(list(CHAT_SPECIAL_TOKENS))
    fields = dataclasses.asdict(config)
    fields.pop("seed")
    model_config = Qwen2Config(
        vocab_size=-(-len(tokenizer) // 64) * 64,  # padded like Qwen's (151,936 rows for 151,665 tokens)
        tie_word_embeddings=True,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=pad,
        **fields,
    )
    model = seeded_init(Qwen2ForCausalLM, model_config, config.seed)
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=pad,
        do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)
