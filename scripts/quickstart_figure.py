"""Draw a run's held-out accuracy and entropy by outcome from its MLflow record (the README's figure).

    .venv/bin/python scripts/quickstart_figure.py                       # latest run of experiment "quickstart"
    .venv/bin/python scripts/quickstart_figure.py --experiment quickstart --out docs/quickstart.png

Reads ``val/accuracy``, ``entropy/failed`` and ``entropy/successful`` of the newest finished run of the experiment
(or ``--run-id``) from the tracking URI (default ``sqlite:///mlflow.db``, the CLI's), and writes a PNG.
"""

from __future__ import annotations

import argparse
import sys

from lightning_rlvr.plots import run_curves_figure


def _history(client, run_id: str, key: str) -> tuple[list[int], list[float]]:
    points = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
    if not points:
        raise SystemExit(f"run {run_id} has no metric {key!r}: is it a lightning_rlvr fit?")
    return [m.step for m in points], [m.value for m in points]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    parser.add_argument("--experiment", default="quickstart")
    parser.add_argument("--run-id", default=None, help="default: the experiment's newest finished run")
    parser.add_argument("--window", type=int, default=100, help="rollout steps of the entropy curves' trailing mean")
    parser.add_argument("--out", default="docs/quickstart.png")
    args = parser.parse_args(argv)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=args.tracking_uri)
    run_id = args.run_id
    if run_id is None:
        experiment = client.get_experiment_by_name(args.experiment)
        if experiment is None:
            raise SystemExit(f"no experiment {args.experiment!r} at {args.tracking_uri}")
        runs = client.search_runs([experiment.experiment_id], "attributes.status = 'FINISHED'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        if not runs:
            raise SystemExit(f"experiment {args.experiment!r} has no finished run")
        run_id = runs[0].info.run_id
    val_steps, accuracy = _history(client, run_id, "val/accuracy")
    steps, failed = _history(client, run_id, "entropy/failed")
    successful_steps, successful = _history(client, run_id, "entropy/successful")
    if successful_steps != steps:
        raise SystemExit("entropy/failed and entropy/successful were logged at different steps")
    run_curves_figure(val_steps, accuracy, steps, failed, successful, args.window).savefig(args.out, dpi=110)
    print(f"run {run_id}: {len(steps)} steps, held-out accuracy {accuracy[0]:.3f} -> {accuracy[-1]:.3f}; "
          f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main(sys.argv[1:])
