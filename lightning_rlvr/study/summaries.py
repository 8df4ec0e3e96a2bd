"""Per-run and per-method summaries of a study, read from its MLflow runs, and the statistics the findings use.

What each summary field is, and which logged metric it comes from, is listed in :mod:`lightning_rlvr.study.report`.
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

from lightning_rlvr.metrics.entropy_change import average_ranks, pearson, sign_agreement, spearman
from lightning_rlvr.metrics.rcea import bootstrap_ci
from lightning_rlvr.study.config import StudyConfig
from lightning_rlvr.study.runner import finished_runs

__all__ = ["FAR_ABOVE", "MethodSummary", "RunSummary", "polarity_change", "pooled_paired_ratio", "read_study",
           "spearman_permutation", "summarise_run",
           "fmt"]

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


def fmt(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` decimals for the report's tables and texts; "–" when it is not finite."""
    return "–" if not math.isfinite(value) else f"{value:.{digits}f}"
