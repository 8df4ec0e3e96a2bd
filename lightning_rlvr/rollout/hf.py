"""Rollout engine on the live Hugging Face policy (the CPU / small-model default): a cached decoding loop of its own,
transformers' ``generate`` for policies sharded across ranks."""

from __future__ import annotations

import contextlib
import copy
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_rlvr.distributed import world_size
from lightning_rlvr.ops.fused_logprobs import DEFAULT_CHUNK_BYTES, chunk_rows
from lightning_rlvr.ops.logprobs import TokenStats, token_logprobs_and_entropy
from lightning_rlvr.ops.shared_prompt import cache_keyword
from lightning_rlvr.rollout.base import GenerationOutput, RolloutEngine, SamplingConfig
from lightning_rlvr.sharding import is_sharded

__all__ = ["HFEngine", "takes_prepared_mask"]


def _warp(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """Temperature, then top-k, then top-p, in the order and with the tie rules of transformers' logits warpers.

    Only these: a model's ``generation_config`` may carry more processors (Qwen-Instruct ships a repetition
    penalty), but samples drawn with them would not be samples of the ``softmax(logits / τ)`` the trainer scores.
    """
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k)[0][..., -1, None]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if sampling.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - sampling.top_p)
        remove[..., -1:] = False  # keep at least the most likely token
        logits = logits.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))
    return logits


def takes_prepared_mask(config) -> bool:
    """Whether a one-token decoding step may be given its attention mask ready-made, as ``(B, 1, 1, L)`` booleans.

    transformers passes a 4-D mask through untouched, which skips building one from the 2-D padding mask on every
    forward (~0.2 ms, 15% of a tiny model's decoding step). For the last query position the causal mask is just the
    padding mask, and SDPA reads booleans as "may attend". Eager attention adds its mask as floats, flash attention
    wants 2-D, and a sliding window or chunked attention would be lost: those keep the 2-D mask.
    """
    layer_types = getattr(config, "layer_types", None) or ()
    return (getattr(config, "_attn_implementation", None) == "sdpa"
            and getattr(config, "sliding_window", None) is None and "sliding_attention" not in layer_types
            and getattr(config, "attention_chunk_size", None) is None)


def _set_mode(model: nn.Module, training: bool) -> None:
    """``model.train(training)`` without its cost (~0.4 ms on a tiny model, as much as a decoding step).

    transformers' ``train`` also switches the hub kernels' mode (inference vs training), which re-resolves them;
    the kernels of training mode compute the same function, so generation keeps them.
    """
    for module in model.modules():
        module.training = training


class HFEngine(RolloutEngine):
    """Generates on the live training module with a KV cache (no weight copy, so sync is free).

    The policy is put in eval mode while generating and restored afterwards. Prompts are repeated ``n``
    times, so rows come grouped by prompt. On one device the tokens are drawn by a plain decoding loop: one
    prefill over the left-padded prompts (each prompt once; its KV cache is then repeated for its ``n`` samples),
    then one cached forward per token, each sampled from
    ``softmax(logits / temperature)`` after top-k and top-p exactly as transformers' ``generate`` does (the same
    seed gives the same tokens), rows that emitted a stop id (``SamplingConfig.stop_token_ids``, else the generation
    config's EOS ids) padded, and the loop stopped once every row has; each row's length and whether it stopped are
    returned with it. It skips
    ``generate``'s per-token bookkeeping (a few ms per step on small models) and, under SDPA, hands each step its
    padding mask ready-made (:func:`takes_prepared_mask`). When the policy is sharded across
    ranks (FSDP2, DeepSpeed ZeRO-3) every forward gathers parameters from all ranks, so generation goes through
    ``generate(synced_gpus=True)``: a rank whose completions all ended keeps stepping until every rank is done.

    Behaviour statistics: the loop has every sampled token's logits, from the very module the trainer updates,
    so when the trainer asks (it would otherwise run a no-grad pass over the batch before the update: with several
    minibatches or PPO epochs, or for interventions that read the old policy's stats) it also returns their
    log-probs, entropy and ``S̄`` at the sampling temperature (:attr:`GenerationOutput.behaviour`), and the
    trainer skips that pass (on the tiny model: 0.3–0.5 ms per rollout, against a ~4 ms forward).
    They differ from that pass only by float rounding (a cached one-token forward against a full-sequence one),
    so they are computed only in float32 without autocast; under bf16 the pass stays, as in verl and OpenRLHF,
    whose engines are separate, lower-precision copies. The engine's own log-probs of the sampled tokens
    (``SamplingConfig.logprobs``, which asynchronous rollouts ask for) are those float32 stats where the loop has them,
    else one no-grad forward of the generating weights over prompt and completion, in their precision.

    **Its own weight copy** (``weights="copy"``): :meth:`sync` copies the policy's parameters and buffers into a
    private module (deep-copied at the first sync, written in place afterwards), and generation runs on that copy.
    The trainer may then update the live policy while this engine generates, e.g. in the background thread of
    ``RolloutDataModule(max_policy_lag=1)``; the copy's behaviour statistics are the *generating* policy's. A
    ``generator`` set on the engine makes its sampling draw from that generator instead of torch's global one (a
    background thread must not share the training thread's random stream). Not for a policy sharded across ranks.

    Args:
        use_cache: use the KV cache during generation.
        behaviour_stats: compute the behaviour statistics while decoding when the call asks for them
            (``SamplingConfig.behaviour_stats``; float32, own loop only). ``False`` = the trainer's pass always.
        weights: ``"live"`` (generate with the training module itself; sync is free) or ``"copy"`` (a private
            copy, written at each sync).
    """

    def __init__(self, use_cache: bool = True, behaviour_stats: bool = True,
                 weights: Literal["live", "copy"] = "live") -> None:
        if weights not in ("live", "copy"):
            raise ValueError(f"HFEngine: weights must be 'live' or 'copy', got {weights!r}")
        self.use_cache = use_cache
        self.behaviour_stats = behaviour_stats
        self.weights = weights
        self.policy: nn.Module | None = None
        self.version: int = -1
        #: draws the samples when set (else torch's global generator).
        self.generator: torch.Generator | None = None

    @property
    def holds_own_weights(self) -> bool:
        """Whether generation is independent of later changes to the live policy (until the next sync)."""
        return self.weights == "copy"

    @torch.no_grad()
    def sync(self, policy: nn.Module, version: int) -> None:
        if self.weights == "live":
            self.policy = policy
        else:
            if is_sharded(policy):
                raise ValueError("HFEngine(weights='copy') cannot copy a policy sharded across ranks (FSDP2, ZeRO-3)")
            if self.policy is None:
                self.policy = copy.deepcopy(policy)
                self.policy.requires_grad_(False)
            else:
                for mine, theirs in zip(self.policy.state_dict(keep_vars=True).values(),
                                        policy.state_dict(keep_vars=True).values()):
                    mine.copy_(theirs)
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> GenerationOutput:
        if self.policy is None:
            raise RuntimeError("HFEngine.generate called before sync(policy)")
        policy = self.policy
        config = policy.generation_config
        pad_id = config.pad_token_id if config.pad_token_id is not None else self.stop_ids(policy, sampling)[0]
        device = next(policy.parameters()).device
        distinct_ids, distinct_mask = self.left_pad(prompts, pad_id, device)
        prompt_ids, prompt_mask = distinct_ids.repeat_interleave(n, dim=0), distinct_mask.repeat_interleave(n, dim=0)
        sharded = is_sharded(policy)
        synced = world_size() > 1 and sharded
        # FSDP2 and ZeRO-3 gather parameters inside the forward and track their version counters, which
        # inference tensors lack: a sharded policy decodes under the plain no_grad of this method.
        decoding_mode = contextlib.nullcontext() if sharded else torch.inference_mode()
        was_training = policy.training
        _set_mode(policy, False)
        behaviour = None
        try:
            if synced or not self.use_cache:
                if self.generator is not None:
                    raise RuntimeError("HFEngine.generator draws in the engine's own decoding loop only (use_cache=True, "
                                       "a policy not sharded across ranks); transformers' generate uses the global RNG")
                completion_ids, lengths, stopped = self._hf_generate(policy, prompt_ids, prompt_mask, sampling, pad_id,
                                                                     synced)
            else:
                with decoding_mode:  # unsharded: inference mode, no autograd bookkeeping (~5% of a small model's step)
                    completion_ids, lengths, stopped, behaviour = self._decode(policy, distinct_ids, distinct_mask, n,
                                                                               sampling, pad_id)
                # Inference tensors may not be saved for backward or changed in place later: hand out plain copies.
                completion_ids, lengths, stopped = completion_ids.clone(), lengths.clone(), stopped.clone()
                if behaviour is not None:
                    behaviour = TokenStats(*(t.clone() for t in (behaviour.logprobs, behaviour.entropy, behaviour.sbar)))
            logprobs = None
            if sampling.logprobs and not sampling.greedy:
                if behaviour is not None:
                    logprobs = behaviour.logprobs
                else:
                    with decoding_mode:
                        logprobs = self._score(policy, prompt_ids, prompt_mask, completion_ids, sampling).clone()
        finally:
            _set_mode(policy, was_training)
        return GenerationOutput(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                                lengths=lengths, stopped=stopped, logprobs=logprobs, behaviour=behaviour)

    @staticmethod
    def _score(policy: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
               sampling: SamplingConfig) -> Tensor:
        """``log π(token)`` of every completion token under ``policy`` at the sampling temperature, from one forward
        over prompt and completion: the engine's log-probs where its decoding loop has none (a bf16 policy, autocast,
        ``behaviour_stats=False``). Positions past a row's length are scored too and ignored by the caller."""
        mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
        logits = policy(input_ids=torch.cat([prompt_ids, completion_ids], dim=1), attention_mask=mask,
                        position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                        logits_to_keep=completion_ids.shape[1] + 1).logits[:, :-1]
        return token_logprobs_and_entropy(logits, completion_ids, sampling.temperature, chunk_rows(logits.shape[-1]),
                                          with_entropy=False).logprobs

    def _decode(self, policy: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, n: int, sampling: SamplingConfig,
                pad_id: int) -> tuple[Tensor, Tensor, Tensor, TokenStats | None]:
        """Samples ``n`` completions of each distinct prompt in ``prompt_ids``; rows come back grouped by prompt.

        Returns the completion ids, each row's length and stopped flag, and the behaviour stats (or ``None``).
        """
        from transformers import DynamicCache

        stop_ids = torch.tensor(self.stop_ids(policy, sampling), device=prompt_ids.device)
        positions = (prompt_mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=policy.config)
        cache_argument = {cache_keyword(policy): cache}
        # The prefill runs once per distinct prompt; its cache and last logits are then repeated for the n samples.
        logits = policy(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                        logits_to_keep=1, **cache_argument).logits[:, -1]
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
        attention, positions = prompt_mask.repeat_interleave(n, dim=0), positions.repeat_interleave(n, dim=0)
        prepared_mask = takes_prepared_mask(policy.config)
        if prepared_mask:
            attention = attention.bool()
        finished = torch.zeros(attention.shape[0], dtype=torch.bool, device=prompt_ids.device)
        tokens: list[Tensor] = []
        exact = logits.dtype == torch.float32 and not torch.is_autocast_enabled(logits.device.type)
        wanted = self.behaviour_stats and sampling.behaviour_stats and not sampling.greedy
        stats: list[TokenStats] | None = [] if wanted and exact else None
        # The steps' float32 scores wait in ``held`` and go through the log-prob kernel together, up to 16 MiB at a
        # time: one call for all steps of a small model, one per step at a large vocabulary.
        held: list[tuple[Tensor, Tensor]] = []
        steps_per_call = max(1, DEFAULT_CHUNK_BYTES // (logits.numel() * 4))

        def flush() -> None:
            if held:
                stats.append(token_logprobs_and_entropy(
                    torch.stack([s for s, _ in held], 1), torch.stack([c for _, c in held], 1), sampling.temperature,
                    chunk_rows(logits.shape[-1]), with_sbar=True))
                held.clear()

        for step in range(sampling.max_new_tokens):
            scores = logits.float()
            if sampling.greedy:
                chosen = scores.argmax(-1)
            else:
                chosen = torch.multinomial(_warp(scores, sampling).softmax(-1), num_samples=1,
                                           generator=self.generator).squeeze(1)
            chosen = chosen.masked_fill(finished, pad_id)
            tokens.append(chosen)
            if stats is not None:
                # The full softmax at τ, as the trainer scores it (top-k / top-p only choose which token is drawn).
                held.append((scores, chosen))
                if len(held) == steps_per_call:
                    flush()
            finished |= (chosen == stop_ids[0]) if len(stop_ids) == 1 else torch.isin(chosen, stop_ids)
            if step == sampling.max_new_tokens - 1 or bool(finished.all()):
                break
            attention = torch.cat([attention, attention.new_ones(attention.shape[0], 1)], dim=1)
            positions = positions[:, -1:] + 1
            step_mask = attention[:, None, None, :] if prepared_mask else attention
            logits = policy(input_ids=chosen.unsqueeze(1), attention_mask=step_mask, position_ids=positions,
                            use_cache=True, **cache_argument).logits[:, -1]
        if stats is not None:
            flush()
        behaviour = None if stats is None else TokenStats(*(torch.cat([getattr(s, name) for s in stats], dim=1)
                                                            for name in ("logprobs", "entropy", "sbar")))
        completion_ids = torch.stack(tokens, dim=1)
        # A row ends at its first stop id (its padding may use a stop id too, but only after it); a row that never
        # stopped ran all steps: the loop ends early only once every row has stopped.
        is_stop = torch.isin(completion_ids, stop_ids)
        stopped = finished
        lengths = torch.where(stopped, is_stop.int().argmax(dim=1) + 1, completion_ids.shape[1])
        return completion_ids, lengths, stopped, behaviour

    def _hf_generate(self, policy: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingConfig,
                     pad_id: int, synced: bool) -> tuple[Tensor, Tensor, Tensor]:
        from transformers import GenerationConfig

        stop_ids = self.stop_ids(policy, sampling)
        settings = dict(max_new_tokens=sampling.max_new_tokens, pad_token_id=pad_id, eos_token_id=list(stop_ids),
                        use_cache=self.use_cache)
        if sampling.greedy:
            settings.update(do_sample=False)
        else:
            settings.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                            top_k=sampling.top_k)
        # A configuration of our own in place of the model's for this call: generate merges the model's defaults
        # into any configuration passed, and its extra processors (a repetition penalty) would draw from another
        # distribution than the one the trainer scores, and differently from _decode.
        model = policy.get_base_model() if hasattr(policy, "get_base_model") else policy  # a peft model generates
        own_config, model.generation_config = model.generation_config, GenerationConfig(**settings)  # with its base's
        try:
            sequences = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, synced_gpus=synced)
        finally:
            model.generation_config = own_config
        completion_ids, lengths, stopped = self.right_pad(sequences[:, prompt_ids.shape[1]:].tolist(), pad_id, stop_ids)
        return completion_ids.to(prompt_ids.device), lengths.to(prompt_ids.device), stopped.to(prompt_ids.device)
