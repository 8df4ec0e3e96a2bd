"""Interventions that want strictly on-policy training, against plain GRPO on the quickstart setting, over seeds.

Setting = the quickstart (`a+b=`, a, b in 0..49, 200 warm-start steps on 5% of the problems, GRPO lr 3e-4,
16 prompts x 8, one optimizer step per rollout on the whole batch — strictly on-policy). Every method runs the
same trainer; only the callback list differs. Methods alternate per seed so slow drift of the machine hits all.

    python benchmarks/quickstart_methods.py --methods grpo opefo --seeds 0 1 2     # ~3 min a run on 2 cores
    python benchmarks/quickstart_methods.py --methods opefo_static opefo_increasing --seeds 0 --steps 1500

Prints per run and as mean ± sd over seeds: held-out greedy accuracy, pass@8 and maj@8 at the end, token
entropy (mean of the last 50 steps), and the run mean of the method's own metrics (e.g. ``opefo/lambda``; for
``grpo_rcea`` the RCEA diagnostics' last window and probe); then the held-out difference to GRPO paired by seed.

    python benchmarks/quickstart_methods.py --methods grpo_rcea paec hapo ep_grpo --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import lightning.pytorch as pl
import torch

from lightning_rlvr import RLVRModule
from lightning_rlvr.callbacks import EPGRPO, HAPO, OPEFO, PAEC, RCEADiagnostics, SupervisedWarmStart
from lightning_rlvr.loggers import InMemoryLogger

from _setting import addition_data, quiet_trainer  # benchmarks/_setting.py (the script's folder is on sys.path)

METHODS = {
    "grpo": lambda: [],
    # GRPO observed by the RCEA diagnostics (its probe forks the RNG: the same run as "grpo" at the same seed)
    "grpo_rcea": lambda: [RCEADiagnostics(every_n_steps=50, retention_every_n_steps=450, plots=False)],
    "opefo": lambda: [OPEFO()],  # exact flow, adaptive λ*, both sides (the paper)
    "opefo_onlyza": lambda: [OPEFO(flow="onlyza")],
    "opefo_static": lambda: [OPEFO(coefficient="static", static_lambda=1e-3)],
    "opefo_increasing": lambda: [OPEFO(sides="increasing")],
    "paec": lambda: [PAEC()],  # λ 0.05, floor 0.9 × the first 4 steps' masked entropy
    "paec_no_mask": lambda: [PAEC(mask="none")],
    "hapo": lambda: [HAPO()],  # λ 0.5, m_max 3
    "ep_grpo": lambda: [EPGRPO()],  # outcome-signed zero-variance groups, centred cells
    "ep_grpo_first_design": lambda: [EPGRPO(normalize="zscore", unsigned_zero_variance=True)],  # collapses
    "ep_grpo_zscore": lambda: [EPGRPO(normalize="zscore")],
}


def _finite_mean(values) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def run(method: str, seed: int, args: argparse.Namespace) -> dict[str, float]:
    pl.seed_everything(seed, verbose=False)
    logger = InMemoryLogger()
    interventions = METHODS[method]()
    callbacks = [SupervisedWarmStart(steps=200, batch_size=64, learning_rate=1e-3), *interventions]
    start = time.perf_counter()
    quiet_trainer(args.steps, args.steps, logger, callbacks).fit(RLVRModule(learning_rate=3e-4), addition_data())
    h = logger.history
    last = args.steps - 1
    prefixes = tuple(f"{cb.metric_prefix}/" for cb in interventions)
    # Diagnostics report their endpoint (the last window / probe); interventions the run mean of their metrics.
    own = {key: (h[key][max(h[key])] if key.startswith("rcea/") else _finite_mean(h[key].values()))
           for key in h if prefixes and key.startswith(prefixes)}
    return {
        "accuracy": h["val/accuracy"][max(h["val/accuracy"])],
        "pass_at_8": h["val/pass_at_k"][max(h["val/pass_at_k"])],
        "maj_at_8": h["val/maj_at_k"][max(h["val/maj_at_k"])],
        "entropy": statistics.fmean(h["entropy/token_mean"][s] for s in range(last - 49, last + 1)),
        "seconds": time.perf_counter() - start,
        **own,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["grpo", "opefo"], choices=sorted(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=4500, help="rollout steps")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (results depend on it slightly)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    results: dict[str, list[dict]] = {m: [] for m in args.methods}
    for seed in args.seeds:
        for method in args.methods:
            r = run(method, seed, args)
            results[method].append(r)
            extra = ", ".join(f"{k} {v:.3g}" for k, v in r.items() if "/" in k)
            print(f"{method:<17} seed {seed}: held-out {r['accuracy']:.3f}, pass@8 {r['pass_at_8']:.3f}, "
                  f"maj@8 {r['maj_at_8']:.3f}, "
                  f"H {r['entropy']:.3f}{', ' + extra if extra else ''}, {r['seconds']:.0f} s", flush=True)

    def stat(runs: list[dict], key: str) -> str:
        values = [r[key] for r in runs]
        return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"

    print(f"\nquickstart setting, {args.steps} rollout steps, seeds {args.seeds} (mean ± sd)")
    print(f"{'method':<17} {'held-out':<16} {'pass@8':<16} {'maj@8':<16} {'entropy (last 50)':<18}")
    for method, runs in results.items():
        print(f"{method:<17} {stat(runs, 'accuracy'):<16} {stat(runs, 'pass_at_8'):<16} {stat(runs, 'maj_at_8'):<16} "
              f"{stat(runs, 'entropy'):<18}")
    baseline = next((m for m in ("grpo", "grpo_rcea") if m in results), None)
    if baseline is not None:
        for method, runs in results.items():
            if method != baseline:
                diffs = [r["accuracy"] - b["accuracy"] for r, b in zip(runs, results[baseline])]
                sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
                print(f"{method} - {baseline} held-out, paired by seed: {statistics.fmean(diffs):+.3f} ± {sd:.3f}")


if __name__ == "__main__":
    main()
