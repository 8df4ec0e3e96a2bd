"""One forward per prompt, not per completion: the group's shared prompt is encoded once and its KV cache reused.

GRPO samples ``G`` completions of each prompt, and a plain forward over ``[prompt | completion]`` rows encodes every
prompt ``G`` times. Here the prompt rows that repeat are encoded once (with gradient when the caller has it), their
keys and values are indexed out to every completion of the group, and the completions are encoded on top of that
cache. Gradients reach the prompt's activations through the indexing, which sums the ``G`` completions'
contributions, so the output and its gradient equal the plain forward's up to float rounding (~1e-7 in float32).
The saving is the ``(G − 1) / G`` share of the prompt tokens' FLOPs: most of the forward when prompts are long.
The shared-prefix forward of Prefix Grouper (Liu et al., arXiv 2506.05433) does the same inside a custom attention
kernel; this version needs only the model's own KV cache.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor, nn

__all__ = ["WORTHWHILE_SAVING", "cache_keyword", "completion_positions_output", "prompt_groups"]

# Sharing runs two forwards (prompts, then completions) where the plain way runs one, and indexes the cache: ~1–3 ms
# of overhead per step on a CPU. It pays once the repeated prompt tokens times the non-embedding parameters (the
# saved forward + backward is ~6 FLOPs per parameter-token) pass this: 0.6 GFLOP, several ms on 2 CPU cores. The
# benchmark's 77k-parameter model with 7-token prompts (3e7) stays below it; its 2.4M one (9e8) and any real LM
# are far above.
WORTHWHILE_SAVING = 1e8


def prompt_groups(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """The rows that hold the same prompt (tokens and padding), wherever they are in the batch.

    Returns:
        ``(first_rows, group_of_row)``: for each distinct prompt the index of its first row, and for each row the
        index of its prompt; or ``None`` when every row's prompt is distinct (nothing to share).
    """
    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    distinct, group_of_row = torch.unique(key, dim=0, return_inverse=True)
    if len(distinct) == len(key):
        return None
    rows = torch.arange(len(key), device=key.device)
    first_rows = torch.full((len(distinct),), len(key), device=key.device).scatter_reduce_(0, group_of_row, rows,
                                                                                            "amin")
    return first_rows, group_of_row


def cache_keyword(module: nn.Module) -> str:
    """The keyword of ``module.forward``'s KV cache (transformers renamed ``past_key_values`` to ``cache``); for a
    ``peft`` model, its base model's (the wrapper passes keywords through)."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    return _cache_keyword_of(type(base))


@functools.cache
def _cache_keyword_of(module_class: type) -> str:  # inspecting a signature costs ~50 µs, a tiny model's forward ~1 ms
    return "cache" if "cache" in inspect.signature(module_class.forward).parameters else "past_key_values"


def _body_parameters(module: nn.Module) -> int:
    """Parameters other than the input embedding (a lookup, no FLOPs)."""
    embedding = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    embedded = embedding.weight.numel() if embedding is not None else 0
    return sum(p.numel() for p in module.parameters()) - embedded


def completion_positions_output(module: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                                prompt_length: int, share_prompts: bool = True, min_saving: float = 0.0) -> Tensor:
    """``module``'s output at the positions that predict the completion tokens, ``(N, T, ·)``.

    Row layout ``[prompt (left-padded to P) | completion (T)]``; the output at column ``P + t − 1`` predicts
    completion token ``t``. ``module`` is a causal LM (the output is its logits; its ``lm_head`` runs only on those
    ``T`` positions) or its decoder (the output is the last hidden state).

    With ``share_prompts``, when rows repeat a prompt: one cached forward over the distinct prompts
    (its last position predicts token 0), the cache indexed out to all rows, one forward over completion tokens
    ``0 .. T − 2`` on top of it. Otherwise one forward over the full rows. Callers must not share across ranks
    whose forwards are collectives (FSDP2, ZeRO-3): whether a batch shares depends on its rows.

    Args:
        min_saving: share only when (repeated prompt tokens) × (non-embedding parameters) reaches this
            (:data:`WORTHWHILE_SAVING` for "when it pays"; 0 whenever a prompt repeats).

    Raises:
        RuntimeError: ``module`` returned no cache of the prompt (gradient checkpointing turns the cache off).
    """
    from transformers import DynamicCache

    width = input_ids.shape[1] - prompt_length
    is_lm = hasattr(module, "get_output_embeddings") and module.get_output_embeddings() is not None
    field = "logits" if is_lm else "last_hidden_state"
    groups = None
    if share_prompts and min_saving > 0:
        per_token = _body_parameters(module)
        share_prompts = (len(input_ids) - 1) * prompt_length * per_token >= min_saving  # an upper bound first
    if share_prompts:
        groups = prompt_groups(input_ids[:, :prompt_length], attention_mask[:, :prompt_length])
        if groups is not None and min_saving > 0:
            repeated_rows = len(input_ids) - len(groups[0])
            groups = groups if repeated_rows * prompt_length * per_token >= min_saving else None
    if groups is None or width == 0:
        keep = {"logits_to_keep": width + 1} if is_lm else {}
        out = module(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                     **keep)
        return getattr(out, field)[:, -(width + 1) : -1]
    first_rows, group_of_row = groups
    cache = DynamicCache(config=module.config)
    keyword = cache_keyword(module)
    prompt_out = module(input_ids=input_ids[first_rows, :prompt_length],
                        attention_mask=attention_mask[first_rows, :prompt_length],
                        position_ids=position_ids[first_rows, :prompt_length], use_cache=True, **{keyword: cache},
                        **({"logits_to_keep": 1} if is_lm else {}))
    if cache.get_seq_length() != prompt_length:
        raise RuntimeError(
            f"{type(module).__name__} returned no KV cache of the prompt (gradient checkpointing turns it off), so "
            "the completions cannot be encoded on top of a shared prompt: set RLVRModule(share_prompt_forward=False).")
    first = getattr(prompt_out, field)[:, -1:][group_of_row]
    if width == 1:
        return first
    cache.batch_select_indices(group_of_row)
    rest = module(input_ids=input_ids[:, prompt_length:-1], attention_mask=attention_mask[:, :-1],
                  position_ids=position_ids[:, prompt_length:-1], use_cache=True, **{keyword: cache})
    return torch.cat([first, getattr(rest, field)], dim=1)
