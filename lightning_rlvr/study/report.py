"""The study report: read the study's finished MLflow runs, summarise per method over seeds, test the findings.

Everything in the report is computed from the MLflow runs (the metrics the runs logged), so the report
of a study can be rebuilt at any time (``--report-only``) and checked against ``mlflow ui``.

Per run (metric names as the callbacks log them):

- held-out accuracy, pass@k, maj@k: the last ``val/accuracy``, ``val/pass_at_k``, ``val/maj_at_k``;
- final entropy: mean ``entropy/token_mean`` over the last ``late_window`` rollout steps;
- mode retention: the last ``rcea/retention`` (share of the start's correct modes still found);
- failed/successful entropy: the last window's common-question paired ratio ``rcea/paired_ratio`` with its
  bootstrap CI (``rcea/paired_ci_low`` / ``_high``), and over all windows the share whose CI lies above 1;
- predicted vs observed entropy change: every ``probe/observed`` step with its ``probe/cov_pred`` (the
  prediction is ``−cov``) and ``probe/flow_pred``; sign agreement against the score of always forecasting
  the majority sign;
- stage transition: the last ``stage/transition_step`` (none when the detector never left "rising").

Per method: mean and sample standard deviation over seeds. The findings (a)-(d) of the issue are tested
with stated rules (:func:`findings`), so "reproduced" has one meaning across studies.
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

from lightning_rlvr.metrics.entropy_change import average_ranks, pearson, sign_agreement
from lightning_rlvr.study.config import StudyConfig
from lightning_rlvr.study.runner import finished_runs

__all__ = ["MethodSummary", "RunSummary", "build_report", "findings", "spearman_permutation", "summarise_run"]

_KEYS = ("val/accuracy", "val/pass_at_k", "val/maj_at_k", "entropy/token_mean", "rcea/retention",
         "rcea/paired_ratio", "rcea/paired_ci_low", "rcea/paired_ci_high", "probe/cov_pred", "probe/flow_pred",
         "probe/observed", "stage/transition_step")
#: "far above" in finding (c): the keeper's final entropy is at least this multiple of the baseline's in every seed.
FAR_ABOVE = 1.5

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
    entropy: Series = dataclasses.field(repr=False, default_factory=list)
    val_accuracy: Series = dataclasses.field(repr=False, default_factory=list)
    probe: list[tuple[float, float, float]] = dataclasses.field(repr=False, default_factory=list)
    probe_blocks: list[tuple[float, float, float]] = dataclasses.field(repr=False, default_factory=list)

    def numbers(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr}


def summarise_run(method: str, seed: int, run_id: str, history: dict[str, Series], late_window: int,
                  block: int = 100) -> RunSummary:
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
    return RunSummary(
        method=method, seed=seed, run_id=run_id,
        accuracy=_last(history.get("val/accuracy", [])), pass_at_k=_last(history.get("val/pass_at_k", [])),
        maj_at_k=_last(history.get("val/maj_at_k", [])), retention=_last(history.get("rcea/retention", [])),
        final_entropy=statistics.fmean(late) if late else math.nan,
        paired_ratio=_last(history.get("rcea/paired_ratio", [])),
        paired_ci_low=_last(history.get("rcea/paired_ci_low", [])),
        paired_ci_high=_last(history.get("rcea/paired_ci_high", [])),
        windows_above_one=sum(low.get(s, math.nan) > 1 for s in windows),
        windows_below_one=sum(high.get(s, math.nan) < 1 for s in windows), windows=len(windows),
        sign_agreement_flow=_sign_agreement([f for _, f, _ in probe], observed),
        sign_agreement_cov=_sign_agreement([c for c, _, _ in probe], observed),
        majority_rate=_majority_rate(observed),
        transition_step=_last(history.get("stage/transition_step", [])),
        entropy=entropy, val_accuracy=history.get("val/accuracy", []), probe=probe, probe_blocks=probe_blocks,
    )


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0


_AVERAGED = ("accuracy", "pass_at_k", "maj_at_k", "retention", "final_entropy", "paired_ratio", "paired_ci_low",
             "paired_ci_high", "sign_agreement_flow", "sign_agreement_cov")


@dataclasses.dataclass
class MethodSummary:
    """A method over its seeds: ``mean[key]`` and ``sd[key]`` for each averaged number, and the runs."""

    method: str
    runs: list[RunSummary]
    mean: dict[str, float]
    sd: dict[str, float]

    @classmethod
    def of(cls, method: str, runs: list[RunSummary]) -> MethodSummary:
        stats = {key: _mean_sd([getattr(r, key) for r in runs]) for key in _AVERAGED}
        return cls(method, runs, {k: m for k, (m, _) in stats.items()}, {k: s for k, (_, s) in stats.items()})

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


def read_study(study: StudyConfig) -> dict[str, MethodSummary]:
    """Every finished run of the study (current config hashes), summarised, grouped by method in study order."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=study.tracking_uri)
    runs = finished_runs(study)
    summaries: dict[str, MethodSummary] = {}
    for method in study.methods:
        found = [summarise_run(method, seed, runs[(method, seed)].info.run_id,
                               _history(client, runs[(method, seed)].info.run_id), study.report.late_window,
                               study.report.block)
                 for seed in study.seeds if (method, seed) in runs]
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

    - (a) failed responses carry higher entropy than successful ones: per run, the last window's
      common-question paired ratio; reproduced when every baseline run's bootstrap CI lies above 1,
      partly when some do.
    - (b) the covariance/flow approximation predicts the sign of the entropy change: pooled over all
      probed steps of all runs, per predictor, the sign agreement must beat the majority-sign forecast;
      reproduced when both predictors beat it, partly when one does. Reported beside it: the balanced sign
      agreement and the correlation (does a losing predictor still carry information?), and the agreement of
      changes summed over blocks of ``block`` rollout steps (the paper's adjacent-checkpoint scale).
    - (c) Clip-Cov/KL-Cov keep entropy far above the baseline late: a keeper's final entropy is at least
      :data:`FAR_ABOVE` × the baseline's in every seed; partly when merely above it in every seed.
    - (d) entropy alone does not order methods by accuracy: Spearman ρ between the methods' mean final
      entropy and mean held-out accuracy; reproduced when its permutation p-value is ≥ 0.05 (no
      detectable monotone relation), not reproduced otherwise.
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
        per_seed = "; ".join(f"seed {r.seed}: {_fmt(r.paired_ratio)} "
                             f"[{_fmt(r.paired_ci_low)}, {_fmt(r.paired_ci_high)}]" for r in runs)
        verdict = "reproduced" if above == len(runs) else "partly" if above else "not reproduced"
        result["a"] = {"verdict": verdict, "baseline_runs_above": above, "baseline_runs": len(runs),
                       "windows": all_windows, "windows_above": all_above, "windows_below": all_below,
                       "text": f"{study.report.baseline}, last window, paired failed/successful entropy ratio (95% "
                               f"bootstrap CI over questions): {per_seed}. CI above 1 in {above} of {len(runs)} "
                               f"runs. Over every window of every run of every method: {all_above} of "
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
        result["b"] = {"verdict": verdict, "steps": len(probe), "agreement_cov": cov, "agreement_flow": flow,
                       "majority_rate": bar, "balanced_cov": balanced["cov"], "balanced_flow": balanced["flow"],
                       "correlation_cov": correlation["cov"], "correlation_flow": correlation["flow"],
                       "blocks": len(blocks), "block_agreement_cov": block["cov"],
                       "block_agreement_flow": block["flow"], "block_majority_rate": block["majority"],
                       "text": f"Over {len(probe)} probed steps of all runs: the sign of −Cov(log π, A) matches the "
                               f"observed entropy change in {_fmt(cov)} of steps, the flow's in {_fmt(flow)}; "
                               f"entropy fell in {_fmt(negative)} of them, so always forecasting the commoner sign "
                               f"scores {_fmt(bar)}. Balanced over rises and falls (a constant forecast scores "
                               f"0.5): −covariance {_fmt(balanced['cov'])}, flow {_fmt(balanced['flow'])}; Pearson r "
                               f"of prediction and observation: {_fmt(correlation['cov'], 2)} and "
                               f"{_fmt(correlation['flow'], 2)}. At the checkpoint scale (changes summed over "
                               f"{len(blocks)} blocks of {study.report.block} rollout steps): −covariance "
                               f"{_fmt(block['cov'])}, flow {_fmt(block['flow'])}, commoner sign "
                               f"{_fmt(block['majority'])}. Flow sign agreement per method (mean over seeds): "
                               f"{per_method}."}

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
        rho, p = spearman_permutation([m.mean["final_entropy"] for m in ranked], [m.mean["accuracy"] for m in ranked])
        by_entropy = [m.method for m in sorted(ranked, key=lambda m: -m.mean["final_entropy"])]
        by_accuracy = [m.method for m in sorted(ranked, key=lambda m: -m.mean["accuracy"])]
        result["d"] = {"verdict": "reproduced" if p >= 0.05 else "not reproduced", "rho": rho, "p": p,
                       "methods": len(ranked),
                       "text": f"Spearman ρ between mean final entropy and mean held-out accuracy over {len(ranked)} "
                               f"methods: {_fmt(rho, 2)} (permutation p = {_fmt(p, 3)}). Highest entropy first: "
                               f"{', '.join(by_entropy)}. Highest accuracy first: {', '.join(by_accuracy)}."}
    return result


# -- figures --------------------------------------------------------------------------------------------------
def _colours(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return [cmap(i % 20) for i in range(n)]


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


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
        left.plot(steps, _smooth(values, smooth), color=colour, lw=1.2, label=summary.method)
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


def markdown_table(study: StudyConfig, methods: dict[str, MethodSummary]) -> str:
    """The per-method table: mean ± sd over seeds (n = seeds that finished)."""
    header = ("| method | n | held-out acc | pass@k | maj@k | mode retention | final entropy | vs baseline "
              "| paired ratio [CI] | CI > 1 | flow sign agr. | stage transition |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    base = methods.get(study.report.baseline)
    for summary in methods.values():
        vs = summary.mean["final_entropy"] / base.mean["final_entropy"] if base else math.nan
        lines.append(
            f"| {summary.method} | {len(summary.runs)} | {_cell(summary, 'accuracy')} | {_cell(summary, 'pass_at_k')} "
            f"| {_cell(summary, 'maj_at_k')} | {_cell(summary, 'retention')} | {_cell(summary, 'final_entropy')} "
            f"| {_fmt(vs, 2)}× | {_fmt(summary.mean['paired_ratio'], 2)} [{_fmt(summary.mean['paired_ci_low'], 2)}, "
            f"{_fmt(summary.mean['paired_ci_high'], 2)}] | {summary.seeds_ci_above_one}/{len(summary.runs)} "
            f"| {_fmt(summary.mean['sign_agreement_flow'], 2)} | {_transitions(summary)} |")
    return "\n".join(lines)


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
               "seeds": list(study.seeds), "missing_runs": missing,
               "methods": {m: {"mean": s.mean, "sd": s.sd, "runs": [r.numbers() for r in s.runs]}
                           for m, s in methods.items()},
               "findings": result}
    (folder / "summary.json").write_text(json.dumps(summary, indent=1, default=float), encoding="utf-8")
    figures = {name: make(methods) for name, make in _FIGURES.items()} if methods else {}
    for name, fig in figures.items():
        fig.savefig(folder / f"{name}.png", dpi=110)
    titles = {"a": "Failed responses carry higher token entropy than successful ones",
              "b": "The covariance / flow approximation predicts the sign of the entropy change",
              "c": "Clip-Cov / KL-Cov keep entropy far above the baseline late in training",
              "d": "Entropy alone does not order the methods by accuracy"}
    lines = [f"# Study `{study.name}`", "",
             (f"{len(methods)} methods × seeds {list(study.seeds)}, from `{study.source}`; MLflow experiment "
              f"`{study.experiment}` at `{study.tracking_uri}`. Mean ± sd over seeds; held-out numbers from the "
              f"last evaluation; final entropy = mean token entropy of the last {study.report.late_window} rollout "
              f"steps; paired ratio = last RCEA window's common-question failed/successful entropy ratio "
              f"(mean over seeds of the ratio and of its 95% bootstrap CI bounds), \"CI > 1\" = seeds whose CI "
              f"lies above 1; stage transition = the step per seed (– = none)."), ""]
    if missing:
        lines += [f"**Not finished ({len(missing)}):** {', '.join(missing)}", ""]
    lines += [markdown_table(study, methods), "", "## Findings", ""]
    for key, title in titles.items():
        lines += [f"**({key}) {title}: {result[key]['verdict']}.** {result[key]['text']}", ""]
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
