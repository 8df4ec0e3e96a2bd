"""The rollout-engine interface: generate ``n`` completions per prompt with the current policy.

An engine is told the policy's weights through :meth:`RolloutEngine.sync`, which the DataModule calls
only when the policy changed since the last sync (the policy's version counter moved). A colocated
Hugging Face engine generates with the live module, so its sync is free; an engine holding its own copy of
the weights (vLLM) pushes them in ``sync``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_rlvr.ops.logprobs import TokenStats
from lightning_rlvr.rollout.stops import end_of_completion, resolve_stop_token_ids

__all__ = ["GenerationOutput", "RolloutEngine", "SamplingConfig"]


@dataclass
class SamplingConfig:
    """Sampling parameters of one generation call.

    Attributes:
        max_new_tokens: generation limit per completion.
        temperature: softmax temperature in ``(0, 2]`` (the trainer divides logits by the same value; vLLM from 0.28
            refuses more than 2).
        top_p: nucleus sampling (1.0 = off).
        top_k: top-k sampling (0 = off).
        greedy: argmax decoding (validation accuracy); ignores the sampling knobs.
        behaviour_stats: ask for :attr:`GenerationOutput.behaviour` (the trainer will use them); an engine that
            cannot compute them exactly returns ``None``.
        stop_token_ids: the ids that end a completion (:func:`~lightning_rlvr.rollout.stops.resolve_stop_token_ids`;
            the DataModule fills them in). Empty: the policy's ``generation_config.eos_token_id``.
        logprobs: ask for :attr:`GenerationOutput.logprobs`, the generating weights' own log-probs of the sampled
            tokens at the sampling temperature, in the engine's precision (asynchronous rollouts need them); engines
            that always return theirs (vLLM) ignore it.
    """

    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    behaviour_stats: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 < self.temperature <= 2:  # vLLM >= 0.28 refuses more, so a colocated run would fail at generate
            raise ValueError(f"temperature must be in (0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass
class GenerationOutput:
    """What an engine returns for ``P`` prompts × ``n`` samples (``N = P·n`` rows, grouped by prompt).

    Attributes:
        prompt_ids: ``(N, P_len)`` left-padded prompt tokens.
        prompt_mask: ``(N, P_len)`` 1 on real prompt tokens.
        completion_ids: ``(N, T)`` generated tokens, right-padded (anything past a row's length is padding, whatever
            its id: a checkpoint's pad id may itself be a stop id).
        lengths: ``(N,)`` each row's real length in tokens, its stop id included.
        stopped: ``(N,)`` bool: the row ended on a stop id (``False``: it reached the generation limit, truncated).
        logprobs: ``(N, T)`` the engine's own log-probs of the sampled tokens, if it provides them.
        behaviour: ``(N, T)`` log-probs, entropy and ``S̄`` of the sampled tokens under the *training module's own*
            forward at the sampling temperature (what the trainer's no-grad pass would compute, up to float
            rounding), if the engine computed them while decoding; the trainer then skips that pass.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    lengths: Tensor
    stopped: Tensor
    logprobs: Tensor | None = None
    behaviour: TokenStats | None = None

    def __post_init__(self) -> None:
        rows, width = self.completion_ids.shape
        if self.lengths.shape != (rows,) or self.stopped.shape != (rows,):
            raise ValueError(f"GenerationOutput: lengths {tuple(self.lengths.shape)} and stopped "
                             f"{tuple(self.stopped.shape)} must have one entry per completion row ({rows})")
        if rows and (int(self.lengths.min()) < 0 or int(self.lengths.max()) > width):
            raise ValueError(f"GenerationOutput: lengths must lie in [0, {width}] (the completion width), "
                             f"got {self.lengths.tolist()}")


class RolloutEngine(ABC):
    """Generates completions for token-id prompts.

    Attributes:
        max_prompt_tokens: the longest prompt the engine can take (vLLM's ``max_model_len``), or ``None``; the
            DataModule names a longer prompt before generating rather than losing the batch.
    """

    max_prompt_tokens: int | None = None

    @abstractmethod
    def sync(self, policy: nn.Module, version: int) -> None:
        """Make the engine generate with ``policy``'s current weights (``version`` identifies them)."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> GenerationOutput:
        """``n`` completions for each prompt (token ids, BOS included), rows grouped by prompt."""

    def release(self) -> None:
        """Done generating for now (a rollout, all its rounds, or a validation epoch): free what generation holds.

        The DataModule calls it once per rollout and the module once per validation epoch; nothing by default
        (an engine on the live policy holds nothing), vLLM's goes to sleep.
        """

    def close(self) -> None:
        """Done with the engine for this fit: stop what it runs apart from the trainer (nothing by default; a
        :class:`~lightning_rlvr.rollout.process.ProcessEngine` stops its process). The next ``sync`` starts afresh."""

    def abort(self) -> None:
        """The fit failed: stop now, abandoning work in progress (:meth:`close` by default; a
        :class:`~lightning_rlvr.rollout.process.ProcessEngine` kills its process)."""
        self.close()

    def setup_fit(self, max_policy_lag: int, world_size: int, sharded_policy: bool) -> None:
        """Called by the DataModule at ``setup``, in the thread that trains, before anything is generated: refuse a
        setting this engine cannot generate under (nothing by default).

        Args:
            max_policy_lag: the DataModule's ``max_policy_lag`` (syncs from a background thread when ``>= 2``).
            world_size: trainer ranks.
            sharded_policy: whether the strategy shards the policy across ranks (a sync would be a collective).
        """

    @staticmethod
    def stop_ids(policy: nn.Module, sampling: SamplingConfig) -> tuple[int, ...]:
        """The call's stop ids (``sampling.stop_token_ids``); without them, the policy's generation config's EOS ids."""
        return sampling.stop_token_ids or resolve_stop_token_ids(generation_config=policy.generation_config)

    @staticmethod
    def right_pad(rows: list[list[int]], pad_id: int, stop_ids) -> tuple[Tensor, Tensor, Tensor]:
        """Completion ids (right-padded), lengths and stopped flags of generated rows, each cut after its first stop id
        (:func:`~lightning_rlvr.rollout.stops.end_of_completion`), for engines that get whole sequences back."""
        ends = [end_of_completion(row, stop_ids) for row in rows]
        width = max([1] + [length for length, _ in ends])
        ids = torch.tensor([row[:length] + [pad_id] * (width - length) for row, (length, _) in zip(rows, ends)],
                           dtype=torch.long)
        return ids, torch.tensor([length for length, _ in ends]), torch.tensor([stopped for _, stopped in ends])

    @classmethod
    def from_rows(cls, prompts: list[list[int]], n: int, rows: list[list[int]], logprobs: list[list[float]],
                  stopped: list[bool], pad_id: int) -> GenerationOutput:
        """The output of engines that return each completion as its own token list (its stop id last, if it stopped)
        with one log-prob per token: ``P·n`` rows grouped by prompt, right-padded with ``pad_id``."""
        width = max(1, max(len(r) for r in rows))
        completion_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        completion_logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, (tokens, values) in enumerate(zip(rows, logprobs)):
            completion_ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            completion_logprobs[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
        prompt_ids, prompt_mask = cls.left_pad(prompts, pad_id)
        return GenerationOutput(prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0),
                                completion_ids, lengths=torch.tensor([len(r) for r in rows]),
                                stopped=torch.tensor(stopped), logprobs=completion_logprobs)

    @staticmethod
    def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        """Stack token-id lists into left-padded ids and mask."""
        width = max(len(p) for p in prompts)
        # One tensor from nested lists: a copy per row costs more than the whole rest on small batches.
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        return ids.to(device), mask.to(device)
