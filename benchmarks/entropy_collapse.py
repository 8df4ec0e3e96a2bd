"""Entropy collapse on the embedded task, and what AdaptiveEntropy / ClipCov / KLCov do about it.

Setting: the `a+b=` task (a, b in 0..49) from a *capable* start (600 supervised warm-start steps on 20%
of the problems: held-out greedy accuracy ~0.70, token entropy ~0.3), then GRPO at lr 5e-4 with two
minibatches per rollout (KL-Cov's penalty has no gradient on the first update of a rollout). Plain GRPO's
token entropy falls below 0.1 after ~1,300-1,600 rollout steps. Larger learning rates do not collapse
entropy faster on this model: from 7e-4 on, accuracy falls instead while entropy stays ~0.3, and at 1e-3+
the policy breaks (reward -> 0, truncations), so this is the fastest clean collapse we measured.

Every method runs the *same* trainer settings (only the callback differs) and the same seeds, in the
same process, one after the other (~70 s per run on 2 cores):

    python benchmarks/entropy_collapse.py --seeds 0 1
    python benchmarks/entropy_collapse.py --methods grpo gtpo top_entropy --steps 600

It prints, per method, the token entropy (mean over a 20-step window) at a few steps, the mean
training reward of the last 50 steps, the held-out greedy accuracy and pass@8 at the end, the first
step whose window entropy is below 0.1, and the entropy and accuracy relative to plain GRPO in this run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch

from lightning_rlvr import RLVRModule
from lightning_rlvr.callbacks import (
    GTPO,
    STEER,
    AdaptiveEntropy,
    ClipCov,
    EntropyBonus,
    KLCov,
    SupervisedWarmStart,
    TopEntropyTokens,
)
from lightning_rlvr.loggers import InMemoryLogger

from _setting import addition_data, quiet_trainer  # benchmarks/_setting.py (the script's folder is on sys.path)

# The interventions, with settings for this task (the reference defaults touch ~0 tokens of a
# 128-completion batch of 2-3 token answers: 2e-4 × 400 tokens < 1).
METHODS = {
    "grpo": lambda: [],
    "adaptive_entropy": lambda: [AdaptiveEntropy(target=0.3, step_size=1e-3, max_coef=0.1)],
    "clip_cov": lambda: [ClipCov(ratio=0.4, lower=0.2, upper=5.0)],
    "kl_cov": lambda: [KLCov(ratio=0.1, coef=1.0)],
    "entropy_bonus": lambda: [EntropyBonus(coef=0.005)],
    "top_entropy": lambda: [TopEntropyTokens(ratio=0.2)],
    "gtpo": lambda: [GTPO()],
    "steer": lambda: [STEER()],  # exp mode, λ_min 0.8, the reference Ω (paper defaults)
    "steer_exact": lambda: [STEER(omega="exact", omega_floor=1e-3)],
}


def run(method: str, seed: int, args: argparse.Namespace) -> dict[str, object]:
    pl.seed_everything(seed, verbose=False)
    logger = InMemoryLogger()
    module = RLVRModule(learning_rate=args.lr, minibatch_size=args.minibatch_size, max_grad_norm=args.max_grad_norm)
    updates = -(-128 // args.minibatch_size) if args.minibatch_size else 1
    trainer = quiet_trainer(args.steps * updates, args.steps, logger,
                            [SupervisedWarmStart(steps=args.warm_start_steps), *METHODS[method]()])
    start = time.perf_counter()
    trainer.fit(module, addition_data(args.warm_start_fraction))
    entropy = logger.history["entropy/token_mean"]
    reward = logger.history["reward/mean"]

    def window(step: int) -> float:
        values = [entropy[s] for s in range(max(0, step - 20), step) if s in entropy]
        return statistics.fmean(values) if values else float("nan")

    accuracy = logger.history["val/accuracy"]
    return {
        "entropy": {s: window(s) for s in args.report},
        "reward": statistics.fmean(reward[s] for s in sorted(reward)[-50:]),
        "accuracy": accuracy[max(accuracy)],
        "pass_at_k": logger.history["val/pass_at_k"][max(accuracy)],
        "seconds": time.perf_counter() - start,
        "first_below_0.1": next((s for s in sorted(entropy) if window(s + 1) < 0.1 and s >= 19), None),
        # a token-weighting method also scales the step: its mean weight says by how much
        "mean_weight": statistics.fmean(logger.history["steer/weight_mean"].values())
        if "steer/weight_mean" in logger.history else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["grpo", "adaptive_entropy", "clip_cov", "kl_cov"],
                        choices=sorted(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--steps", type=int, default=1500, help="rollout steps after the warm start")
    parser.add_argument("--minibatch-size", type=int, default=64,
                        help="completions per optimizer step (2 updates per rollout: KL-Cov needs > 1)")
    parser.add_argument("--warm-start-steps", type=int, default=600)
    parser.add_argument("--warm-start-fraction", type=float, default=0.2,
                        help="supervised share of the problems (a capable start, like a base model)")
    parser.add_argument("--max-grad-norm", type=float, default=None)
    parser.add_argument("--report", nargs="+", type=int, default=[300, 600, 900, 1200, 1500])
    args = parser.parse_args()
    args.report = [s for s in args.report if s <= args.steps]
    torch.set_num_threads(min(2, torch.get_num_threads()))

    results: dict[str, list[dict]] = {m: [] for m in args.methods}
    for method in args.methods:
        for seed in args.seeds:
            r = run(method, seed, args)
            results[method].append(r)
            print(f"{method} seed {seed}: H@{args.report[-1]} {r['entropy'][args.report[-1]]:.3f}, "
                  f"held-out {r['accuracy']:.3f}, pass@8 {r['pass_at_k']:.3f}"
                  + (f", mean token weight {r['mean_weight']:.3f}" if r["mean_weight"] is not None else ""), flush=True)
    print(f"\nlr {args.lr}, {args.steps} rollout steps, minibatch {args.minibatch_size}, seeds {args.seeds}")
    header = " ".join(f"H@{s:<5}" for s in args.report)
    print(f"{'method':<17} {header} reward  held-out  pass@8  H<0.1 at  vs GRPO: H@{args.report[-1]}  acc   s/run")
    base = results.get("grpo")
    for method, runs in results.items():
        h = {s: statistics.fmean(r["entropy"][s] for r in runs) for s in args.report}
        acc = statistics.fmean(r["accuracy"] for r in runs)
        below = [r["first_below_0.1"] for r in runs]
        ratio = ""
        if base:
            base_h = statistics.fmean(r["entropy"][args.report[-1]] for r in base)
            base_acc = statistics.fmean(r["accuracy"] for r in base)
            ratio = f"{h[args.report[-1]] / base_h:>5.2f}x  {acc / max(base_acc, 1e-9):>5.2f}x"
        print(f"{method:<17} " + " ".join(f"{h[s]:<7.3f}" for s in args.report)
              + f" {statistics.fmean(r['reward'] for r in runs):<7.3f} {acc:<9.3f}"
              + f" {statistics.fmean(r['pass_at_k'] for r in runs):<7.3f} {str(below):<9} {ratio:<14}"
              + f" {statistics.fmean(r['seconds'] for r in runs):.0f}")


if __name__ == "__main__":
    main()
