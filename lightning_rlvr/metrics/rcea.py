"""Reward-conditioned entropy allocation (RCEA) diagnostics: functional forms and torchmetrics classes.

The RCEA framework (the seed paper ``seeds/002``; its text was not found, ALGORITHMS.md §9.4/§13.6 — the
estimators below are our reading of its tables) asks *which* uncertainty RL removes, not only how much:

- **stratified entropy** — token entropy of verifier-failed vs successful responses, token-weighted
  (every token counts once) and sequence-weighted (every response's token-mean counts once), their ratio
  ``ρ_H = H_fail / H_succ`` and the failed responses' share of the entropy mass (:class:`StratifiedEntropy`);
- **common-question paired ratio** — over questions with at least one success and one failure,
  ``ρ_q = H_fail(q) / H_succ(q)`` (token means within the question), summarised by the geometric mean
  ``exp(mean_q log ρ_q)`` with a seeded percentile-bootstrap CI over questions, the number of paired questions,
  and the one-sided exact sign test of "failure higher" (:class:`PairedEntropyRatio`; the paper: 1.19–1.27 with
  CIs excluding 1 for GRPO/DAPO/Clip-Cov/KL-Cov/EP-GRPO, 71–80 % failure-higher);
- **upper-tail concentration** of the positive chosen-token covariance ``(log π − mean)(A − mean)`` by reward
  stratum: the share of a stratum's positive covariance mass held by its top 1 / 2.5 / 5 % tokens
  (:class:`CovarianceTailConcentration`; the paper: failed 87–95 % vs successful 6–25 %);
- **correct-solution-mode retention** and **maj@k**: :func:`cluster_modes`, :func:`mode_retention`,
  :func:`majority_vote_correct`;
- **rarefied effective modes** (the paper's "rarefied effective-mode retention", its Table A6, is a ratio of these
  between two checkpoints; its formula is not published, the form here is our reading, [derived]):
  :func:`mode_labels`, :func:`effective_mode_count` (the Hill number of order 1 of the correct samples' modes) and
  :func:`rarefied_effective_modes` (its mean over random subsets of a fixed number of correct samples).

All classes are token-weighted where it applies and exact under DDP: sums use ``sum`` reductions, per-question
and per-token quantities ``cat`` (so every rank computes the same statistic over the whole data); ``compute``
is a collective, call it on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

__all__ = [
    "CovarianceTailConcentration",
    "PairedEntropyRatio",
    "StratifiedEntropy",
    "bootstrap_ci",
    "cluster_modes",
    "effective_mode_count",
    "majority_vote_correct",
    "mode_labels",
    "mode_retention",
    "paired_ratio_summary",
    "rarefied_effective_modes",
    "sign_test_pvalue",
    "tail_mass_share",
]


# -- functional forms ----------------------------------------------------------------------------------------
def bootstrap_ci(samples: Tensor, statistic: Callable[[Tensor], Tensor] | None = None, num_resamples: int = 1000,
                 confidence: float = 0.95, seed: int = 0, weights: Tensor | None = None) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` over the rows of ``samples`` (resampled with replacement).

    Args:
        samples: ``(n,)`` or ``(n, d)`` values, one row per unit (question).
        statistic: ``f(resampled) -> (B,)`` applied to a ``(B, n[, d])`` tensor of resamples; default the mean
            over units (``weights`` given: ``Σ w x / Σ w``, a ratio of sums).
        num_resamples: ``B``.
        confidence: two-sided level, e.g. 0.95 → the 2.5 % and 97.5 % quantiles.
        seed: seeds a private ``torch.Generator``: the same data and seed give the same interval.
        weights: ``(n,)`` per-unit weights of the default statistic.

    Returns:
        ``(low, high)``; ``(nan, nan)`` for no samples.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"bootstrap_ci: confidence must be in (0, 1), got {confidence}")
    if num_resamples < 1:
        raise ValueError(f"bootstrap_ci: num_resamples must be >= 1, got {num_resamples}")
    n = samples.shape[0]
    if n == 0:
        return math.nan, math.nan
    generator = torch.Generator().manual_seed(int(seed))
    index = torch.randint(0, n, (num_resamples, n), generator=generator)
    resampled = samples.double().cpu()[index]
    if statistic is not None:
        values = statistic(resampled)
    elif weights is not None:
        w = weights.double().cpu()[index]
        values = (resampled * w).sum(-1) / w.sum(-1).clamp_min(1e-300)
    else:
        values = resampled.mean(1)
    alpha = (1 - confidence) / 2
    low, high = torch.quantile(values.double(), torch.tensor([alpha, 1 - alpha], dtype=torch.float64)).tolist()
    return low, high


def sign_test_pvalue(num_greater: int, num_trials: int) -> float:
    """One-sided exact sign test: ``P(X ≥ num_greater)`` for ``X ~ Binomial(num_trials, ½)`` (ties excluded)."""
    if not 0 <= num_greater <= num_trials:
        raise ValueError(f"sign_test_pvalue needs 0 <= num_greater <= num_trials, got {num_greater}, {num_trials}")
    if num_trials == 0:
        return math.nan
    tail = sum(math.comb(num_trials, k) for k in range(num_greater, num_trials + 1))
    return tail / 2**num_trials


def paired_ratio_summary(log_ratios: Tensor, num_resamples: int = 1000, confidence: float = 0.95,
                         seed: int = 0) -> dict[str, float]:
    """Geometric mean of per-question ratios with its bootstrap CI, and the sign test of "failure higher".

    Args:
        log_ratios: ``(n,)`` ``log ρ_q`` of the paired questions.

    Returns:
        ``geometric_mean``, ``ci_low``, ``ci_high``, ``paired`` (n), ``failure_higher`` (fraction with ``ρ > 1``
        among the non-tied), ``sign_test_p`` (one-sided).
    """
    log_ratios = log_ratios.double().cpu()
    n = log_ratios.numel()
    if n == 0:
        nan = math.nan
        return {"geometric_mean": nan, "ci_low": nan, "ci_high": nan, "paired": 0.0, "failure_higher": nan,
                "sign_test_p": nan}
    low, high = bootstrap_ci(log_ratios, num_resamples=num_resamples, confidence=confidence, seed=seed)
    higher, lower = int((log_ratios > 0).sum()), int((log_ratios < 0).sum())
    return {
        "geometric_mean": math.exp(log_ratios.mean().item()), "ci_low": math.exp(low), "ci_high": math.exp(high),
        "paired": float(n), "failure_higher": higher / (higher + lower) if higher + lower else math.nan,
        "sign_test_p": sign_test_pvalue(higher, higher + lower),
    }


def tail_mass_share(values: Tensor, fraction: float) -> float:
    """Share of the positive mass ``Σ max(x, 0)`` held by the top ``⌈fraction · n⌉`` of the ``n`` values."""
    if not 0 < fraction <= 1:
        raise ValueError(f"tail_mass_share: fraction must be in (0, 1], got {fraction}")
    positive = values.double().clamp_min(0)
    total = positive.sum().item()
    if values.numel() == 0 or total <= 0:
        return math.nan
    k = math.ceil(fraction * values.numel())
    return positive.topk(k).values.sum().item() / total


def _shingles(text: str, size: int = 3) -> frozenset[str]:
    text = " ".join(text.split())
    return frozenset(text[i : i + size] for i in range(max(len(text) - size + 1, 1)))


def _jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def cluster_modes(solutions: Sequence[str], similarity: float = 1.0) -> list[str]:
    """Deterministic modes of a set of correct solutions: one representative per cluster.

    Texts are whitespace-normalised; with ``similarity = 1`` a mode is a distinct normalised text. Below 1,
    texts are visited in sorted order and join the first mode whose representative's character-3-gram Jaccard
    similarity is ``≥ similarity`` (else they found a new mode) — the same input always gives the same modes.
    """
    if not 0 < similarity <= 1:
        raise ValueError(f"cluster_modes: similarity must be in (0, 1], got {similarity}")
    normalised = sorted({" ".join(s.split()) for s in solutions})
    if similarity == 1:
        return normalised
    modes: list[tuple[str, frozenset[str]]] = []
    for text in normalised:
        grams = _shingles(text)
        if not any(_jaccard(grams, rep) >= similarity for _, rep in modes):
            modes.append((text, grams))
    return [text for text, _ in modes]


def mode_labels(solutions: Sequence[str], similarity: float = 1.0) -> list[int]:
    """Each solution's mode: its index in :func:`cluster_modes` ``(solutions, similarity)``.

    Same normalisation and rule as :func:`cluster_modes`: a solution belongs to the first mode whose representative
    its whitespace-normalised text matches (equal text at ``similarity = 1``, else character-3-gram Jaccard
    ``≥ similarity``). That is the mode the clustering put it in: modes are only appended, so when a text was
    visited the modes before it were already there, and a representative matches itself.

    Returns:
        one label in ``0 .. len(cluster_modes(solutions)) - 1`` per solution, in the input's order.
    """
    modes = cluster_modes(solutions, similarity)  # validates the similarity
    if similarity == 1:
        index = {text: j for j, text in enumerate(modes)}
        return [index[" ".join(s.split())] for s in solutions]
    grams = [_shingles(text) for text in modes]
    labels: dict[str, int] = {}
    out = []
    for solution in solutions:
        text = " ".join(solution.split())
        if text not in labels:
            own = _shingles(text)
            labels[text] = next(j for j, rep in enumerate(grams) if _jaccard(own, rep) >= similarity)
        out.append(labels[text])
    return out


def effective_mode_count(labels: Sequence[int]) -> float:
    """The Hill number of order 1 (exponential Shannon entropy) of the labels' frequencies.

    ``D = exp(−Σ_j p_j log p_j)`` with ``p_j`` the share of labels equal to ``j``: the number of equally frequent
    modes with the same entropy (``[0, 0, 1, 1]`` → 2, ``[0, 0, 0, 1]`` → 1.75...; one mode → 1). ``nan`` for no
    labels.
    """
    n = len(labels)
    if n == 0:
        return math.nan
    counts: dict[int, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    return math.exp(-sum(c / n * math.log(c / n) for c in counts.values()))


def rarefied_effective_modes(labels: Sequence[int], size: int, draws: int, generator: torch.Generator) -> float:
    """Mean :func:`effective_mode_count` of ``size`` labels drawn without replacement, over ``draws`` draws.

    ``D_size = (1/draws) Σ_d D(labels[S_d])``, ``S_d`` a uniformly random ``size``-subset of the positions (the
    Monte-Carlo estimate of ``E_S D(labels[S])`` over all such subsets). The effective number of modes grows with
    the number of correct samples it is computed from; rarefying every question to the same ``size`` makes counts
    comparable between checkpoints whose accuracy differs. [derived]: the seed paper's rarefaction is not published.

    Args:
        labels: mode labels of one question's correct samples (:func:`mode_labels`).
        size: correct samples per draw.
        draws: number of draws.
        generator: draws the subsets (seed it to freeze them: the same labels and seed give the same value).

    Returns:
        the mean; ``nan`` with fewer than ``size`` labels.
    """
    if size < 1 or draws < 1:
        raise ValueError(f"rarefied_effective_modes: need size >= 1 and draws >= 1, got {size}, {draws}")
    n = len(labels)
    if n < size:
        return math.nan
    total = 0.0
    for _ in range(draws):
        chosen = torch.randperm(n, generator=generator)[:size].tolist()
        total += effective_mode_count([labels[i] for i in chosen])
    return total / draws


def mode_retention(baseline: Sequence[str], current: Sequence[str], similarity: float = 1.0) -> int:
    """How many baseline modes are still present: a baseline mode is retained when some current mode matches it."""
    if similarity == 1:
        return len(set(baseline) & set(current))
    current_grams = [_shingles(c) for c in current]
    return sum(any(_jaccard(_shingles(b), c) >= similarity for c in current_grams) for b in baseline)


def majority_vote_correct(answers: Sequence[Sequence[Hashable]], correct: Tensor) -> Tensor:
    """maj@k per problem: is the most frequent answer (ties → the one seen first) a correct one?

    Args:
        answers: per problem, the ``k`` samples' answer keys (equal keys = the same answer).
        correct: ``(M, k)`` bool, each sample's verdict.
    """
    out = []
    for keys, verdicts in zip(answers, correct.bool().tolist()):
        counts: dict[Hashable, int] = {}
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        best = max(counts, key=lambda key: (counts[key], -list(keys).index(key)))
        out.append(float(verdicts[list(keys).index(best)]))
    return torch.tensor(out, dtype=torch.float32)


# -- torchmetrics ------------------------------------------------------------------------------------------
def _cat(state: list[Tensor] | Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """A ``cat`` state as one tensor (an empty list, i.e. no update yet, gives an empty tensor)."""
    if isinstance(state, list) and not state:
        return torch.zeros(0, dtype=dtype)
    return dim_zero_cat(state)


class StratifiedEntropy(Metric):
    """Token entropy of failed vs successful responses (token- and sequence-weighted), ratio and mass share.

    ``update(entropy, mask, correct)`` with ``(N, T)`` entropy and mask and ``(N,)`` bool verdicts; ``compute()``
    returns ``failed``, ``successful``, ``ratio`` (token-weighted), ``failed_seq``, ``successful_seq``,
    ``ratio_seq`` (mean of per-response token means) and ``failed_mass_share`` (``Σ_fail H / Σ_all H``);
    an empty stratum gives ``nan``. Sum states: one all-reduce under DDP.
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # index 0 = failed, 1 = successful
        for name in ("token_sum", "token_count", "seq_sum", "seq_count"):
            self.add_state(name, default=torch.zeros(2, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, entropy: Tensor, mask: Tensor, correct: Tensor) -> None:
        mask = mask.to(torch.float64)
        stratum = correct.long().to(self.token_sum.device)
        row_sum = (entropy.double() * mask).sum(-1).to(self.token_sum.device)
        row_count = mask.sum(-1).to(self.token_sum.device)
        has_tokens = row_count > 0
        self.token_sum.index_add_(0, stratum, row_sum)
        self.token_count.index_add_(0, stratum, row_count)
        self.seq_sum.index_add_(0, stratum[has_tokens], row_sum[has_tokens] / row_count[has_tokens])
        self.seq_count.index_add_(0, stratum[has_tokens], torch.ones_like(row_sum[has_tokens]))

    def compute(self) -> dict[str, Tensor]:
        nan = torch.tensor(math.nan, dtype=torch.float64, device=self.token_sum.device)
        token = torch.where(self.token_count > 0, self.token_sum / self.token_count.clamp_min(1), nan)
        seq = torch.where(self.seq_count > 0, self.seq_sum / self.seq_count.clamp_min(1), nan)
        total = self.token_sum.sum()
        return {
            "failed": token[0], "successful": token[1], "ratio": token[0] / token[1],
            "failed_seq": seq[0], "successful_seq": seq[1], "ratio_seq": seq[0] / seq[1],
            "failed_mass_share": torch.where(total > 0, self.token_sum[0] / total.clamp_min(1e-300), nan),
        }


class PairedEntropyRatio(Metric):
    """Common-question paired failed/successful token-entropy ratio (geometric mean, bootstrap CI, sign test).

    ``update(entropy, mask, correct, question_ids)`` with ``(N,)`` int64 question ids that are stable across
    updates and ranks (the same prompt → the same id, e.g. a hash of its tokens): completions of one question
    seen in several updates pool. A question is *paired* when it has at least ``min_per_stratum`` failed and
    ``min_per_stratum`` successful responses (each with at least one token); its ratio is the ratio of its two
    token means. ``compute()`` returns :func:`paired_ratio_summary`'s dict (tensors); :meth:`per_question` the
    paired questions' ids, log ratios and response counts (for pooling runs afterwards).

    Args:
        num_resamples: resamples of the bootstrap over paired questions.
        confidence: its two-sided level.
        seed: its seed.
        min_per_stratum: responses a question needs in each outcome to be paired. The seed paper's endpoint probe
            uses 8 (``K_r ≥ 8``, Table A4); 1 admits a question on a single failed or successful response.
        **kwargs: passed to ``torchmetrics.Metric``.
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    def __init__(self, num_resamples: int = 1000, confidence: float = 0.95, seed: int = 0, min_per_stratum: int = 1,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if min_per_stratum < 1:
            raise ValueError(f"PairedEntropyRatio: min_per_stratum must be >= 1, got {min_per_stratum}")
        self.num_resamples, self.confidence, self.seed = num_resamples, confidence, seed
        self.min_per_stratum = int(min_per_stratum)
        for name in ("question", "correct", "entropy_sum", "token_count"):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(self, entropy: Tensor, mask: Tensor, correct: Tensor, question_ids: Tensor) -> None:
        mask = mask.to(torch.float64)
        self.question.append(question_ids.long())
        self.correct.append(correct.long())
        self.entropy_sum.append((entropy.double() * mask).sum(-1))
        self.token_count.append(mask.sum(-1))

    def _paired_rows(self) -> dict[str, Tensor]:
        """Per paired question, from the states as they are (this rank's, or every rank's inside a sync)."""
        question, correct = _cat(self.question, torch.long), _cat(self.correct, torch.long)
        entropy_sum, token_count = _cat(self.entropy_sum), _cat(self.token_count)
        ids, inverse = torch.unique(question, return_inverse=True)
        cell = inverse * 2 + correct
        sums = torch.zeros(2 * len(ids), dtype=torch.float64, device=cell.device).index_add_(0, cell, entropy_sum)
        counts = torch.zeros_like(sums).index_add_(0, cell, token_count)
        responses = torch.zeros_like(sums).index_add_(0, cell, (token_count > 0).to(torch.float64))
        sums, counts, responses = sums.view(-1, 2), counts.view(-1, 2), responses.view(-1, 2)
        paired = (responses >= self.min_per_stratum).all(-1)
        means = sums[paired] / counts[paired]
        means = means.clamp_min(1e-12)  # a zero-entropy stratum: a finite, very large ratio instead of inf
        return {"question": ids[paired].cpu(), "log_ratio": (means[:, 0].log() - means[:, 1].log()).cpu(),
                "failed": responses[paired, 0].long().cpu(), "successful": responses[paired, 1].long().cpu()}

    def log_ratios(self) -> Tensor:
        """``log ρ_q`` of the paired questions, in the order of their (sorted) ids (this rank's states outside
        ``compute``; :meth:`per_question` gathers every rank's)."""
        return self._paired_rows()["log_ratio"]

    def per_question(self) -> dict[str, Tensor]:
        """The paired questions over every rank's updates, sorted by id: ``question`` (id), ``log_ratio``
        (``log ρ_q``; their mean is ``log`` of :meth:`compute`'s geometric mean), ``failed`` and ``successful``
        (responses with at least one token in each outcome).

        A collective under DDP, like :meth:`compute`: the ``cat`` states are gathered for the call and restored
        after it (torchmetrics un-syncs after ``compute`` too, so the states never hold other ranks' rows outside it).
        """
        with self.sync_context(dist_sync_fn=self.dist_sync_fn, should_sync=self._to_sync,
                               should_unsync=self._should_unsync):
            return self._paired_rows()

    def compute(self) -> dict[str, Tensor]:
        summary = paired_ratio_summary(self.log_ratios(), self.num_resamples, self.confidence, self.seed)
        return {k: torch.tensor(v, dtype=torch.float64) for k, v in summary.items()}


class CovarianceTailConcentration(Metric):
    """Share of positive chosen-token covariance in the top tokens of each reward stratum.

    ``update(covariance, mask, correct)`` with ``(N, T)`` per-token covariance terms (already centred over the
    batch, e.g. :func:`~lightning_rlvr.algorithms.covariance.token_covariance`) and ``(N,)`` verdicts;
    ``compute()`` returns ``{"failed_top<pct>", "successful_top<pct>"}`` for each fraction: the share of the
    stratum's positive mass held by its top ``⌈fraction · n_stratum⌉`` tokens (:func:`tail_mass_share`).
    ``cat`` states: every token of the window is kept, so update it over one batch (an endpoint proxy, as in
    the paper) or a few.

    Args:
        fractions: upper-tail budgets (default the paper's 1 %, 2.5 %, 5 %).
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    def __init__(self, fractions: Sequence[float] = (0.01, 0.025, 0.05), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not fractions or not all(0 < f <= 1 for f in fractions):
            raise ValueError(f"CovarianceTailConcentration: fractions must be in (0, 1], got {fractions}")
        self.fractions = tuple(float(f) for f in fractions)
        self.add_state("values", default=[], dist_reduce_fx="cat")
        self.add_state("successful", default=[], dist_reduce_fx="cat")

    def update(self, covariance: Tensor, mask: Tensor, correct: Tensor) -> None:
        valid = mask > 0
        self.values.append(covariance[valid].double())
        self.successful.append(correct.unsqueeze(-1).expand_as(valid)[valid].long())

    @staticmethod
    def key(stratum: str, fraction: float) -> str:
        return f"{stratum}_top{fraction * 100:g}pct".replace(".", "_")

    def compute(self) -> dict[str, Tensor]:
        values, successful = _cat(self.values), _cat(self.successful, torch.long).bool()
        out = {}
        for stratum, select in (("failed", ~successful), ("successful", successful)):
            for fraction in self.fractions:
                out[self.key(stratum, fraction)] = torch.tensor(tail_mass_share(values[select], fraction),
                                                                dtype=torch.float64)
        return out
