"""Per-token statistics of completions under a model: log-probs and entropy (and ``S̄``, nucleus statistics).

Three kernels, chosen by the module's settings: the model's logits in chunks
(:func:`~lightning_rlvr.ops.token_logprobs_and_entropy`), the fused path from the last hidden states and
``lm_head.weight`` (:func:`~lightning_rlvr.ops.fused_logprobs.hidden_logprobs_and_entropy`, checked once against the
model's own logits), and either of them over a shared-prompt forward
(:func:`~lightning_rlvr.ops.shared_prompt.completion_positions_output`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_rlvr.data.batch import RolloutBatch
from lightning_rlvr.ops import TokenStats, nucleus_entropy_and_gap, shared_prompt, token_logprobs_and_entropy
from lightning_rlvr.ops.fused_logprobs import chunk_rows, hidden_logprobs_and_entropy, hidden_nucleus_entropy_and_gap
from lightning_rlvr.sharding import is_sharded

__all__ = ["PolicyScorer", "engine_behaviour_stats"]


class PolicyScorer:
    """Computes :class:`~lightning_rlvr.ops.TokenStats` of a batch's completion tokens under a model at its τ.

    Args:
        hparams: the module's hyperparameters (read when used): ``fused_logprobs``, ``logprob_chunk_size``,
            ``share_prompt_forward`` and ``micro_batch_size`` (the chunk of a no-grad pass).
    """

    def __init__(self, hparams: Any) -> None:
        self.hparams = hparams
        self.fused_path_checked = False

    def token_stats(self, model: torch.nn.Module, batch: RolloutBatch, entropy_grad: bool = False,
                    with_sbar: bool = False, nucleus_top_p: float | None = None) -> TokenStats:
        """Log-probs and entropy (``S̄``, nucleus stats) of ``batch``'s completion tokens under ``model`` at its τ."""
        if self.hparams.fused_logprobs:
            return self._fused_token_stats(model, batch, entropy_grad, with_sbar, nucleus_top_p)
        logits = self.completion_outputs(model, batch)
        chunk = self.hparams.logprob_chunk_size or chunk_rows(logits.shape[-1])
        stats = token_logprobs_and_entropy(logits, batch.completion_ids, batch.temperature, chunk,
                                           entropy_grad=entropy_grad, with_sbar=with_sbar)
        if nucleus_top_p is not None:
            stats.nucleus_entropy, stats.top2_gap = nucleus_entropy_and_gap(logits, batch.temperature, nucleus_top_p,
                                                                            chunk)
        return stats

    def completion_outputs(self, module: torch.nn.Module, batch: RolloutBatch) -> Tensor:
        """Logits (or, for a decoder, last hidden states) at the positions that predict ``batch``'s completion."""
        setting = self.hparams.share_prompt_forward
        share = setting is not False and not is_sharded(module)
        return shared_prompt.completion_positions_output(
            module, batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_length, share_prompts=share,
            min_saving=shared_prompt.WORTHWHILE_SAVING if setting == "auto" else 0.0)

    def _fused_token_stats(self, model: torch.nn.Module, batch: RolloutBatch, entropy_grad: bool, with_sbar: bool,
                           nucleus_top_p: float | None) -> TokenStats:
        """:meth:`token_stats` from the backbone's last hidden states: the ``lm_head`` never runs."""
        head = model.get_output_embeddings()
        hidden = self.completion_outputs(model.get_decoder(), batch)
        stats = hidden_logprobs_and_entropy(hidden, head.weight, batch.completion_ids, batch.temperature,
                                            self.hparams.logprob_chunk_size, entropy_grad=entropy_grad,
                                            with_sbar=with_sbar, bias=head.bias)
        if nucleus_top_p is not None:
            stats.nucleus_entropy, stats.top2_gap = hidden_nucleus_entropy_and_gap(
                hidden.detach(), head.weight.detach(), batch.temperature, nucleus_top_p,
                self.hparams.logprob_chunk_size, None if head.bias is None else head.bias.detach())
        if not self.fused_path_checked:
            self._check_fused_path(model, batch, stats)
        return stats

    @torch.no_grad()
    def _check_fused_path(self, model: torch.nn.Module, batch: RolloutBatch, stats: TokenStats) -> None:
        """Once: the fused log-probs of two rows must match those from the model's own logits."""
        rows = torch.arange(min(2, len(batch)), device=batch.input_ids.device)
        sample = batch.select(rows)
        logits = self.completion_outputs(model, sample)
        expected = token_logprobs_and_entropy(logits, sample.completion_ids, sample.temperature).logprobs
        got = stats.logprobs[: len(rows)].detach()
        mask = sample.response_mask.bool()
        tolerance = 1e-3 if logits.dtype == torch.float32 else 5e-2
        gap = (got - expected).abs()[mask].max().item() if mask.any() else 0.0
        if gap > tolerance:
            raise RuntimeError(
                f"RLVRModule(fused_logprobs=True): log-probs from {type(model).__name__}'s last hidden states and "
                f"lm_head differ from its own logits by {gap:.3g}: its output is not a plain linear map of the "
                "decoder's last hidden state (logit scaling or soft-capping?). Set fused_logprobs=False.")
        self.fused_path_checked = True

    @torch.no_grad()
    def no_grad_stats(self, model: torch.nn.Module, batch: RolloutBatch, with_sbar: bool = False,
                      nucleus_top_p: float | None = None) -> TokenStats:
        """:meth:`token_stats` without gradient, in micro-batch-sized chunks (the training forward's rows)."""
        micro = self.hparams.micro_batch_size or len(batch)
        parts = [self.token_stats(model, batch.select(idx), with_sbar=with_sbar, nucleus_top_p=nucleus_top_p)
                 for idx in torch.arange(len(batch), device=batch.input_ids.device).split(micro)]
        stats = TokenStats(torch.cat([p.logprobs for p in parts]), torch.cat([p.entropy for p in parts]),
                           torch.cat([p.sbar for p in parts]) if with_sbar else None)
        if nucleus_top_p is not None:
            stats.nucleus_entropy = torch.cat([p.nucleus_entropy for p in parts])
            stats.top2_gap = torch.cat([p.top2_gap for p in parts])
        return stats

    def behaviour_stats(self, policy: torch.nn.Module, batch: RolloutBatch, with_sbar: bool) -> TokenStats:
        """The behaviour policy's stats of ``batch``: the engine's, computed while decoding on this very policy
        (:class:`~lightning_rlvr.rollout.hf.HFEngine`, float32), else one no-grad pass."""
        engine_stats = engine_behaviour_stats(batch, with_sbar)
        return engine_stats if engine_stats is not None else self.no_grad_stats(policy, batch, with_sbar)


def engine_behaviour_stats(batch: RolloutBatch, with_sbar: bool, rows: Tensor | None = None) -> TokenStats | None:
    """The behaviour statistics the engine computed while decoding (of ``rows``, default all), or ``None`` when it
    supplied none (or no ``S̄`` where ``with_sbar`` asks for it)."""
    if (batch.behaviour_logprobs is None or batch.behaviour_entropy is None
            or (with_sbar and batch.behaviour_sbar is None)):
        return None
    def pick(values: Tensor) -> Tensor:
        return values if rows is None else values[rows]

    return TokenStats(pick(batch.behaviour_logprobs), pick(batch.behaviour_entropy),
                      pick(batch.behaviour_sbar) if with_sbar else None)
