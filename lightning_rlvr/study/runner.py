"""Run a study's grid of methods x seeds, each a ``lightning_rlvr fit`` in its own process, resumably.

Each run's resolved config is written to ``<output_dir>/runs/<method>-seed<seed>.yaml`` and started as
``python -m lightning_rlvr fit --config <that file>`` (so any run can be repeated by hand), with its output
in ``<output_dir>/logs/``. ``workers`` runs go at once, each with ``threads_per_run`` torch threads.

Resuming: a run is skipped when its MLflow experiment already holds a *finished* run with the same study
name, method, seed and config hash (the hash of the method's merged config, so editing a method's settings
reruns it and only it). Runs that crashed or were interrupted are rerun from the start.

Before anything trains, every method's config goes through the ``lightning_rlvr`` parser, so an unknown key
or a wrong type fails the study at once, naming the method, rather than after the runs before it.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from lightning_rlvr.study.config import StudyConfig, StudyConfigError

__all__ = ["RunOutcome", "finished_runs", "run_study", "validate_runs"]

_LOG_TAIL_LINES = 25


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """What became of one (method, seed) of the grid: ``status`` is "skipped", "finished" or "failed"."""

    method: str
    seed: int
    status: str
    seconds: float = 0.0
    log_path: str = ""
    error: str = ""


def _parser_error(text: str) -> str:
    """The parser's complaint without the usage block that precedes it."""
    index = text.find("error:")
    return text[index:].strip() if index >= 0 else text.strip()


def validate_runs(study: StudyConfig) -> None:
    """Parse every method's run config with the ``lightning_rlvr fit`` parser (no training, ~0.2 s each).

    Raises:
        StudyConfigError: naming the method and quoting the parser (unknown key, wrong type, bad class path).
    """
    from lightning_rlvr.cli import main

    with tempfile.TemporaryDirectory() as folder:
        for method in study.methods:
            path = Path(folder) / f"{method}.yaml"
            path.write_text(yaml.safe_dump(study.run_config(method, study.seeds[0]), sort_keys=False))
            out, err = io.StringIO(), io.StringIO()
            # LightningCLI warns when both ``args`` and a command line are present; the study's own argv is not
            # meant for it.
            argv, sys.argv = sys.argv, sys.argv[:1]
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    main(["fit", "--config", str(path), "--print_config"])
            except SystemExit as exit_info:
                if exit_info.code not in (0, None):
                    raise StudyConfigError(f"{study.source}: method `{method}` (base merged with its keys) is not a "
                                           f"valid fit config: {_parser_error(err.getvalue())}") from None
            finally:
                sys.argv = argv


def _mlflow_client(study: StudyConfig):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=study.tracking_uri)


def _experiment_id(study: StudyConfig, create: bool) -> str | None:
    client = _mlflow_client(study)
    experiment = client.get_experiment_by_name(study.experiment)
    if experiment is not None:
        return experiment.experiment_id
    # Created here, before any run starts: parallel runs would otherwise race to create it (and the database).
    return client.create_experiment(study.experiment) if create else None


def study_runs(study: StudyConfig, status: str | None = "FINISHED") -> list:
    """The MLflow runs of this study (any method, seed or config hash), newest first; ``status=None`` = all."""
    experiment_id = _experiment_id(study, create=False)
    if experiment_id is None:
        return []
    query = f"tags.study = '{study.name}'" + (f" and attributes.status = '{status}'" if status else "")
    return _mlflow_client(study).search_runs([experiment_id], filter_string=query,
                                             order_by=["attributes.start_time DESC"], max_results=50_000)


def finished_runs(study: StudyConfig) -> dict[tuple[str, int], object]:
    """``{(method, seed): newest finished MLflow run}`` for runs whose config hash matches the study's today."""
    found: dict[tuple[str, int], object] = {}
    hashes = {method: study.config_hash(method) for method in study.methods}
    for run in study_runs(study):
        tags = run.data.tags
        method = tags.get("study.method")
        if method in hashes and tags.get("study.config_hash") == hashes[method]:
            found.setdefault((method, int(tags["study.seed"])), run)
    return found


def _run_one(study: StudyConfig, method: str, seed: int, folder: Path) -> RunOutcome:
    name = study.run_name(method, seed)
    config_path, log_path = folder / "runs" / f"{name}.yaml", folder / "logs" / f"{name}.log"
    config_path.write_text(yaml.safe_dump(study.run_config(method, seed), sort_keys=False))
    threads = str(study.threads_per_run)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        code = subprocess.run([sys.executable, "-m", "lightning_rlvr", "fit", "--config", str(config_path)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, check=False).returncode
    seconds = time.perf_counter() - start
    if code == 0:
        return RunOutcome(method, seed, "finished", seconds, str(log_path))
    tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-_LOG_TAIL_LINES:])
    return RunOutcome(method, seed, "failed", seconds, str(log_path),
                      f"exit code {code}; last lines of {log_path}:\n{tail}")


def run_study(study: StudyConfig, progress: bool = True) -> list[RunOutcome]:
    """Run every (method, seed) not finished yet; return one outcome per grid cell (grid order).

    A failed run does not stop the others; the caller decides what to do with failures
    (:func:`lightning_rlvr.study.__main__.main` reports them and exits 1 after writing the report).
    """
    from tqdm.auto import tqdm

    validate_runs(study)
    folder = Path(study.output_dir)
    (folder / "runs").mkdir(parents=True, exist_ok=True)
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    _experiment_id(study, create=True)
    done = finished_runs(study)
    grid = study.grid()
    outcomes = {cell: RunOutcome(*cell, "skipped") for cell in grid if cell in done}
    todo = [cell for cell in grid if cell not in done]
    bar = tqdm(total=len(grid), initial=len(outcomes), desc=f"study {study.name}", unit="run", disable=not progress,
               dynamic_ncols=True)
    failed = 0
    with cf.ThreadPoolExecutor(max_workers=study.workers) as pool:
        futures = {pool.submit(_run_one, study, method, seed, folder): (method, seed) for method, seed in todo}
        try:
            for future in cf.as_completed(futures):
                outcome = future.result()
                outcomes[futures[future]] = outcome
                failed += outcome.status == "failed"
                bar.set_postfix_str(f"last {study.run_name(outcome.method, outcome.seed)} {outcome.status} "
                                    f"in {outcome.seconds:.0f} s" + (f", {failed} failed" if failed else ""))
                bar.update()
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)  # the running children get the same SIGINT
            raise
    bar.close()
    return [outcomes[cell] for cell in grid]
