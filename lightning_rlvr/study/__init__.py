"""Studies: a grid of methods x seeds, each a ``lightning_rlvr fit`` logged to one MLflow experiment, and a report.

    python -m lightning_rlvr.study --config configs/study.yaml

See :mod:`lightning_rlvr.study.config` for the study file, :mod:`~lightning_rlvr.study.runner` for how runs are
launched and resumed, and :mod:`~lightning_rlvr.study.report` for what the report computes.
"""

from lightning_rlvr.study.config import ReportSettings, StudyConfig, StudyConfigError, load_study
from lightning_rlvr.study.report import build_report
from lightning_rlvr.study.runner import RunOutcome, finished_runs, run_study, validate_runs

__all__ = ["ReportSettings", "RunOutcome", "StudyConfig", "StudyConfigError", "build_report", "finished_runs",
           "load_study", "run_study", "validate_runs"]
