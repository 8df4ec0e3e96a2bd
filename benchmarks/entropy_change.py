"""How well does first-order theory predict each update's entropy change? And what does measuring it cost?

Runs the quickstart setting (`a+b=`, 200 warm-start steps on 5%, GRPO lr 3e-4, 16 prompts x 8, one update
per rollout) twice in one process with the same seed: once plain (the baseline), once with
:class:`~lightning_rlvr.callbacks.EntropyChangeProbe` measuring every ``--probe-every`` steps. The probe
only observes, so both runs must end with the same held-out accuracy (checked and printed).

    python benchmarks/entropy_change.py                      # full quickstart, ~2 x 3 min on 2 cores
    python benchmarks/entropy_change.py --steps 600 --probe-every 5

Prints: the share of measured steps where the sign of the predicted change matches the observed one,
for the first-order flow (E3) and the covariance (2505.22617), over the whole run and in thirds of it, with
the score of a constant "entropy goes down" forecast as the bar, and the same over sums of ``--block``
consecutive steps (a checkpoint-to-checkpoint view);
Pearson / Spearman correlation of each prediction with the observed change over all measured steps; the
fitted effective step size; the same sign agreement within successful and within failed responses; the
token-level sign agreement; and the probe's cost: seconds per measured step (its own timer) and the
run's wall time per rollout step against the baseline's (ratio).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import lightning.pytorch as pl
import torch

from lightning_rlvr import RLVRModule
from lightning_rlvr.callbacks import EntropyChangeProbe, SupervisedWarmStart
from lightning_rlvr.loggers import InMemoryLogger
from lightning_rlvr.metrics.entropy_change import fitted_step_size, pearson, sign_agreement, spearman

from _setting import addition_data, quiet_trainer  # benchmarks/_setting.py (the script's folder is on sys.path)


def run(args: argparse.Namespace, probe: bool) -> tuple[dict, float, float]:
    pl.seed_everything(args.seed, verbose=False)
    logger = InMemoryLogger()
    callbacks = [SupervisedWarmStart(steps=200, batch_size=64, learning_rate=1e-3)]
    if probe:
        callbacks.append(EntropyChangeProbe(every_n_steps=args.probe_every, sample_rows=args.sample_rows))
    start = time.perf_counter()
    quiet_trainer(args.steps, args.steps, logger, callbacks).fit(RLVRModule(learning_rate=3e-4), addition_data())
    seconds = time.perf_counter() - start
    accuracy = logger.history["val/accuracy"]
    return logger.history, seconds, accuracy[max(accuracy)]


def series(history: dict, key: str, steps: list[int]) -> torch.Tensor:
    return torch.tensor([history[key][s] for s in steps], dtype=torch.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4500, help="rollout steps")
    parser.add_argument("--probe-every", type=int, default=1)
    parser.add_argument("--sample-rows", type=int, default=64, help="rows recomputed after each measured update")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block", type=int, default=50, help="measured steps per block (checkpoint-to-checkpoint view)")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))

    _, base_seconds, base_accuracy = run(args, probe=False)
    h, probe_seconds, accuracy = run(args, probe=True)
    steps = sorted(h["probe/observed"])
    observed = series(h, "probe/observed", steps)
    flow, cov = series(h, "probe/flow_pred", steps), -series(h, "probe/cov_pred", steps)

    print(f"\nquickstart setting, {args.steps} rollout steps, seed {args.seed}; probe every {args.probe_every} "
          f"step(s) on {args.sample_rows} rows: {len(steps)} measured steps")
    print(f"held-out accuracy: baseline {base_accuracy:.3f}, with probe {accuracy:.3f} (the probe only observes)")
    thirds = [range(i * len(steps) // 3, (i + 1) * len(steps) // 3) for i in range(3)]
    for name, predicted in (("flow (E3)", flow), ("-covariance", cov)):
        parts = ", ".join(f"{sign_agreement(predicted[list(t)], observed[list(t)]):.3f}" for t in thirds)
        print(f"{name:<12} sign agreement {sign_agreement(predicted, observed):.3f} (thirds: {parts}), "
              f"Pearson {pearson(predicted, observed):.3f}, Spearman {spearman(predicted, observed):.3f}")
    print(f"a constant 'entropy goes down' forecast: sign agreement {(observed < 0).double().mean():.3f}")
    # Checkpoint-to-checkpoint granularity (2505.22617 / the RCEA paper compare adjacent checkpoints): sums over
    # consecutive blocks of measured steps.
    blocks = len(steps) // args.block
    if blocks >= 2:
        def block_sums(values: torch.Tensor) -> torch.Tensor:
            return values[: blocks * args.block].reshape(blocks, args.block).sum(-1)

        seen = block_sums(observed)
        print(f"over {blocks} blocks of {args.block} measured steps: sign agreement flow "
              f"{sign_agreement(block_sums(flow), seen):.3f}, -covariance {sign_agreement(block_sums(cov), seen):.3f}, "
              f"constant 'down' {(seen < 0).double().mean():.3f}; Pearson flow {pearson(block_sums(flow), seen):.3f}, "
              f"-covariance {pearson(block_sums(cov), seen):.3f}")
    print(f"fitted effective step size (observed ≈ η·flow): {fitted_step_size(flow, observed):.3g}; "
          f"observed change mean {observed.mean().item():.2e}")
    for polarity in ("successful", "failed"):
        keep = [s for s in steps if math.isfinite(h[f"probe/{polarity}/flow_pred"][s])]
        p, o = series(h, f"probe/{polarity}/flow_pred", keep), series(h, f"probe/{polarity}/observed", keep)
        print(f"{polarity:<10} responses: flow sign agreement {sign_agreement(p, o):.3f}, Pearson {pearson(p, o):.3f}, "
              f"mean observed {o.mean().item():.2e} ({len(keep)} steps)")
    def finite_mean(key: str) -> float:  # nan on steps where every group had zero advantage
        values = [v for v in (h[key][s] for s in steps) if math.isfinite(v)]
        return statistics.fmean(values) if values else math.nan

    token, token_r = finite_mean("probe/token_sign_agreement"), finite_mean("probe/token_pearson")
    print(f"token level (tokens with a nonzero prediction): sign agreement {token:.3f}, Pearson {token_r:.3f} "
          f"(mean over steps)")
    own = statistics.fmean(h["probe/seconds"][s] for s in steps)
    per_step_base, per_step_probe = base_seconds / args.steps, probe_seconds / args.steps
    print(f"cost: probe {own * 1e3:.1f} ms per measured step; run {per_step_probe * 1e3:.1f} vs "
          f"{per_step_base * 1e3:.1f} ms per rollout step without it ({per_step_probe / per_step_base:.2f}x)")


if __name__ == "__main__":
    main()
