"""The published findings (a)-(e) and (f), each tested on a study's summaries with a stated rule, so that
"reproduced" has one meaning across studies."""

from __future__ import annotations

import math
from typing import Any

from lightning_rlvr.metrics.tradeoff import exponential_tradeoff_fit
from lightning_rlvr.study.config import StudyConfig
from lightning_rlvr.study.summaries import (
    BROKEN_BELOW,
    FAR_ABOVE,
    FIT_R2,
    MethodSummary,
    _balanced_sign_agreement,
    _correlation,
    _majority_rate,
    _rho_interval,
    _sign_agreement,
    _spearman,
    fmt,
    spearman_permutation,
)

__all__ = ["findings", "tradeoff_table"]


def findings(study: StudyConfig, methods: dict[str, MethodSummary]) -> dict[str, dict[str, Any]]:
    """Test the four published findings on the study's runs; each gets ``verdict`` and ``text``.

    Rules (verdicts are "reproduced", "partly", "not reproduced" or "not measured"):

    - (a) failed responses carry higher entropy than successful ones: per run, the common-question paired
      ratio (the endpoint estimator when logged, else the last rolling window); reproduced when every baseline
      run's bootstrap CI lies above 1, partly when some do.
    - (b) the covariance/flow approximation predicts the sign of the entropy change: pooled over all
      probed steps of all runs, per predictor, the sign agreement must beat the majority-sign forecast;
      reproduced when both predictors beat it, partly when one does. Reported beside it: the balanced sign
      agreement and the correlation (does a losing predictor still carry information?), and the agreement of
      changes summed over blocks of ``block`` rollout steps (the paper's adjacent-checkpoint scale).
    - (c) Clip-Cov/KL-Cov keep entropy far above the baseline late: a keeper's final entropy is at least
      :data:`FAR_ABOVE` × the baseline's in every seed; partly when merely above it in every seed.
    - (d) entropy alone does not order methods by accuracy: Spearman ρ between the methods' mean final
      entropy and mean held-out accuracy, with a bootstrap CI over methods, and again without the methods whose
      accuracy is below :data:`BROKEN_BELOW` × the baseline's (training broke down). A null claim cannot be
      confirmed by a test: p ≥ 0.05 is "no relation detected", p < 0.05 "not reproduced".
    - (e) performance is traded from entropy as ``R = −a·exp(H) + b`` (Cui et al.): per method, the fit on the
      pooled entropy-accuracy points of its runs; reproduced when the baseline's fit has ``a > 0`` and R² ≥
      :data:`FIT_R2`, partly when ``a > 0`` with a lower R², not reproduced when ``a ≤ 0``.
    """
    result: dict[str, dict[str, Any]] = {}
    baseline = methods.get(study.report.baseline)

    # (a)
    if baseline is None or not any(math.isfinite(r.paired_ratio) for r in baseline.runs):
        result["a"] = {"verdict": "not measured", "text": "No paired ratio was logged for the baseline."}
    else:
        runs = baseline.runs
        above = baseline.seeds_ci_above_one
        all_windows = sum(r.windows for m in methods.values() for r in m.runs)
        all_above = sum(r.windows_above_one for m in methods.values() for r in m.runs)
        all_below = sum(r.windows_below_one for m in methods.values() for r in m.runs)
        per_seed = "; ".join(f"seed {r.seed}: {fmt(r.paired_ratio)} [{fmt(r.paired_ci_low)}, "
                             f"{fmt(r.paired_ci_high)}]" + (f" over {fmt(100 * r.endpoint_coverage, 0)}% of the "
                                                            f"probe questions" if r.paired_estimator == "endpoint"
                                                            else "") for r in runs)
        verdict = "reproduced" if above == len(runs) else "partly" if above else "not reproduced"
        estimator = ("endpoint estimator at the last probe" if runs[0].paired_estimator == "endpoint"
                     else "rolling, last window")
        result["a"] = {"verdict": verdict, "baseline_runs_above": above, "baseline_runs": len(runs),
                       "pooled": baseline.pooled,
                       "windows": all_windows, "windows_above": all_above, "windows_below": all_below,
                       "text": f"{study.report.baseline}, paired failed/successful entropy ratio ("
                               f"{estimator}; 95% bootstrap CI over questions): {per_seed}. CI above 1 in {above} of {len(runs)} "
                               f"runs." + (f" Pooled over the seeds: {fmt(baseline.pooled['ratio'])} "
                                           f"[{fmt(baseline.pooled['ci_low'])}, {fmt(baseline.pooled['ci_high'])}] "
                                           f"over {int(baseline.pooled['questions'])} questions "
                                           f"({int(baseline.pooled['rows'])} question-seed pairs)."
                                           if baseline.pooled else "")
                               + f" Over every window of every run of every method: {all_above} of "
                               f"{all_windows} windows have the CI above 1, {all_below} below 1."}

    # (b)
    probe = [p for m in methods.values() for r in m.runs for p in r.probe]
    if not probe:
        result["b"] = {"verdict": "not measured", "text": "No entropy-change probe was logged."}
    else:
        observed = [o for _, _, o in probe]
        predicted = {"cov": [c for c, _, _ in probe], "flow": [f for _, f, _ in probe]}
        cov, flow = (_sign_agreement(predicted[k], observed) for k in ("cov", "flow"))
        balanced = {k: _balanced_sign_agreement(v, observed) for k, v in predicted.items()}
        correlation = {k: _correlation(v, observed) for k, v in predicted.items()}
        bar = _majority_rate(observed)
        negative = sum(o < 0 for o in observed) / len(observed)
        beats = (cov > bar) + (flow > bar)
        verdict = "reproduced" if beats == 2 else "partly" if beats else "not reproduced"
        per_method = ", ".join(f"{m.method} {fmt(m.mean['sign_agreement_flow'], 2)}" for m in methods.values())
        blocks = [b for m in methods.values() for r in m.runs for b in r.probe_blocks]
        block_observed = [o for _, _, o in blocks]
        block = {"cov": _sign_agreement([c for c, _, _ in blocks], block_observed),
                 "flow": _sign_agreement([f for _, f, _ in blocks], block_observed),
                 "majority": _majority_rate(block_observed)}
        block_pearson = {k: _correlation([b[i] for b in blocks], block_observed) for i, k in enumerate(("cov", "flow"))}
        block_spearman = {k: _spearman([b[i] for b in blocks], block_observed) for i, k in enumerate(("cov", "flow"))}
        result["b"] = {"verdict": verdict, "steps": len(probe), "agreement_cov": cov, "agreement_flow": flow,
                       "majority_rate": bar, "balanced_cov": balanced["cov"], "balanced_flow": balanced["flow"],
                       "correlation_cov": correlation["cov"], "correlation_flow": correlation["flow"],
                       "blocks": len(blocks), "block_agreement_cov": block["cov"],
                       "block_agreement_flow": block["flow"], "block_majority_rate": block["majority"],
                       "block_pearson_cov": block_pearson["cov"], "block_pearson_flow": block_pearson["flow"],
                       "block_spearman_cov": block_spearman["cov"], "block_spearman_flow": block_spearman["flow"],
                       "text": f"Over {len(probe)} probed steps of all runs: the sign of −Cov(log π, A) matches the "
                               f"observed entropy change in {fmt(cov)} of steps, the flow's in {fmt(flow)}; "
                               f"entropy fell in {fmt(negative)} of them, so always forecasting the commoner sign "
                               f"scores {fmt(bar)}. Balanced over rises and falls (a constant forecast scores "
                               f"0.5): −covariance {fmt(balanced['cov'])}, flow {fmt(balanced['flow'])}; Pearson r "
                               f"of prediction and observation: {fmt(correlation['cov'], 2)} and "
                               f"{fmt(correlation['flow'], 2)}. At the checkpoint scale (changes summed over "
                               f"{len(blocks)} blocks of {study.report.block} rollout steps): −covariance "
                               f"{fmt(block['cov'])}, flow {fmt(block['flow'])}, commoner sign "
                               f"{fmt(block['majority'])}; Pearson r {fmt(block_pearson['cov'], 2)} and "
                               f"{fmt(block_pearson['flow'], 2)}, Spearman ρ {fmt(block_spearman['cov'], 2)} and "
                               f"{fmt(block_spearman['flow'], 2)}. Flow sign agreement per method (mean over "
                               f"seeds): {per_method}."}

    # (c)
    keepers = [methods[k] for k in study.report.entropy_keepers if k in methods]
    if baseline is None or not keepers:
        result["c"] = {"verdict": "not measured", "text": "The baseline or the entropy keepers did not run."}
    else:
        base_by_seed = {r.seed: r.final_entropy for r in baseline.runs}
        verdicts, parts, ratios = [], [], {}
        for keeper in keepers:
            paired = [(r.final_entropy, base_by_seed[r.seed]) for r in keeper.runs if r.seed in base_by_seed]
            ratio = keeper.mean["final_entropy"] / baseline.mean["final_entropy"]
            ratios[keeper.method] = ratio
            far = all(k >= FAR_ABOVE * b for k, b in paired)
            higher = all(k > b for k, b in paired)
            verdicts.append("reproduced" if far else "partly" if higher else "not reproduced")
            parts.append(f"{keeper.method} {fmt(keeper.mean['final_entropy'])} ± {fmt(keeper.sd['final_entropy'])} "
                         f"({fmt(ratio, 2)}× {study.report.baseline}; above it in "
                         f"{sum(k > b for k, b in paired)} of {len(paired)} seeds)")
        verdict = verdicts[0] if len(set(verdicts)) == 1 else "partly"
        result["c"] = {"verdict": verdict, "ratios": ratios,
                       "text": f"Final entropy (mean of the last {study.report.late_window} rollout steps): "
                               f"{study.report.baseline} {fmt(baseline.mean['final_entropy'])} ± "
                               f"{fmt(baseline.sd['final_entropy'])}; " + "; ".join(parts)
                               + f". \"Far above\" = at least {FAR_ABOVE}× in every seed."}

    # (d)
    ranked = [m for m in methods.values()
              if math.isfinite(m.mean["final_entropy"]) and math.isfinite(m.mean["accuracy"])]
    if len(ranked) < 3:
        result["d"] = {"verdict": "not measured", "text": "Fewer than 3 methods finished."}
    else:
        entropies, accuracies = [m.mean["final_entropy"] for m in ranked], [m.mean["accuracy"] for m in ranked]
        rho, p = spearman_permutation(entropies, accuracies)
        low, high = _rho_interval(entropies, accuracies)
        floor = BROKEN_BELOW * baseline.mean["accuracy"] if baseline is not None else -math.inf
        kept = [m for m in ranked if m.mean["accuracy"] >= floor]
        broken = [m.method for m in ranked if m.mean["accuracy"] < floor]
        rho_kept, p_kept = spearman_permutation([m.mean["final_entropy"] for m in kept],
                                                [m.mean["accuracy"] for m in kept])
        by_entropy = [m.method for m in sorted(ranked, key=lambda m: -m.mean["final_entropy"])]
        by_accuracy = [m.method for m in sorted(ranked, key=lambda m: -m.mean["accuracy"])]
        without = (f" Without {', '.join(broken)} (held-out accuracy below {BROKEN_BELOW}× the baseline's): ρ = "
                   f"{fmt(rho_kept, 2)} over {len(kept)} methods (p = {fmt(p_kept, 3)})." if broken else "")
        result["d"] = {"verdict": "no relation detected" if p >= 0.05 else "not reproduced", "rho": rho, "p": p,
                       "rho_ci_low": low, "rho_ci_high": high, "methods": len(ranked), "left_out": broken,
                       "rho_without_left_out": rho_kept, "p_without_left_out": p_kept,
                       "text": f"Spearman ρ between mean final entropy and mean held-out accuracy over {len(ranked)} "
                               f"methods: {fmt(rho, 2)} (95% bootstrap CI over methods [{fmt(low, 2)}, "
                               f"{fmt(high, 2)}], permutation p = {fmt(p, 3)}); a p ≥ 0.05 finds no monotone "
                               f"relation, which is consistent with the claim but does not confirm it.{without} "
                               f"Highest entropy first: {', '.join(by_entropy)}. Highest accuracy first: "
                               f"{', '.join(by_accuracy)}."}

    # (e)
    fits = {m.method: exponential_tradeoff_fit(*zip(*[pt for r in m.runs for pt in r.tradeoff_points]))
            for m in methods.values() if any(r.tradeoff_points for r in m.runs)}
    base_fit = fits.get(study.report.baseline)
    if base_fit is None or not math.isfinite(base_fit["a"]):
        result["e"] = {"verdict": "not measured", "fits": fits,
                       "text": "The baseline has fewer than two evaluations with distinct entropies."}
    else:
        verdict = ("not reproduced" if base_fit["a"] <= 0 else "reproduced" if base_fit["r2"] >= FIT_R2
                   else "partly")
        result["e"] = {"verdict": verdict, "fits": fits,
                       "text": f"Least-squares fit of held-out accuracy against the mean token entropy of the "
                               f"{study.report.late_window} rollout steps before each evaluation, pooled over seeds. "
                               f"{study.report.baseline}: a = {fmt(base_fit['a'])}, b = {fmt(base_fit['b'])}, "
                               f"R² = {fmt(base_fit['r2'], 2)} over {int(base_fit['n'])} points; predicted accuracy "
                               f"at H = 0: {fmt(base_fit['ceiling'])}. Rule: a > 0 and R² ≥ {FIT_R2}. Every "
                               f"method's fit is in the table below."}
    result["f"] = _polarity_finding(study, methods)
    return result


def _polarity_finding(study: StudyConfig, methods: dict[str, MethodSummary]) -> dict[str, Any]:
    """(f): per token, does the entropy of failed responses fall more than that of successful ones while rising?"""
    baseline = methods.get(study.report.baseline)
    runs = [r for r in baseline.runs if r.polarity_change.get("rising/steps", 0) > 0] if baseline else []
    if not runs:
        return {"verdict": "not measured",
                "text": "No run logged the per-polarity entropy change (EntropyPerformanceAnalysis)."}
    change = {r.seed: r.polarity_change for r in runs}
    failed_more = sum(c["rising/failed"] < c["rising/successful"] for c in change.values())
    verdict = "reproduced" if failed_more == len(runs) else "partly" if failed_more else "not reproduced"

    def stage_text(stage: str) -> str:
        parts = [f"seed {seed}: failed {fmt(c[f'{stage}/failed'], 4)}, successful {fmt(c[f'{stage}/successful'], 4)} "
                 f"per token (contributions {fmt(c[f'{stage}/failed_contribution'], 4)}, "
                 f"{fmt(c[f'{stage}/successful_contribution'], 4)}; {int(c[f'{stage}/steps'])} measured steps)"
                 for seed, c in change.items() if c[f"{stage}/steps"] > 0]
        return "; ".join(parts) if parts else "no run reached it"

    ablation = []
    base_accuracy, base_entropy = baseline.mean["accuracy"], baseline.mean["final_entropy"]
    for method in study.report.polarity_ablation:
        if method in methods:
            m = methods[method]
            ablation.append(f"{method} held-out {fmt(m.mean['accuracy'])} ± {fmt(m.sd['accuracy'])} "
                            f"(baseline {fmt(base_accuracy)}), final entropy {fmt(m.mean['final_entropy'])} "
                            f"({fmt(m.mean['final_entropy'] / base_entropy, 2)}× the baseline's)")
    return {"verdict": verdict, "per_seed": change, "failed_falls_more": failed_more, "runs": len(runs),
            "text": f"{study.report.baseline}, mean observed entropy change per token of each outcome over the "
                    f"measured steps, rising stage (before the detected transition; the whole run where none was "
                    f"detected): {stage_text('rising')}. Plateau: {stage_text('plateau')}. The contributions "
                    f"(Σ ΔH of a polarity over all tokens) grow with the polarity's share of the tokens, so only the "
                    f"per-token change is compared. Rule: reproduced when the failed responses' per-token entropy "
                    f"falls more than the successful ones' in the rising stage of every seed ({failed_more} of "
                    f"{len(runs)})."
                    + (" The authors' ablation, training on one advantage sign only (PolarityFilter): "
                       + "; ".join(ablation) + "." if ablation else "")}


def tradeoff_table(findings_e: dict[str, Any]) -> str:
    """Finding (e)'s per-method fits of ``R = −a·exp(H) + b`` as a markdown table."""
    lines = ["| method | a | b | R² | accuracy at H = 0 | points |", "|---|---|---|---|---|---|"]
    for method, fit in findings_e.get("fits", {}).items():
        lines.append(f"| {method} | {fmt(fit['a'])} | {fmt(fit['b'])} | {fmt(fit['r2'], 2)} "
                     f"| {fmt(fit['ceiling'])} | {int(fit['n'])} |")
    return "\n".join(lines)


