"""The scored rollout batch that the DataModule hands to the LightningModule."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor

__all__ = ["RolloutBatch"]


@dataclass
class RolloutBatch:
    """``N`` completions (``group_size`` per prompt) with their tokens, masks and verifier rewards.

    Token layout: row ``i`` is ``[prompt (left-padded to P) | completion (right-padded to T)]``; the
    completion token at column ``t`` is predicted by the logits at column ``P + t − 1``.

    Attributes:
        input_ids: ``(N, P + T)`` prompt and completion tokens.
        attention_mask: ``(N, P + T)`` 1 on real prompt tokens and on completion tokens up to and including EOS.
        response_mask: ``(N, T)`` float, 1 on the completion tokens that are trained on.
        prompt_length: ``P``.
        rewards: ``(N,)`` the reward trained on (verifier score plus any shaping).
        scores: ``(N,)`` the raw verifier score.
        correct: ``(N,)`` bool, verifier score > 0.5 (the success stratum of binary verifiers).
        truncated: ``(N,)`` bool, the completion never emitted EOS.
        group_ids: ``(N,)`` id of the prompt of each completion (unique within the batch).
        policy_version: the policy version (optimizer steps taken) that generated the batch.
        temperature: the sampling temperature (log-probs are computed at the same temperature).
        completions: decoded completion texts (up to, not including, the first stop token).
        answers: reference answers.
        verdicts: per row ``"correct"`` (score > 0.5), ``"wrong"``, ``"truncated"`` (no stop token: not verified),
            ``"invalid"`` (a special or out-of-vocabulary token in the answer: not verified) or ``"error"`` (the
            verifier raised, hung or returned a non-finite value).
        reward_components: ``{name: (N,)}`` the named components of a verifier that returns several (0 where a row
            has none), summed into ``scores``.
        engine_logprobs: ``(N, T)`` the engine's own log-probs, if it returned them.
        behaviour_logprobs: ``(N, T)`` log-probs of the completion tokens under the training module at τ,
            computed while decoding (:attr:`~lightning_rlvr.rollout.base.GenerationOutput.behaviour`), or ``None``.
        behaviour_entropy: ``(N, T)`` the same forward's entropy, or ``None``.
        behaviour_sbar: ``(N, T)`` the same forward's ``S̄``, or ``None``.
        stats: scalar rollout statistics for logging (``rollout/…``, ``reward/…``).
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    prompt_length: int
    rewards: Tensor
    scores: Tensor
    correct: Tensor
    truncated: Tensor
    group_ids: Tensor
    policy_version: int
    temperature: float
    completions: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)
    reward_components: dict[str, Tensor] = field(default_factory=dict)
    engine_logprobs: Tensor | None = None
    behaviour_logprobs: Tensor | None = None
    behaviour_entropy: Tensor | None = None
    behaviour_sbar: Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_ids(self) -> Tensor:
        """``(N, T)`` completion tokens."""
        return self.input_ids[:, self.prompt_length :]

    @property
    def position_ids(self) -> Tensor:
        """Positions that skip left padding, exactly as ``generate`` assigns them."""
        return (self.attention_mask.long().cumsum(-1) - 1).clamp_min(0)

    def _tensor_fields(self):
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), Tensor)]

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every tensor on ``device``."""
        return replace(self, **{name: getattr(self, name).to(device) for name in self._tensor_fields()},
                       reward_components={name: v.to(device) for name, v in self.reward_components.items()})

    def select(self, index: Tensor) -> RolloutBatch:
        """The rows ``index`` (a long tensor), e.g. one minibatch."""
        cpu_index = index.tolist()
        return replace(
            self,
            **{name: getattr(self, name)[index.to(getattr(self, name).device)] for name in self._tensor_fields()},
            completions=[self.completions[i] for i in cpu_index] if self.completions else [],
            answers=[self.answers[i] for i in cpu_index] if self.answers else [],
            verdicts=[self.verdicts[i] for i in cpu_index] if self.verdicts else [],
            reward_components={name: v[index.to(v.device)] for name, v in self.reward_components.items()},
        )
