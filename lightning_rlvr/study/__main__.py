"""``python -m lightning_rlvr.study --config configs/study.yaml`` (also the ``lightning_rlvr_study`` command).

Runs every (method, seed) of the study that has no finished MLflow run yet, then writes the report to the
study's ``output_dir`` (``report.md``, ``summary.json``, PNG figures) and logs it to MLflow. Exit status 0
when every run finished, 1 when some failed (the report still covers the ones that finished; their logs are
named), 2 for a study file that cannot run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from lightning_rlvr.study.config import StudyConfigError, load_study
from lightning_rlvr.study.report import build_report
from lightning_rlvr.study.runner import run_study


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_rlvr.study", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the study YAML (e.g. configs/study.yaml)")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from MLflow, train nothing")
    parser.add_argument("--workers", type=int, default=None, help="override the study's `workers`")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        study = load_study(args.config)
        if args.workers is not None:
            if args.workers < 1:
                raise StudyConfigError(f"--workers must be >= 1, got {args.workers}")
            study = dataclasses.replace(study, workers=args.workers)
        outcomes = [] if args.report_only else run_study(study, progress=not args.no_progress)
    except StudyConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    failed = [o for o in outcomes if o.status == "failed"]
    for outcome in failed:
        print(f"run {study.run_name(outcome.method, outcome.seed)} failed: {outcome.error}", file=sys.stderr)
    if outcomes:
        counts = {s: sum(o.status == s for o in outcomes) for s in ("finished", "skipped", "failed")}
        print(f"study {study.name}: {counts['finished']} run(s) trained, {counts['skipped']} already finished, "
              f"{counts['failed']} failed")
    build_report(study)
    print(f"report: {study.output_dir}/report.md (also logged to MLflow experiment `{study.experiment}`)")
    return 1 if failed else 0


def console() -> None:
    """Entry point of the ``lightning_rlvr_study`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    console()
