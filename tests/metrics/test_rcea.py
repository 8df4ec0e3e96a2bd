"""RCEA diagnostics against numpy/scipy references on multi-batch updates; bootstrap reproducibility and coverage."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats

from lightning_rlvr.metrics.rcea import (
    CovarianceTailConcentration,
    PairedEntropyRatio,
    StratifiedEntropy,
    bootstrap_ci,
    cluster_modes,
    effective_mode_count,
    majority_vote_correct,
    mode_labels,
    mode_retention,
    rarefied_effective_modes,
    sign_test_pvalue,
    tail_mass_share,
)


def batches(n_batches=3, rows=12, width=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        lengths = torch.randint(0, width + 1, (rows,), generator=g)  # includes empty responses
        mask = (torch.arange(width) < lengths.unsqueeze(-1)).float()
        correct = torch.rand(rows, generator=g) < 0.4
        entropy = torch.rand(rows, width, generator=g) * (1.5 - correct.float().unsqueeze(-1))
        questions = torch.randint(0, 6, (rows,), generator=g)
        out.append((entropy, mask, correct, questions))
    return out


def test_stratified_entropy_matches_numpy_over_several_updates():
    data = batches()
    metric = StratifiedEntropy()
    for entropy, mask, correct, _ in data:
        metric.update(entropy, mask, correct)
    result = metric.compute()
    tokens = {0: [], 1: []}
    seq = {0: [], 1: []}
    for entropy, mask, correct, _ in data:
        for i in range(len(mask)):
            n = int(mask[i].sum())
            values = entropy[i, :n].double().numpy()
            tokens[int(correct[i])].extend(values)
            if n:
                seq[int(correct[i])].append(values.mean())
    assert result["failed"].item() == pytest.approx(np.mean(tokens[0]))
    assert result["successful"].item() == pytest.approx(np.mean(tokens[1]))
    assert result["ratio"].item() == pytest.approx(np.mean(tokens[0]) / np.mean(tokens[1]))
    assert result["failed_seq"].item() == pytest.approx(np.mean(seq[0]))
    assert result["ratio_seq"].item() == pytest.approx(np.mean(seq[0]) / np.mean(seq[1]))
    assert result["failed_mass_share"].item() == pytest.approx(np.sum(tokens[0]) / (np.sum(tokens[0]) + np.sum(tokens[1])))
    metric.reset()
    entropy, mask, _, _ = data[0]
    metric.update(entropy, mask, torch.zeros(len(mask), dtype=torch.bool))
    assert math.isnan(metric.compute()["successful"].item())  # an empty stratum is nan, not 0


def paired_by_hand(data):
    sums: dict[tuple[int, int], list[float]] = {}
    for entropy, mask, correct, questions in data:
        for i in range(len(mask)):
            n = int(mask[i].sum())
            cell = sums.setdefault((int(questions[i]), int(correct[i])), [0.0, 0.0])
            cell[0] += entropy[i, :n].double().sum().item()
            cell[1] += n
    logs = []
    for q in sorted({q for q, _ in sums}):
        fail, succ = sums.get((q, 0), [0, 0]), sums.get((q, 1), [0, 0])
        if fail[1] and succ[1]:
            logs.append(math.log(fail[0] / fail[1]) - math.log(succ[0] / succ[1]))
    return np.array(logs)


def test_paired_ratio_matches_a_loop_and_scipy_sign_test():
    data = batches(n_batches=4)
    metric = PairedEntropyRatio(num_resamples=2000, seed=3)
    for entropy, mask, correct, questions in data:
        metric.update(entropy, mask, correct, questions)
    result = metric.compute()
    logs = paired_by_hand(data)
    assert len(logs) >= 4 and result["paired"].item() == len(logs)
    assert result["geometric_mean"].item() == pytest.approx(math.exp(logs.mean()))
    higher = int((logs > 0).sum())
    assert result["failure_higher"].item() == pytest.approx(higher / len(logs))
    expected_p = stats.binomtest(higher, len(logs), 0.5, alternative="greater").pvalue
    assert result["sign_test_p"].item() == pytest.approx(expected_p)
    assert result["ci_low"].item() <= result["geometric_mean"].item() <= result["ci_high"].item()
    again = PairedEntropyRatio(num_resamples=2000, seed=3)
    for entropy, mask, correct, questions in data:
        again.update(entropy, mask, correct, questions)
    assert again.compute()["ci_low"].item() == result["ci_low"].item()  # seeded: reproducible


def test_a_question_is_paired_only_with_min_per_stratum_responses_in_each_outcome():
    # Question 7: 2 failed responses (entropies [1, 3] and [2]) and 2 successful ([0.5] and [0.5, 1.5]);
    # question 9: 1 failed, 3 successful; question 11: 2 failed, none successful. An empty response never counts.
    entropy = torch.tensor([[1.0, 3.0], [2.0, 0.0], [0.5, 0.0], [0.5, 1.5], [4.0, 0.0], [1.0, 0.0], [1.0, 0.0],
                            [1.0, 0.0], [2.0, 0.0], [2.0, 0.0], [9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0],
                         [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    correct = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 1])
    questions = torch.tensor([7, 7, 7, 7, 9, 9, 9, 9, 11, 11, 11])
    expected_7 = math.log((1 + 3 + 2) / 3) - math.log((0.5 + 0.5 + 1.5) / 3)  # pooled token means
    for minimum, expected in ((1, [expected_7, math.log(4.0 / 1.0)]), (2, [expected_7]), (3, [])):
        metric = PairedEntropyRatio(min_per_stratum=minimum)
        metric.update(entropy, mask, correct, questions)
        assert metric.log_ratios().tolist() == pytest.approx(expected), minimum
    with pytest.raises(ValueError, match="min_per_stratum"):
        PairedEntropyRatio(min_per_stratum=0)


def test_sign_test_by_hand():
    assert sign_test_pvalue(3, 3) == pytest.approx(1 / 8)
    assert sign_test_pvalue(0, 4) == 1.0
    assert sign_test_pvalue(2, 4) == pytest.approx(11 / 16)
    with pytest.raises(ValueError):
        sign_test_pvalue(5, 4)


# The seed paper's Table A5 (arXiv RCEA, question-level direction check): method, paired questions n, share
# "failure higher" as printed, one-sided exact sign-test p as printed.
TABLE_A5 = [
    ("GRPO", 52, "71.2", "0.0016"),
    ("DAPO", 45, "73.3", "0.0012"),
    ("Clip-Cov", 56, "80.4", "2.7e-6"),
    ("KL-Cov", 57, "70.2", "0.0016"),
    ("EP-GRPO", 52, "73.1", "0.0006"),
    ("GTPO", 42, "50.0", "0.5612"),
]


@pytest.mark.parametrize("method, n, share, printed_p", TABLE_A5, ids=[row[0] for row in TABLE_A5])
def test_the_sign_test_reproduces_the_seed_papers_table_a5(method, n, share, printed_p):
    failure_higher = round(float(share) / 100 * n)
    assert f"{100 * failure_higher / n:.1f}" == share  # the count the printed share comes from
    p = sign_test_pvalue(failure_higher, n)
    mantissa_digits = len(printed_p.split("e")[0].replace("0.", "").lstrip("0").replace(".", ""))
    assert f"{p:.{mantissa_digits}g}" == f"{float(printed_p):.{mantissa_digits}g}", (method, p)


def test_bootstrap_interval_is_seeded_and_covers_the_mean_at_about_the_nominal_rate():
    x = torch.randn(40, generator=torch.Generator().manual_seed(0))
    assert bootstrap_ci(x, seed=1) == bootstrap_ci(x, seed=1)
    assert bootstrap_ci(x, seed=1) != bootstrap_ci(x, seed=2)
    # 300 synthetic data sets of 60 log-normal ratios with known geometric mean e^0.1: the percentile interval
    # of the mean of log ρ should cover 0.1 in ~95 % of them (binomial sd at 300 draws ≈ 1.3 %).
    g = torch.Generator().manual_seed(7)
    covered = 0
    draws = 300
    for d in range(draws):
        logs = 0.1 + 0.5 * torch.randn(60, generator=g)
        low, high = bootstrap_ci(logs, num_resamples=400, seed=d)
        covered += low <= 0.1 <= high
    assert 0.90 <= covered / draws <= 0.985


def test_weighted_bootstrap_is_a_ratio_of_sums():
    values, weights = torch.tensor([1.0, 3.0]), torch.tensor([1.0, 3.0])
    low, high = bootstrap_ci(values, weights=weights, num_resamples=500)
    assert 1.0 <= low <= high <= 3.0
    assert bootstrap_ci(torch.ones(5), weights=torch.rand(5)) == (1.0, 1.0)


def test_tail_concentration_by_hand_and_by_stratum():
    values = torch.tensor([10.0, 1.0, 1.0, 1.0, 1.0, -5.0, 0.0, 0.0, 0.0, 0.0])
    assert tail_mass_share(values, 0.1) == pytest.approx(10 / 14)  # top 1 of 10 tokens
    assert tail_mass_share(values, 0.25) == pytest.approx(12 / 14)  # ⌈2.5⌉ = 3 tokens
    g = torch.Generator().manual_seed(1)
    parts = [(torch.randn(5, 6, generator=g), (torch.rand(5, 6, generator=g) > 0.2).float(),
              torch.rand(5, generator=g) > 0.5) for _ in range(2)]
    metric = CovarianceTailConcentration(fractions=(0.05, 0.2))
    for cov, mask, correct in parts:
        metric.update(cov, mask, correct)
    result = metric.compute()
    for stratum, flag in (("failed", False), ("successful", True)):
        pooled = np.concatenate([cov[(mask > 0) & (correct.unsqueeze(-1) == flag)].numpy() for cov, mask, correct in parts])
        for fraction in (0.05, 0.2):
            k = math.ceil(fraction * pooled.size)
            expected = np.sort(np.clip(pooled, 0, None))[::-1][:k].sum() / np.clip(pooled, 0, None).sum()
            assert result[CovarianceTailConcentration.key(stratum, fraction)].item() == pytest.approx(expected)
    assert set(result) == {"failed_top5pct", "failed_top20pct", "successful_top5pct", "successful_top20pct"}


def test_modes_retention_and_majority_vote():
    assert cluster_modes(["12", " 12", "13", "12 "]) == ["12", "13"]
    near = ["x = 3 + 4 = 7", "x = 3 + 4 =  7", "x = 4 + 3 = 7", "completely different route to 7"]
    modes = cluster_modes(near, similarity=0.6)
    assert len(modes) == 3 and cluster_modes(near, 0.6) == modes  # deterministic
    assert mode_retention(["12", "13"], ["13"]) == 1
    assert mode_retention(modes, ["x = 3 + 4 = 7 "], similarity=0.6) == 1
    answers = [["5", "6", "6", "5"], ["1", "2", "3", "2"], ["9", "9", "8", "8"]]
    correct = torch.tensor([[1, 0, 0, 1], [0, 1, 0, 1], [0, 0, 1, 1]], dtype=torch.bool)
    # problem 0: tie 5 vs 6 → the first seen (5, correct); 1: majority 2 (correct); 2: tie → 9 (wrong)
    assert majority_vote_correct(answers, correct).tolist() == [1.0, 1.0, 0.0]


def test_weighted_bootstrap_covers_a_known_pooled_retention():
    # 300 synthetic probe sets of 50 questions with 1–4 baseline modes each, every mode kept with probability
    # 0.8: the ratio-of-sums interval (the retention CI) should cover 0.8 in ~95 % of them (observed 93 %).
    g = torch.Generator().manual_seed(11)
    covered = 0
    draws = 300
    for d in range(draws):
        base = torch.randint(1, 5, (50,), generator=g).double()
        kept = torch.binomial(base, torch.full_like(base, 0.8), generator=g)
        low, high = bootstrap_ci(kept / base, weights=base, num_resamples=400, seed=d)
        covered += low <= 0.8 <= high
    assert 0.89 <= covered / draws <= 0.985


# -- rarefied effective modes -----------------------------------------------------------------------------
def hill_by_hand(labels) -> float:
    """exp(−Σ_j p_j log p_j), written out independently of the library."""
    n = len(labels)
    return math.exp(-sum(labels.count(j) / n * math.log(labels.count(j) / n) for j in set(labels)))


def test_effective_mode_count_by_hand():
    assert effective_mode_count([0, 0, 1, 1]) == pytest.approx(2.0)
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))  # 0.5623...
    assert entropy == pytest.approx(0.5623, abs=1e-4)
    assert effective_mode_count([0, 0, 0, 1]) == pytest.approx(math.exp(entropy))
    assert effective_mode_count([5, 5, 5]) == pytest.approx(1.0)
    assert effective_mode_count([3, 1, 2]) == pytest.approx(3.0)  # all distinct: as many modes as samples
    assert math.isnan(effective_mode_count([]))


def test_rarefied_effective_modes_is_the_mean_over_subsets():
    labels = [0, 0, 1, 2, 2, 2]
    g = torch.Generator().manual_seed(0)
    # A subset of every label is the whole set: the unrarefied count.
    assert rarefied_effective_modes(labels, 6, 5, g) == pytest.approx(hill_by_hand(labels))
    assert math.isnan(rarefied_effective_modes(labels, 7, 5, g))  # fewer labels than the size
    assert math.isnan(rarefied_effective_modes([], 1, 5, g))
    # Many draws approach the exact expectation over all C(6, 3) = 20 subsets (values in [1, 3], sd < 0.6:
    # the standard error at 4000 draws is below 0.01).
    exact = np.mean([hill_by_hand(list(c)) for c in itertools.combinations(labels, 3)])
    estimate = rarefied_effective_modes(labels, 3, 4000, torch.Generator().manual_seed(1))
    assert estimate == pytest.approx(exact, abs=0.04)
    # Frozen draws: the same seed gives the same value.
    assert (rarefied_effective_modes(labels, 3, 10, torch.Generator().manual_seed(5))
            == rarefied_effective_modes(labels, 3, 10, torch.Generator().manual_seed(5)))
    for size, draws in ((0, 1), (1, 0)):
        with pytest.raises(ValueError, match="size >= 1 and draws >= 1"):
            rarefied_effective_modes(labels, size, draws, g)


def test_mode_labels_follow_cluster_modes_with_near_duplicates():
    solutions = ["the sum is 12", "the sum is 12.", "so the sum is 12", "twelve by counting", "twelve  by counting ",
                 "12"]
    # Character 3-grams: "so the sum is 12" has 14, "the sum is 12" 11 (all among those 14), "the sum is 12." the
    # same 11 and "12.". Jaccard: "the sum is 12" ~ "so the sum is 12" = 11/14 = 0.786; "the sum is 12." ~ "so the
    # sum is 12" = 11/15 = 0.733; "the sum is 12" ~ "the sum is 12." = 11/12 = 0.917. In sorted order "12" and
    # "so the sum is 12" found modes, "the sum is 12" joins the latter (0.786 >= 0.75), "the sum is 12." does not
    # match that representative (0.733) and founds its own mode, although it is 0.917 from a member of it.
    modes = cluster_modes(solutions, similarity=0.75)
    assert modes == ["12", "so the sum is 12", "the sum is 12.", "twelve by counting"]
    assert mode_labels(solutions, similarity=0.75) == [1, 2, 1, 3, 3, 0]
    # At similarity 1 a mode is a distinct normalised text.
    assert mode_labels(solutions) == [2, 3, 1, 4, 4, 0]
    assert [cluster_modes(solutions)[j] for j in mode_labels(solutions)] == [" ".join(s.split()) for s in solutions]
    assert mode_labels([]) == []
    with pytest.raises(ValueError, match="similarity"):
        mode_labels(solutions, similarity=0)


def test_per_question_rows_are_the_log_ratios_with_their_ids_and_counts():
    # Question 7: failed entropies [1, 3], [2] and successful [0.5], [0.5, 1.5]; question 9: one of each;
    # question 11 has no success. The id order is sorted; the counts are responses of each outcome.
    entropy = torch.tensor([[1.0, 3.0], [2.0, 0.0], [0.5, 0.0], [0.5, 1.5], [4.0, 0.0], [1.0, 0.0], [2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    correct = torch.tensor([0, 0, 1, 1, 1, 0, 0])
    questions = torch.tensor([9, 7, 7, 9, 7, 7, 11])
    metric = PairedEntropyRatio()
    metric.update(entropy, mask, correct, questions)
    rows = metric.per_question()
    assert rows["question"].tolist() == [7, 9]
    assert rows["log_ratio"].tolist() == pytest.approx([math.log(((2 + 1) / 2) / ((0.5 + 4) / 2)),
                                                         math.log(((1 + 3) / 2) / ((0.5 + 1.5) / 2))])
    assert rows["failed"].tolist() == [2, 1] and rows["successful"].tolist() == [2, 1]
    assert rows["log_ratio"].tolist() == metric.log_ratios().tolist()
    assert metric.compute()["geometric_mean"].item() == pytest.approx(math.exp(rows["log_ratio"].mean().item()))


def per_question_outputs(rank: int) -> dict:
    data = batches(n_batches=2)
    metric, idle = PairedEntropyRatio(), PairedEntropyRatio()
    for entropy, mask, correct, questions in data:
        rows = slice(0, 5) if rank == 0 else slice(5, None)  # unequal shards
        metric.update(entropy[rows], mask[rows], correct[rows], questions[rows])
    if rank == 0:  # a rank without data updates with typed empty tensors (as RCEADiagnostics does)
        idle.update(*(t[:6] for t in data[0]))
    else:
        idle.update(torch.zeros(0, 1), torch.zeros(0, 1), torch.zeros(0, dtype=torch.bool),
                    torch.zeros(0, dtype=torch.long))
    return {"rows": metric.per_question(), "local": metric.log_ratios(), "idle": idle.per_question()}


@pytest.mark.slow
def test_per_question_gathers_every_ranks_rows_under_ddp(tmp_path):
    from tests.two_ranks import two_rank_results

    results = two_rank_results(per_question_outputs, tmp_path)
    whole = PairedEntropyRatio()
    for entropy, mask, correct, questions in batches(n_batches=2):
        whole.update(entropy, mask, correct, questions)
    expected = paired_by_hand(batches(n_batches=2))
    for result in results:
        assert result["rows"]["log_ratio"].tolist() == pytest.approx(expected.tolist())
        assert result["rows"]["question"].tolist() == whole.per_question()["question"].tolist()
    # The states are this rank's again after the call (as after compute): rank 0's own rows differ from the whole's.
    assert results[0]["local"].tolist() != pytest.approx(expected.tolist())
    only_rank0 = PairedEntropyRatio()
    only_rank0.update(*(t[:6] for t in batches(n_batches=2)[0]))
    for result in results:
        assert result["idle"]["log_ratio"].tolist() == pytest.approx(only_rank0.per_question()["log_ratio"].tolist())
