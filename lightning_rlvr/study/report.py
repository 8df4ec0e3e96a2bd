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

import json
import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from lightning_rlvr.study.config import StudyConfig, callback_arguments, config_overrides
from lightning_rlvr.study.figures import entropy_change_scatter, paired_ratio_figure, trajectories_figure
from lightning_rlvr.study.findings import findings, tradeoff_table
from lightning_rlvr.study.summaries import (  # noqa: F401  (re-exported: the report's public names)
    FAR_ABOVE,
    POOLED_RESAMPLES,
    MethodSummary,
    RunSummary,
    fmt,
    polarity_change,
    pooled_paired_ratio,
    read_study,
    spearman_permutation,
    summarise_run,
)

__all__ = ["MethodSummary", "RunSummary", "build_report", "findings", "polarity_change", "pooled_paired_ratio",
           "spearman_permutation", "summarise_run", "tradeoff_table"]


def _cell(summary: MethodSummary, key: str) -> str:
    return f"{fmt(summary.mean[key])} ± {fmt(summary.sd[key])}"


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
            f"| {fmt(vs, 2)}× | {_paired_cell(summary)} | {summary.seeds_ci_above_one}/{len(summary.runs)} "
            f"| {fmt(summary.mean['sign_agreement_flow'], 2)} | {_transitions(summary)} |"
            + (f" {_override_cell(overrides.get(summary.method))} |" if overrides else ""))
    return "\n".join(lines)


def _paired_cell(summary: MethodSummary) -> str:
    """The pooled ratio with its question-bootstrap interval; without saved rows, the mean over seeds of each run's
    ratio and bounds, marked ``*`` (a summary of intervals, not an interval)."""
    if summary.pooled:
        p = summary.pooled
        return f"{fmt(p['ratio'], 2)} [{fmt(p['ci_low'], 2)}, {fmt(p['ci_high'], 2)}]"
    m = summary.mean
    return f"{fmt(m['paired_ratio'], 2)} [{fmt(m['paired_ci_low'], 2)}, {fmt(m['paired_ci_high'], 2)}]*"


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
                  + ", ".join(f"seed {r.seed} {fmt(r.opefo_lambda, 4)}" for r in runs) + ".", ""]
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
