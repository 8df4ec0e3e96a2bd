"""What the DataModule samples outside training, with the current policy: held-out evaluation (greedy accuracy,
pass@k, maj@k) and the completions diagnostics score (:class:`PolicySampling`, a part of
:class:`~lightning_rlvr.data.datamodule.RolloutDataModule`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from lightning_rlvr.data.batch import RolloutBatch
from lightning_rlvr.metrics.pass_at_k import pass_at_k
from lightning_rlvr.metrics.rcea import majority_vote_correct
from lightning_rlvr.tasks import Problem

__all__ = ["PolicySampling"]


class PolicySampling:
    """Sampling with the current policy's weights, once background generations are done.

    A part of :class:`~lightning_rlvr.data.datamodule.RolloutDataModule`, which provides what it uses: the engine,
    its weights' version (``engine_weights``), the background queue (``lagged``), the training sampling settings,
    the scorer, the verifier and ``val_samples`` / ``val_k``.
    """

    def _current_policy_engine(self, caller: str) -> int:
        """The engine, free of background work, with the current policy's weights: their version."""
        handle = self._policy(caller)
        if self.lagged is not None:
            self.lagged.wait()
        return self.engine_weights.sync(self.engine, handle)

    @torch.no_grad()
    def sample_batch(self, problems: list[Problem], n: int) -> RolloutBatch:
        """``n`` scored completions per problem with the current policy and the training sampling settings, as a
        :class:`RolloutBatch` (rows grouped by problem, in order); for diagnostics that need the completions' tokens,
        e.g. their entropy under the policy. Nothing is filtered: no dynamic sampling."""
        version = self._current_policy_engine("sample_batch")
        rows, _ = self._score(problems, n, self.sampling)
        self.engine.release()
        return self.scorer.to_batch(rows, version, self.sampling)

    @torch.no_grad()
    def sample_completions(self, problems: list[Problem], n: int) -> list[list[tuple[str, bool]]]:
        """``n`` completions per problem with the current policy and the training sampling settings.

        Returns per problem a list of ``(text, correct)``; for diagnostics (e.g. mode retention on a probe set).
        """
        self._current_policy_engine("sample_completions")
        rows, _ = self._score(problems, n, self.sampling)
        self.engine.release()
        return [[(r.text, r.score > 0.5) for r in rows[i * n : (i + 1) * n]] for i in range(len(problems))]

    @torch.no_grad()
    def evaluate(self, problems: list[Problem]) -> dict[str, torch.Tensor]:
        """Greedy correctness and (if ``val_samples > 0``) unbiased pass@k and maj@k per held-out problem.

        maj@k votes over the first ``val_k`` of the ``val_samples`` samples, by the verifier's ``answer_key``.
        """
        self._current_policy_engine("evaluate")
        greedy = replace(self.sampling, greedy=True)
        rows, _ = self._score(problems, 1, greedy)
        result = {"greedy_correct": torch.tensor([r.score > 0.5 for r in rows], dtype=torch.float32)}
        if self.val_samples > 0:
            rows, _ = self._score(problems, self.val_samples, self.sampling)
            correct = torch.tensor([r.score > 0.5 for r in rows], dtype=torch.float32).view(len(problems), -1)
            result["pass_at_k"] = pass_at_k(self.val_samples, correct.sum(-1), self.val_k)
            k = self.val_k
            keys = [[self.verifier.answer_key(r.text) for r in rows[i * self.val_samples : i * self.val_samples + k]]
                    for i in range(len(problems))]
            result["maj_at_k"] = majority_vote_correct(keys, correct[:, :k].bool())
        return result
