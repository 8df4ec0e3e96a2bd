"""Stage-aware shaping (arXiv 2508.02260) vs plain GRPO on the embedded task, over seeds.

Setting = the quickstart (`a+b=`, a, b in 0..49, 200 warm-start steps on 5% of the problems, GRPO lr 3e-4,
16 prompts x 8, one update per rollout). Methods (same trainer, only the callbacks differ):

- ``grpo``: no intervention (the StageDetector and the analysis callback still run: they only observe);
- ``stage_aware``: configs/stage_aware.yaml — PerplexityShaping + PositionShaping gated on the detected plateau;
- ``authors``: the authors' schedule — PerplexityShaping every step, PositionShaping in steps [200, 299).

    python benchmarks/stage_aware.py --seeds 0 1 2            # ~3 min per run on 2 cores
    python benchmarks/stage_aware.py --methods grpo --steps 600 --seeds 0
    python benchmarks/stage_aware.py --methods grpo --save-curves /tmp/curves   # per-step entropy/reward JSON,
                                                                                # to tune the detector offline

Prints per run the detected transition step (and when it was confirmed), the entropy and accuracy slopes
of the two stages, the entropy change of the update split by polarity in each stage (which samples carry
the entropy reduction), final token entropy, held-out greedy accuracy and pass@8; then mean ± sd over
seeds per method and the differences to GRPO.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import lightning.pytorch as pl
import torch

from lightning_rlvr import RLVRModule
from lightning_rlvr.callbacks import (
    EntropyPerformanceAnalysis,
    PerplexityShaping,
    PositionShaping,
    StageDetector,
    SupervisedWarmStart,
)
from lightning_rlvr.loggers import InMemoryLogger

from _setting import addition_data, quiet_trainer  # benchmarks/_setting.py (the script's folder is on sys.path)

METHODS = {
    "grpo": lambda: [],
    "stage_aware": lambda: [PerplexityShaping(active_in="plateau"),
                            PositionShaping(active_in="plateau", active_steps=None, active_fraction=None)],
    "authors": lambda: [PerplexityShaping(), PositionShaping(active_steps=(200, 299), active_fraction=None)],
}


def _mean(history: dict[int, float], steps) -> float:
    values = [history[s] for s in steps if s in history and math.isfinite(history[s])]
    return statistics.fmean(values) if values else math.nan


def run(method: str, seed: int, args: argparse.Namespace) -> dict[str, float]:
    pl.seed_everything(seed, verbose=False)
    logger = InMemoryLogger()
    detector = StageDetector()
    callbacks = [SupervisedWarmStart(steps=200, batch_size=64, learning_rate=1e-3), detector,
                 *METHODS[method](), EntropyPerformanceAnalysis(every_n_steps=args.analysis_every)]
    start = time.perf_counter()
    quiet_trainer(args.steps, args.steps, logger, callbacks).fit(RLVRModule(learning_rate=3e-4), addition_data())
    h = logger.history
    last = args.steps - 1
    split = detector.transition_step if detector.transition_step is not None else args.steps
    rising, plateau = range(0, split), range(split, args.steps)
    out = {
        "transition": detector.transition_step if detector.transition_step is not None else math.nan,
        "confirmed": detector.confirmed_step if detector.confirmed_step is not None else math.nan,
        "entropy": _mean(h["entropy/token_mean"], range(last - 49, last + 1)),
        "accuracy": h["val/accuracy"][max(h["val/accuracy"])],
        "pass_at_8": h["val/pass_at_k"][max(h["val/pass_at_k"])],
        "seconds": time.perf_counter() - start,
    }
    if args.save_curves:  # per-step curves, for tuning the detector offline on real runs
        with open(f"{args.save_curves}/{method}_seed{seed}.json", "w") as f:
            json.dump({k: {str(s): v for s, v in h[k].items()} for k in ("entropy/token_mean", "reward/mean")}, f)
    for name, steps in (("rising", rising), ("plateau", plateau)):
        out[f"entropy_slope_{name}"] = _mean(h["analysis/entropy_slope"], steps)
        out[f"accuracy_slope_{name}"] = _mean(h["analysis/accuracy_slope"], steps)
        for polarity in ("positive", "negative"):
            # per token (comparable across polarities) and as a share of the batch mean (grows with token share)
            out[f"dH_{polarity}_{name}"] = _mean(h[f"analysis/delta_entropy/{polarity}"], steps)
            out[f"dH_{polarity}_share_{name}"] = _mean(h[f"analysis/delta_entropy/{polarity}_contribution"], steps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["grpo", "stage_aware"], choices=sorted(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=4500, help="rollout steps")
    parser.add_argument("--analysis-every", type=int, default=10, help="steps between entropy-change measurements")
    parser.add_argument("--save-curves", metavar="DIR", help="write each run's per-step entropy and reward here")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))

    results = {m: [] for m in args.methods}
    for seed in args.seeds:  # alternate methods so slow drift of the machine hits all alike
        for method in args.methods:
            r = run(method, seed, args)
            results[method].append(r)
            print(f"{method:<12} seed {seed}: transition {r['transition']} (confirmed {r['confirmed']}), "
                  f"H {r['entropy']:.3f}, held-out {r['accuracy']:.3f}, pass@8 {r['pass_at_8']:.3f}, "
                  f"slopes rising H {r['entropy_slope_rising']:.2e} acc {r['accuracy_slope_rising']:.2e} / "
                  f"plateau H {r['entropy_slope_plateau']:.2e} acc {r['accuracy_slope_plateau']:.2e}, "
                  f"dH per token (successful, failed) rising {r['dH_positive_rising']:.2e}, "
                  f"{r['dH_negative_rising']:.2e} / plateau {r['dH_positive_plateau']:.2e}, "
                  f"{r['dH_negative_plateau']:.2e}, as contributions rising {r['dH_positive_share_rising']:.2e}, "
                  f"{r['dH_negative_share_rising']:.2e} / plateau {r['dH_positive_share_plateau']:.2e}, "
                  f"{r['dH_negative_share_plateau']:.2e}, "
                  f"{r['seconds']:.0f} s", flush=True)

    def stat(runs: list[dict], key: str) -> str:
        values = [r[key] for r in runs if math.isfinite(r[key])]
        if not values:
            return "n/a"
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.fmean(values):.3f} ± {sd:.3f}"

    print(f"\n{args.steps} rollout steps, seeds {args.seeds} (mean ± sd)")
    print(f"{'method':<12} {'held-out':<16} {'pass@8':<16} {'entropy (last 50)':<18} {'transition':<18}")
    for method, runs in results.items():
        print(f"{method:<12} {stat(runs, 'accuracy'):<16} {stat(runs, 'pass_at_8'):<16} "
              f"{stat(runs, 'entropy'):<18} {stat(runs, 'transition'):<18}")
    if "grpo" in results:
        for method, runs in results.items():
            if method == "grpo":
                continue
            diffs = [r["accuracy"] - b["accuracy"] for r, b in zip(runs, results["grpo"])]
            sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
            print(f"{method} - grpo held-out accuracy, paired by seed: {statistics.fmean(diffs):+.3f} ± {sd:.3f}")


if __name__ == "__main__":
    main()
