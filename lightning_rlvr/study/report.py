"""The study report: read the study's finished MLflow runs, summarise per method over seeds, test the findings.

Everything in the report is computed from the MLflow runs (the metrics the runs logged), so the report
of a study can be rebuilt at any time (``--report-only``) and checked against ``mlflow ui``.

Per run (metric names as the callbacks log them):

- held-out accuracy, pass@k, maj@k: the last ``val/accuracy``, ``val/pass_at_k``, ``val/maj_at_k``;
- final entropy: mean ``entropy/token_mean`` over the last ``late_window`` rollout steps;
- answer-coverage retention: the last ``rcea/retention`` (share of the start's correct modes still found: recall
  of the baseline's correct answers, at most 1; not the seed paper's rarefied effective-mode ratio);
- failed/successful entropy: the seed paper's endpoint paired ratio at the last probe (``rcea/endpoint_paired_ratio``
  with its bootstrap CI, ``RCEADiagnostics(endpoint_samples=K)``) when the runs log it, else the last window's
  rolling ratio over training rollouts (``rcea/paired_ratio``, ``rcea/paired_ci_low`` / ``_high``), which is kept
  as ``rolling_paired_ratio``; over all windows, the share of rolling CIs above 1;
- predicted vs observed entropy change: every ``probe/observed`` step with its ``probe/cov_pred`` (the
  prediction is ``−cov``) and ``probe/flow_pred``; sign agreement against the score of always forecasting
  the majority sign;
- stage transition: the last ``stage/transition_step`` (none when the detector never left "rising");
- OPEFO's balancing coefficient: the mean of ``opefo/lambda`` over the run (methods that log it);
- entropy-performance points: each evaluation's ``val/accuracy`` against the mean ``entropy/token_mean`` of the
  ``late_window`` rollout steps up to it (Cui et al.'s ``R = −a·exp(H) + b`` is fitted on them per method).

Per method: mean and sample standard deviation over seeds. The published findings (a)-(e) are tested with stated
rules (:func:`findings`), so "reproduced" has one meaning across studies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from lightning_rlvr.metrics.entropy_change import average_ranks, pearson, sign_agreement, spearman
from lightning_rlvr.metrics.rcea import bootstrap_ci
from lightning_rlvr.metrics.tradeoff import exponential_tradeoff_fit
from lightning_rlvr.plots import trailing_mean
from lightning_rlvr.study.config import StudyConfig, callback_arguments, config_overrides
from lightning_rlvr.study.runner import finished_runs

__all__ = ["MethodSummary", "RunSummary", "build_report", "findings", "polarity_change", "pooled_paired_ratio",
           "spearman_permutation", "summarise_run", "tradeoff_table"]

_KEYS = ("val/accuracy", "val/pass_at_k", "val/maj_at_k", "entropy/token_mean", "rcea/retention",
         "rcea/paired_ratio", "rcea/paired_ci_low", "rcea/paired_ci_high", "probe/cov_pred", "probe/flow_pred",
         "probe/observed", "stage/transition_step", "opefo/lambda", "rcea/endpoint_paired_ratio",
         "rcea/endpoint_ci_low", "rcea/endpoint_ci_high", "rcea/endpoint_coverage", "rcea/effective_mode_ratio",
         "rcea/effective_mode_ratio_ci_low", "rcea/effective_mode_ratio_ci_high", "rcea/effective_mode_questions",
         "analysis/delta_entropy/positive", "analysis/delta_entropy/negative",
         "analysis/delta_entropy/positive_contribution", "analysis/delta_entropy/negative_contribution")
#: bootstrap resamples of the pooled paired-ratio interval (the seed paper's Table A6 uses 10,000).
POOLED_RESAMPLES = 10_000
#: "far above" in finding (c): the keeper's final entropy is at least this multiple of the baseline's in every seed.
FAR_ABOVE = 1.5
#: finding (d) leaves out, as a second estimate, methods whose held-out accuracy is below this share of the baseline's.
BROKEN_BELOW = 0.5
#: finding (e): the baseline's fit of R = −a·exp(H) + b is "reproduced" when a > 0 and R² reaches this.
FIT_R2 = 0.7

Series = list[tuple[int, float]]


def _last(series: Series) -> float:
    return series[-1][1] if series else math.nan


def _sign_agreement(predicted: Sequence[float], observed: Sequence[float]) -> float:
    """Share of finite pairs whose signs match (a zero matches only a zero)."""
    return sign_agreement(torch.tensor(predicted, dtype=torch.float64), torch.tensor(observed, dtype=torch.float64))


def _balanced_sign_agreement(predicted: Sequence[float], observed: Sequence[float]) -> float:
    """Mean over the observed signs (rise, fall) of the share of those steps whose sign was predicted.

    A constant forecast scores 0.5 whatever the base rate, so above 0.5 = the predictor carries information
    about the direction even where it loses to the majority forecast on raw agreement.
    """
    pairs = [(p, o) for p, o in zip(predicted, observed) if math.isfinite(p) and math.isfinite(o) and o != 0]
    recalls = [statistics.fmean((p > 0) == rising for p, _ in group)
               for rising in (True, False) if (group := [(p, o) for p, o in pairs if (o > 0) == rising])]
    return statistics.fmean(recalls) if len(recalls) == 2 else math.nan


def _correlation(predicted: Sequence[float], observed: Sequence[float]) -> float:
    """Pearson r of finite pairs (nan with fewer than 2 or no spread)."""
    return pearson(torch.tensor(predicted, dtype=torch.float64), torch.tensor(observed, dtype=torch.float64))


def _majority_rate(observed: Sequence[float]) -> float:
    """Score of a constant forecast of the commoner sign: the bar a sign agreement has to clear."""
    values = [o for o in observed if math.isfinite(o)]
    if not values:
        return math.nan
    negative = sum(o < 0 for o in values) / len(values)
    return max(negative, sum(o > 0 for o in values) / len(values))


@dataclasses.dataclass
class RunSummary:
    """One finished run, reduced to the report's numbers (and the series the figures draw)."""

    method: str
    seed: int
    run_id: str
    accuracy: float
    pass_at_k: float
    maj_at_k: float
    retention: float
    final_entropy: float
    paired_ratio: float
    paired_ci_low: float
    paired_ci_high: float
    windows_above_one: int
    windows_below_one: int
    windows: int
    sign_agreement_flow: float
    sign_agreement_cov: float
    majority_rate: float
    transition_step: float
    opefo_lambda: float = math.nan
    paired_estimator: str = "rolling"
    rolling_paired_ratio: float = math.nan
    endpoint_coverage: float = math.nan
    effective_mode_ratio: float = math.nan
    polarity_change: dict[str, float] = dataclasses.field(default_factory=dict)
    entropy: Series = dataclasses.field(repr=False, default_factory=list)
    val_accuracy: Series = dataclasses.field(repr=False, default_factory=list)
    probe: list[tuple[float, float, float]] = dataclasses.field(repr=False, default_factory=list)
    probe_blocks: list[tuple[float, float, float]] = dataclasses.field(repr=False, default_factory=list)
    tradeoff_points: list[tuple[float, float]] = dataclasses.field(repr=False, default_factory=list)
    #: ``(probe question, log ratio)`` of every paired question at the last endpoint probe (its artifact).
    endpoint_log_ratios: list[tuple[int, float]] = dataclasses.field(repr=False, default_factory=list)

    def numbers(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr}


def polarity_change(history: dict[str, Series], transition_step: float) -> dict[str, float]:
    """Observed per-update entropy change by response outcome, in the rising stage and in the plateau.

    ``EntropyPerformanceAnalysis`` logs, per measured step, the mean ``ΔH`` per token of successful
    (``analysis/delta_entropy/positive``) and of failed responses (``.../negative``), and each polarity's
    *contribution* to the batch mean (``Σ_polarity ΔH / #all tokens``, which grows with the polarity's share of the
    tokens). Returns, for ``rising`` (steps before ``transition_step``; the whole run when no plateau was detected)
    and ``plateau`` (from it on), the mean over measured steps of each: ``<stage>/failed``, ``<stage>/successful``,
    ``<stage>/failed_contribution``, ``<stage>/successful_contribution`` and ``<stage>/steps``.
    """
    split = transition_step if math.isfinite(transition_step) else math.inf
    keys = {"failed": "negative", "successful": "positive", "failed_contribution": "negative_contribution",
            "successful_contribution": "positive_contribution"}
    out: dict[str, float] = {}
    for stage, inside in (("rising", lambda step: step < split), ("plateau", lambda step: step >= split)):
        steps = 0
        for name, key in keys.items():
            values = [v for step, v in history.get(f"analysis/delta_entropy/{key}", []) if inside(step)
                      and math.isfinite(v)]
            out[f"{stage}/{name}"] = statistics.fmean(values) if values else math.nan
            steps = max(steps, len(values))
        out[f"{stage}/steps"] = float(steps)
    return out


def pooled_paired_ratio(log_ratios: Sequence[tuple[int, float]], num_resamples: int = POOLED_RESAMPLES,
                        confidence: float = 0.95, seed: int = 0) -> dict[str, float]:
    """The paired failed/successful ratio pooled over runs, with a bootstrap interval over questions.

    ``log_ratios`` holds ``(question, log ρ)`` rows of several runs (seeds) of one method on the same probe set, so
    a question appears once per run that paired it. The estimate is the geometric mean over all rows,
    ``exp(Σ log ρ / #rows)``; the interval resamples *questions* with replacement, each bringing all its rows (a
    cluster bootstrap: one question's ratios in different seeds are not independent), i.e. the percentile
    interval of ``exp(Σ_q S_q / Σ_q n_q)`` with ``S_q`` and ``n_q`` a resampled question's sum and count.
    """
    by_question: dict[int, list[float]] = {}
    for question, value in log_ratios:
        by_question.setdefault(int(question), []).append(float(value))
    if not by_question:
        return {"ratio": math.nan, "ci_low": math.nan, "ci_high": math.nan, "questions": 0.0, "rows": 0.0}
    counts = torch.tensor([len(v) for v in by_question.values()], dtype=torch.float64)
    means = torch.tensor([math.fsum(v) / len(v) for v in by_question.values()], dtype=torch.float64)
    low, high = bootstrap_ci(means, num_resamples=num_resamples, confidence=confidence, seed=seed, weights=counts)
    total = math.fsum(v for values in by_question.values() for v in values)
    return {"ratio": math.exp(total / counts.sum().item()), "ci_low": math.exp(low), "ci_high": math.exp(high),
            "questions": float(len(by_question)), "rows": counts.sum().item()}


def summarise_run(method: str, seed: int, run_id: str, history: dict[str, Series], late_window: int,
                  block: int = 100, endpoint_log_ratios: Sequence[tuple[int, float]] = ()) -> RunSummary:
    """Reduce one run's metric histories (``{key: [(step, value), ...]}`` sorted by step) to a :class:`RunSummary`.

    ``probe`` holds ``(−cov, flow, observed)`` of every probed step, ``probe_blocks`` the same three summed over
    the probed steps of each ``block`` rollout steps (``[0, block)``, ``[block, 2·block)``, ...).
    """
    entropy = history.get("entropy/token_mean", [])
    last_step = entropy[-1][0] if entropy else 0
    late = [v for s, v in entropy if s > last_step - late_window]
    ratios = {key: dict(history.get(f"rcea/{key}", [])) for key in ("paired_ratio", "paired_ci_low", "paired_ci_high")}
    windows = [s for s, v in ratios["paired_ratio"].items() if math.isfinite(v)]
    low, high = ratios["paired_ci_low"], ratios["paired_ci_high"]
    cov, flow = dict(history.get("probe/cov_pred", [])), dict(history.get("probe/flow_pred", []))
    probed = [(s, (-cov[s], flow[s], o)) for s, o in history.get("probe/observed", []) if s in cov and s in flow]
    probe = [values for _, values in probed]
    observed = [o for _, _, o in probe]
    blocks: dict[int, list[tuple[float, float, float]]] = {}
    for step, values in probed:
        blocks.setdefault(int(step) // block, []).append(values)
    probe_blocks = [tuple(map(math.fsum, zip(*blocks[b]))) for b in sorted(blocks)]
    lambdas = [v for _, v in history.get("opefo/lambda", []) if math.isfinite(v)]
    # A run that probed the endpoint reports it, even where no question paired (a collapsed policy: NaN), rather
    # than falling back to another estimator under the same column.
    endpoint = bool(history.get("rcea/endpoint_paired_ratio"))
    ratio_key, low_key, high_key = (("rcea/endpoint_paired_ratio", "rcea/endpoint_ci_low", "rcea/endpoint_ci_high")
                                    if endpoint else ("rcea/paired_ratio", "rcea/paired_ci_low", "rcea/paired_ci_high"))
    tradeoff_points = []
    for step, accuracy in history.get("val/accuracy", []):
        before = [v for s, v in entropy if step - late_window < s <= step] or [v for s, v in entropy[:1]]
        if before:
            tradeoff_points.append((statistics.fmean(before), accuracy))
    return RunSummary(
        method=method, seed=seed, run_id=run_id,
        accuracy=_last(history.get("val/accuracy", [])), pass_at_k=_last(history.get("val/pass_at_k", [])),
        maj_at_k=_last(history.get("val/maj_at_k", [])), retention=_last(history.get("rcea/retention", [])),
        final_entropy=statistics.fmean(late) if late else math.nan,
        paired_ratio=_last(history.get(ratio_key, [])),
        paired_ci_low=_last(history.get(low_key, [])),
        paired_ci_high=_last(history.get(high_key, [])),
        paired_estimator="endpoint" if endpoint else "rolling",
        rolling_paired_ratio=_last(history.get("rcea/paired_ratio", [])),
        endpoint_coverage=_last(history.get("rcea/endpoint_coverage", [])),
        effective_mode_ratio=_last(history.get("rcea/effective_mode_ratio", [])),
        polarity_change=polarity_change(history, _last(history.get("stage/transition_step", []))),
        endpoint_log_ratios=list(endpoint_log_ratios),
        windows_above_one=sum(low.get(s, math.nan) > 1 for s in windows),
        windows_below_one=sum(high.get(s, math.nan) < 1 for s in windows), windows=len(windows),
        sign_agreement_flow=_sign_agreement([f for _, f, _ in probe], observed),
        sign_agreement_cov=_sign_agreement([c for c, _, _ in probe], observed),
        majority_rate=_majority_rate(observed),
        transition_step=_last(history.get("stage/transition_step", [])),
        opefo_lambda=statistics.fmean(lambdas) if lambdas else math.nan,
        entropy=entropy, val_accuracy=history.get("val/accuracy", []), probe=probe, probe_blocks=probe_blocks,
        tradeoff_points=tradeoff_points,
    )


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0


_AVERAGED = ("accuracy", "pass_at_k", "maj_at_k", "retention", "effective_mode_ratio", "final_entropy",
             "paired_ratio", "paired_ci_low", "paired_ci_high", "sign_agreement_flow", "sign_agreement_cov")


@dataclasses.dataclass
class MethodSummary:
    """A method over its seeds: ``mean[key]`` and ``sd[key]`` for each averaged number, the runs, and the
    endpoint paired ratio pooled over them (:func:`pooled_paired_ratio`; empty when no run saved its rows)."""

    method: str
    runs: list[RunSummary]
    mean: dict[str, float]
    sd: dict[str, float]
    pooled: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, method: str, runs: list[RunSummary]) -> MethodSummary:
        stats = {key: _mean_sd([getattr(r, key) for r in runs]) for key in _AVERAGED}
        rows = [row for r in runs for row in r.endpoint_log_ratios]
        return cls(method, runs, {k: m for k, (m, _) in stats.items()}, {k: s for k, (_, s) in stats.items()},
                   pooled_paired_ratio(rows) if rows else {})

    @property
    def seeds_ci_above_one(self) -> int:
        return sum(r.paired_ci_low > 1 for r in self.runs)

    @property
    def transitions(self) -> list[float]:
        return [r.transition_step for r in self.runs]


def _history(client, run_id: str) -> dict[str, Series]:
    history: dict[str, Series] = {}
    for key in _KEYS:
        by_step: dict[int, tuple[int, float]] = {}
        for m in client.get_metric_history(run_id, key):
            if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
                by_step[m.step] = (m.timestamp, m.value)
        if by_step:
            history[key] = [(s, v) for s, (_, v) in sorted(by_step.items())]
    return history


def _endpoint_rows(client, run_id: str, history: dict[str, Series]) -> list[tuple[int, float]]:
    """``(question, log ratio)`` rows of the run's last endpoint probe, from its artifact (none: empty)."""
    import tempfile

    from mlflow.exceptions import MlflowException

    from lightning_rlvr.loggers import endpoint_ratios_artifact

    probes = history.get("rcea/endpoint_paired_ratio", [])
    if not probes:
        return []
    with tempfile.TemporaryDirectory() as folder:
        try:
            path = client.download_artifacts(run_id, endpoint_ratios_artifact(int(probes[-1][0])), folder)
        except (OSError, MlflowException):  # a run logged before the artifact existed: its own CI remains
            return []
        table = json.loads(Path(path).read_text(encoding="utf-8"))
    columns = table["columns"]
    question, value = columns.index("question"), columns.index("log_ratio")
    return [(int(row[question]), float(row[value])) for row in table["data"]]


def read_study(study: StudyConfig) -> dict[str, MethodSummary]:
    """Every finished run of the study (current config hashes), summarised, grouped by method in study order."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=study.tracking_uri)
    runs = finished_runs(study)
    summaries: dict[str, MethodSummary] = {}
    for method in study.methods:
        found = []
        for seed in study.seeds:
            if (method, seed) not in runs:
                continue
            run_id = runs[(method, seed)].info.run_id
            history = _history(client, run_id)
            found.append(summarise_run(method, seed, run_id, history, study.report.late_window, study.report.block,
                                       _endpoint_rows(client, run_id, history)))
        if found:
            summaries[method] = MethodSummary.of(method, found)
    return summaries


def spearman_permutation(x: Sequence[float], y: Sequence[float], resamples: int = 20_000, seed: int = 0):
    """Spearman's ρ (average ranks) and its two-sided permutation p-value.

    Returns:
        ``(rho, p)``; ``(nan, nan)`` with fewer than 3 pairs.
    """
    if len(x) < 3:
        return math.nan, math.nan
    rx, ry = (average_ranks(torch.tensor(v, dtype=torch.float64)) for v in (x, y))
    rho = pearson(rx, ry)
    # Every resample at once: row r is y's ranks in a random order.
    generator = torch.Generator().manual_seed(seed)
    shuffled = ry[torch.rand(resamples, len(ry), generator=generator).argsort(dim=1)]
    cx, cy = rx - rx.mean(), shuffled - shuffled.mean(dim=1, keepdim=True)
    rhos = (cy @ cx) / torch.sqrt((cx * cx).sum() * (cy * cy).sum(dim=1))
    extreme = int((rhos.abs() >= abs(rho) - 1e-12).sum())
    return rho, (extreme + 1) / (resamples + 1)


def _fmt(value: float, digits: int = 3) -> str:
    return "–" if not math.isfinite(value) else f"{value:.{digits}f}"


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
        per_seed = "; ".join(f"seed {r.seed}: {_fmt(r.paired_ratio)} [{_fmt(r.paired_ci_low)}, "
                             f"{_fmt(r.paired_ci_high)}]" + (f" over {_fmt(100 * r.endpoint_coverage, 0)}% of the "
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
                               f"runs." + (f" Pooled over the seeds: {_fmt(baseline.pooled['ratio'])} "
                                           f"[{_fmt(baseline.pooled['ci_low'])}, {_fmt(baseline.pooled['ci_high'])}] "
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
        per_method = ", ".join(f"{m.method} {_fmt(m.mean['sign_agreement_flow'], 2)}" for m in methods.values())
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
                               f"observed entropy change in {_fmt(cov)} of steps, the flow's in {_fmt(flow)}; "
                               f"entropy fell in {_fmt(negative)} of them, so always forecasting the commoner sign "
                               f"scores {_fmt(bar)}. Balanced over rises and falls (a constant forecast scores "
                               f"0.5): −covariance {_fmt(balanced['cov'])}, flow {_fmt(balanced['flow'])}; Pearson r "
                               f"of prediction and observation: {_fmt(correlation['cov'], 2)} and "
                               f"{_fmt(correlation['flow'], 2)}. At the checkpoint scale (changes summed over "
                               f"{len(blocks)} blocks of {study.report.block} rollout steps): −covariance "
                               f"{_fmt(block['cov'])}, flow {_fmt(block['flow'])}, commoner sign "
                               f"{_fmt(block['majority'])}; Pearson r {_fmt(block_pearson['cov'], 2)} and "
                               f"{_fmt(block_pearson['flow'], 2)}, Spearman ρ {_fmt(block_spearman['cov'], 2)} and "
                               f"{_fmt(block_spearman['flow'], 2)}. Flow sign agreement per method (mean over "
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
            parts.append(f"{keeper.method} {_fmt(keeper.mean['final_entropy'])} ± {_fmt(keeper.sd['final_entropy'])} "
                         f"({_fmt(ratio, 2)}× {study.report.baseline}; above it in "
                         f"{sum(k > b for k, b in paired)} of {len(paired)} seeds)")
        verdict = verdicts[0] if len(set(verdicts)) == 1 else "partly"
        result["c"] = {"verdict": verdict, "ratios": ratios,
                       "text": f"Final entropy (mean of the last {study.report.late_window} rollout steps): "
                               f"{study.report.baseline} {_fmt(baseline.mean['final_entropy'])} ± "
                               f"{_fmt(baseline.sd['final_entropy'])}; " + "; ".join(parts)
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
                   f"{_fmt(rho_kept, 2)} over {len(kept)} methods (p = {_fmt(p_kept, 3)})." if broken else "")
        result["d"] = {"verdict": "no relation detected" if p >= 0.05 else "not reproduced", "rho": rho, "p": p,
                       "rho_ci_low": low, "rho_ci_high": high, "methods": len(ranked), "left_out": broken,
                       "rho_without_left_out": rho_kept, "p_without_left_out": p_kept,
                       "text": f"Spearman ρ between mean final entropy and mean held-out accuracy over {len(ranked)} "
                               f"methods: {_fmt(rho, 2)} (95% bootstrap CI over methods [{_fmt(low, 2)}, "
                               f"{_fmt(high, 2)}], permutation p = {_fmt(p, 3)}); a p ≥ 0.05 finds no monotone "
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
                               f"{study.report.baseline}: a = {_fmt(base_fit['a'])}, b = {_fmt(base_fit['b'])}, "
                               f"R² = {_fmt(base_fit['r2'], 2)} over {int(base_fit['n'])} points; predicted accuracy "
                               f"at H = 0: {_fmt(base_fit['ceiling'])}. Rule: a > 0 and R² ≥ {FIT_R2}. Every "
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
        parts = [f"seed {seed}: failed {_fmt(c[f'{stage}/failed'], 4)}, successful {_fmt(c[f'{stage}/successful'], 4)} "
                 f"per token (contributions {_fmt(c[f'{stage}/failed_contribution'], 4)}, "
                 f"{_fmt(c[f'{stage}/successful_contribution'], 4)}; {int(c[f'{stage}/steps'])} measured steps)"
                 for seed, c in change.items() if c[f"{stage}/steps"] > 0]
        return "; ".join(parts) if parts else "no run reached it"

    ablation = []
    base_accuracy, base_entropy = baseline.mean["accuracy"], baseline.mean["final_entropy"]
    for method in study.report.polarity_ablation:
        if method in methods:
            m = methods[method]
            ablation.append(f"{method} held-out {_fmt(m.mean['accuracy'])} ± {_fmt(m.sd['accuracy'])} "
                            f"(baseline {_fmt(base_accuracy)}), final entropy {_fmt(m.mean['final_entropy'])} "
                            f"({_fmt(m.mean['final_entropy'] / base_entropy, 2)}× the baseline's)")
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


def _spearman(x: Sequence[float], y: Sequence[float]) -> float:
    return spearman(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64))


def _rho_interval(x: Sequence[float], y: Sequence[float], resamples: int = 2000, seed: int = 0,
                  confidence: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of Spearman's ρ, resampling the (x, y) pairs (methods) with replacement."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(len(x), (resamples, len(x)), generator=generator)
    rhos = [_spearman([x[i] for i in rows], [y[i] for i in rows]) for rows in draws.tolist()]
    finite = torch.tensor([r for r in rhos if math.isfinite(r)], dtype=torch.float64)
    if finite.numel() == 0:
        return math.nan, math.nan
    tail = (1 - confidence) / 2
    return finite.quantile(tail).item(), finite.quantile(1 - tail).item()


def tradeoff_table(findings_e: dict[str, Any]) -> str:
    """Finding (e)'s per-method fits of ``R = −a·exp(H) + b`` as a markdown table."""
    lines = ["| method | a | b | R² | accuracy at H = 0 | points |", "|---|---|---|---|---|---|"]
    for method, fit in findings_e.get("fits", {}).items():
        lines.append(f"| {method} | {_fmt(fit['a'])} | {_fmt(fit['b'])} | {_fmt(fit['r2'], 2)} "
                     f"| {_fmt(fit['ceiling'])} | {int(fit['n'])} |")
    return "\n".join(lines)


# -- figures --------------------------------------------------------------------------------------------------
def _colours(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return [cmap(i % 20) for i in range(n)]


def _mean_curve(runs: list[RunSummary], attribute: str) -> tuple[list[int], list[float]]:
    """Mean over seeds at the steps every run logged."""
    series = [dict(getattr(r, attribute)) for r in runs]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    return steps, [statistics.fmean(s[t] for s in series) for t in steps]


def trajectories_figure(methods: dict[str, MethodSummary], smooth: int = 20) -> Figure:
    """Token entropy (moving average, mean over seeds) and held-out accuracy (mean over seeds) per method."""
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    for colour, summary in zip(_colours(len(methods)), methods.values()):
        steps, values = _mean_curve(summary.runs, "entropy")
        left.plot(steps, trailing_mean(values, smooth), color=colour, lw=1.2, label=summary.method)
        steps, values = _mean_curve(summary.runs, "val_accuracy")
        right.plot(steps, values, color=colour, marker="o", ms=3, lw=1.2, label=summary.method)
    left.set(xlabel="rollout step", ylabel="token entropy (nats)", title=f"Entropy ({smooth}-step mean, seed mean)")
    right.set(xlabel="rollout step", ylabel="held-out greedy accuracy", title="Held-out accuracy (seed mean)")
    right.legend(fontsize=7, ncols=2, loc="lower right")
    return fig


def entropy_change_scatter(methods: dict[str, MethodSummary]) -> Figure:
    """Predicted (−covariance, flow) vs observed per-step entropy change, every probed step of every run."""
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    pooled = [p for m in methods.values() for r in m.runs for p in r.probe]
    observed = [o for _, _, o in pooled]
    for index, (ax, name) in enumerate(zip(axes, ("−covariance", "flow"))):
        for colour, summary in zip(_colours(len(methods)), methods.values()):
            points = [p for r in summary.runs for p in r.probe]
            ax.scatter([p[index] for p in points], [p[2] for p in points], s=4, alpha=0.4, color=colour,
                       label=summary.method)
        ax.axhline(0, color="grey", lw=0.8)
        ax.axvline(0, color="grey", lw=0.8)
        agreement = _sign_agreement([p[index] for p in pooled], observed)
        ax.set(xlabel=f"predicted ({name})", ylabel="observed ΔH per step",
               title=f"{name}: sign agreement {_fmt(agreement, 2)} (majority sign {_fmt(_majority_rate(observed), 2)})")
    axes[1].legend(fontsize=7, ncols=2, markerscale=3)
    return fig


def paired_ratio_figure(methods: dict[str, MethodSummary]) -> Figure:
    """Last-window paired failed/successful entropy ratio per run, with its bootstrap CI, by method."""
    fig = Figure(figsize=(12, 3.8), layout="constrained")
    ax = fig.subplots()
    names = list(methods)
    for i, summary in enumerate(methods.values()):
        for j, run in enumerate(summary.runs):
            x = i + (j - (len(summary.runs) - 1) / 2) * 0.15
            if math.isfinite(run.paired_ratio):
                ax.errorbar([x], [run.paired_ratio], yerr=[[max(run.paired_ratio - run.paired_ci_low, 0)],
                                                           [max(run.paired_ci_high - run.paired_ratio, 0)]],
                            fmt="o", ms=3, capsize=2, color="tab:purple")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set(ylabel="failed / successful entropy", title="Paired ratio, last window, one point per seed (95% CI)")
    return fig


# -- markdown -----------------------------------------------------------------------------------------------
def _cell(summary: MethodSummary, key: str) -> str:
    return f"{_fmt(summary.mean[key])} ± {_fmt(summary.sd[key])}"


def _transitions(summary: MethodSummary) -> str:
    return ", ".join("–" if not math.isfinite(t) else str(int(t)) for t in summary.transitions)


def method_overrides(study: StudyConfig) -> dict[str, list[str] | None]:
    """Per method, where the study's run differs from its own config, ``<report.method_configs>/<name>.yaml`` with
    ``name`` the method's ``report.config_of`` entry or the method itself (``None``: no such file); empty without
    ``report.method_configs``. A comparison with another method's config starts with ``vs <name>.yaml:``."""
    import yaml

    if study.report.method_configs is None:
        return {}
    shared = tuple(callback_arguments(study.base))
    out: dict[str, list[str] | None] = {}
    for method in study.methods:
        name = study.report.config_of.get(method, method)
        path = Path(study.report.method_configs) / f"{name}.yaml"
        if not path.is_file():
            out[method] = None
            continue
        differences = config_overrides(yaml.safe_load(path.read_text(encoding="utf-8")), study.method_config(method),
                                       shared)
        out[method] = differences if name == method else [f"vs {name}.yaml:", *differences]
    return out


def markdown_table(study: StudyConfig, methods: dict[str, MethodSummary]) -> str:
    """The per-method table: mean ± sd over seeds (n = seeds that finished), and, with ``report.method_configs``,
    every setting in which the study's run differs from the method's own config."""
    overrides = method_overrides(study)
    header = ("| method | n | held-out acc | pass@k | maj@k | answer-coverage retention | effective-mode ratio "
              "| final entropy | vs baseline | paired ratio [CI] | CI > 1 | flow sign agr. | stage transition |")
    if overrides:
        header += f" differs from {study.report.method_configs}/<method>.yaml |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    base = methods.get(study.report.baseline)
    for summary in methods.values():
        vs = summary.mean["final_entropy"] / base.mean["final_entropy"] if base else math.nan
        lines.append(
            f"| {summary.method} | {len(summary.runs)} | {_cell(summary, 'accuracy')} | {_cell(summary, 'pass_at_k')} "
            f"| {_cell(summary, 'maj_at_k')} | {_cell(summary, 'retention')} "
            f"| {_cell(summary, 'effective_mode_ratio')} | {_cell(summary, 'final_entropy')} "
            f"| {_fmt(vs, 2)}× | {_paired_cell(summary)} | {summary.seeds_ci_above_one}/{len(summary.runs)} "
            f"| {_fmt(summary.mean['sign_agreement_flow'], 2)} | {_transitions(summary)} |"
            + (f" {_override_cell(overrides.get(summary.method))} |" if overrides else ""))
    return "\n".join(lines)


def _paired_cell(summary: MethodSummary) -> str:
    """The pooled ratio with its question-bootstrap interval; without saved rows, the mean over seeds of each run's
    ratio and bounds, marked ``*`` (a summary of intervals, not an interval)."""
    if summary.pooled:
        p = summary.pooled
        return f"{_fmt(p['ratio'], 2)} [{_fmt(p['ci_low'], 2)}, {_fmt(p['ci_high'], 2)}]"
    m = summary.mean
    return f"{_fmt(m['paired_ratio'], 2)} [{_fmt(m['paired_ci_low'], 2)}, {_fmt(m['paired_ci_high'], 2)}]*"


def _override_cell(overrides: list[str] | None) -> str:
    if overrides is None:
        return "no config of its own"
    cells = [o.replace("|", "\\|") for o in overrides]
    prefix = cells.pop(0) + " " if cells and cells[0].startswith("vs ") else ""
    return prefix + ("; ".join(cells) or "nothing")


_FIGURES = {"trajectories": trajectories_figure, "entropy_change": entropy_change_scatter,
            "paired_ratio": paired_ratio_figure}


def build_report(study: StudyConfig, log_to_mlflow: bool = True) -> dict[str, Any]:
    """Write ``report.md``, ``summary.json`` and the figures to ``output_dir``; log them to an MLflow run.

    Returns:
        The summary written to ``summary.json``: per method the means, sds and per-run numbers, and the findings.
    """
    folder = Path(study.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    methods = read_study(study)
    missing = [study.run_name(m, s) for m, s in study.grid() if m not in methods
               or s not in {r.seed for r in methods[m].runs}]
    result = findings(study, methods)
    summary = {"study": study.name, "experiment": study.experiment, "tracking_uri": study.tracking_uri,
               "seeds": list(study.seeds), "missing_runs": missing, "overrides": method_overrides(study),
               "methods": {m: {"mean": s.mean, "sd": s.sd, "pooled_paired_ratio": s.pooled,
                               "runs": [r.numbers() for r in s.runs]}
                           for m, s in methods.items()},
               "findings": result}
    (folder / "summary.json").write_text(json.dumps(summary, indent=1, default=float), encoding="utf-8")
    figures = {name: make(methods) for name, make in _FIGURES.items()} if methods else {}
    for name, fig in figures.items():
        fig.savefig(folder / f"{name}.png", dpi=110)
    titles = {"a": "Failed responses carry higher token entropy than successful ones",
              "b": "The covariance / flow approximation predicts the sign of the entropy change",
              "c": "Clip-Cov / KL-Cov keep entropy far above the baseline late in training",
              "d": "Entropy alone does not order the methods by accuracy",
              "e": "Performance is traded from entropy as R = −a·exp(H) + b",
              "f": "In the rising stage, the entropy reduction is on the negative (failed) samples"}
    estimators = {r.paired_estimator for s in methods.values() for r in s.runs}
    if estimators == {"endpoint"}:
        paired_text = ("the seed paper's endpoint estimator at the last probe (fresh samples of the probe questions, "
                       "only questions with enough samples of each outcome)")
    elif estimators <= {"rolling"}:
        paired_text = "the last RCEA window's rolling common-question ratio over training rollouts"
    else:
        paired_text = "the endpoint estimator where a run logged it, else the rolling one"
    lines = [f"# Study `{study.name}`", "",
             (f"{len(methods)} methods × seeds {list(study.seeds)}, from `{study.source}`; MLflow experiment "
              f"`{study.experiment}` at `{study.tracking_uri}`. Mean ± sd over seeds; held-out numbers from the "
              f"last evaluation; final entropy = mean token entropy of the last {study.report.late_window} rollout "
              f"steps; answer-coverage retention = share of the starting policy's correct answers per probe question "
              f"still produced (at most 1); effective-mode ratio = the seed paper's rarefied effective-mode "
              f"retention as we read it (`rcea/effective_mode_ratio`: exp-entropy counts of correct-solution modes "
              f"at a fixed number of correct samples, end over start; can exceed 1); paired ratio = {paired_text}, "
              f"failed/successful token entropy: the geometric mean over the paired questions of all seeds with a "
              f"95% bootstrap interval over questions ({POOLED_RESAMPLES} resamples, each question bringing its "
              f"ratios of every seed), or, marked *, the mean over seeds of each run's ratio and CI bounds where no "
              f"per-question rows were saved; \"CI > 1\" = seeds whose own CI lies above 1; stage transition = "
              f"the step per seed (– = none)."), ""]
    if missing:
        lines += [f"**Not finished ({len(missing)}):** {', '.join(missing)}", ""]
    lines += [markdown_table(study, methods), ""]
    lambdas = {m: s.runs for m, s in methods.items() if any(math.isfinite(r.opefo_lambda) for r in s.runs)}
    for method, runs in lambdas.items():
        lines += [f"{method}'s balancing coefficient λ* (mean of `opefo/lambda` over each run): "
                  + ", ".join(f"seed {r.seed} {_fmt(r.opefo_lambda, 4)}" for r in runs) + ".", ""]
    lines += ["## Findings", ""]
    for key, title in titles.items():
        lines += [f"**({key}) {title}: {result[key]['verdict']}.** {result[key]['text']}", ""]
    lines += [tradeoff_table(result["e"]), ""]
    lines += ["## Figures", ""] + [f"![{name}]({name}.png)" for name in figures] + [""]
    lines += ["## Runs", "", "| run | MLflow run id |", "|---|---|"]
    lines += [f"| {study.run_name(r.method, r.seed)} | `{r.run_id}` |" for s in methods.values() for r in s.runs]
    (folder / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    if log_to_mlflow and methods:
        _log_report(study, folder, figures)
    return summary


def _log_report(study: StudyConfig, folder: Path, figures: dict[str, Figure]) -> None:
    """Log the report to one MLflow run of the experiment (tag ``study.report``), reused by later reports."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=study.tracking_uri)
    experiment_id = client.get_experiment_by_name(study.experiment).experiment_id
    existing = client.search_runs([experiment_id], filter_string=f"tags.`study.report` = '{study.name}'", max_results=1)
    if existing:
        run_id = existing[0].info.run_id
    else:
        run_id = client.create_run(experiment_id, run_name="report", tags={"study.report": study.name}).info.run_id
    for name in ("report.md", "summary.json", *(f"{n}.png" for n in figures)):
        client.log_artifact(run_id, str(folder / name))
    client.set_terminated(run_id, "FINISHED")
