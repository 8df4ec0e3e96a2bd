"""Step time of each entropy intervention, and of all the paper interventions stacked, against plain GRPO.

The setting of ``bench_step.py`` (tiny Llama, `a+b=`, 8 prompts x 8 completions, one update per rollout) with
one callback list per row; each measurement runs in its own process and the rows take turns round after round
(median of the rounds). The cost of an intervention is what it adds to the step, including what it makes the
module compute: ``old_stats`` (the behaviour policy's stats before the update: since HFEngine returns them from
its decoding loop, a few small kernel calls there instead of a no-grad forward) and ``ref_logprobs`` (a forward
of the frozen reference: EP-GRPO). ``all_but_reference`` is the stack without EP-GRPO: the callbacks' own cost
apart from that second model's forward.

    python benchmarks/bench_interventions.py
    python benchmarks/bench_interventions.py --rounds 5 --steps 60 --new-tokens 16 --json interventions.json
    python benchmarks/bench_interventions.py --model larger    # bench_step.py's 2.4M-parameter model

With ``--micro-batch-size`` the update is split into micro-batches. Interventions whose statistics are defined over
the batch then get the whole minibatch's from one no-grad forward before its micro-batches (extra pass
``minibatch_stats``); the ``*_per_micro_batch`` rows take them per micro-batch instead, as the verl-based
reference code does, and show what that pass costs:

    python benchmarks/bench_interventions.py --model larger --micro-batch-size 16 \
        --rows clip_cov clip_cov_per_micro_batch top_entropy_tokens top_entropy_tokens_per_micro_batch
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_step import MODELS  # the same model shapes (this folder is on sys.path when a script runs)


def interventions(name: str) -> list:
    """The callbacks of a row (paper defaults, except where the tiny task needs otherwise)."""
    from lightning_rlvr import callbacks as cb

    single = {
        "grpo": [],
        "clip_cov": [cb.ClipCov()],
        "kl_cov": [cb.KLCov()],
        "top_entropy_tokens": [cb.TopEntropyTokens()],
        "entropy_bonus": [cb.EntropyBonus()],
        "adaptive_entropy": [cb.AdaptiveEntropy()],
        "gtpo": [cb.GTPO()],
        "perplexity_shaping": [cb.StageDetector(), cb.PerplexityShaping()],
        "position_shaping": [cb.StageDetector(), cb.PositionShaping(active_steps=None, active_fraction=None)],
        "steer": [cb.STEER()],
        "paec": [cb.PAEC()],
        "opefo": [cb.OPEFO()],
        "hapo": [cb.HAPO()],
        "ep_grpo": [cb.EPGRPO()],
        "clip_cov_per_micro_batch": [cb.ClipCov(scope="micro_batch")],
        "top_entropy_tokens_per_micro_batch": [cb.TopEntropyTokens(scope="micro_batch")],
    }
    if name in single:
        return single[name]
    # One of each family that can act together: advantage shaping (GTPO, stage-aware position shaping, HAPO),
    # token selection and weighting (TopEntropyTokens, STEER), covariance control (Clip-Cov, KL-Cov), entropy
    # regularisation (AdaptiveEntropy, PAEC), flow balancing (OPEFO) and EP-GRPO's reference-anchored term.
    stack = [cb.StageDetector(), cb.GTPO(), cb.PositionShaping(active_steps=None, active_fraction=None), cb.HAPO(), cb.TopEntropyTokens(),
             cb.STEER(), cb.ClipCov(), cb.KLCov(), cb.AdaptiveEntropy(), cb.PAEC(), cb.OPEFO()]
    if name == "all_paper":
        return [*stack, cb.EPGRPO()]
    if name == "all_but_reference":
        # The same stack without EP-GRPO, the one intervention that needs a forward of a second model: what the
        # callbacks' own work costs, apart from that forward.
        return stack
    raise ValueError(f"unknown row {name!r}")


ROWS = ("grpo", "clip_cov", "kl_cov", "top_entropy_tokens", "entropy_bonus", "adaptive_entropy", "gtpo",
        "perplexity_shaping", "position_shaping", "steer", "paec", "opefo", "hapo", "ep_grpo", "all_paper",
        "all_but_reference", "clip_cov_per_micro_batch", "top_entropy_tokens_per_micro_batch")
DEFAULT_ROWS = ROWS[:-2]  # the per-micro-batch rows differ from their minibatch rows only when micro-batching


def worker(row: str, model: str, new_tokens: int, steps: int, warmup: int, micro_batch_size: int | None) -> dict:
    import lightning.pytorch as pl
    import torch

    from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
    from lightning_rlvr.callbacks import Intervention
    from lightning_rlvr.models import TinyModelConfig, build_tiny_model

    from _setting import StepClock

    torch.set_num_threads(2)
    torch.manual_seed(0)
    clock = StepClock()

    callbacks = interventions(row)
    with tempfile.TemporaryDirectory() as directory:
        path = build_tiny_model(directory, TinyModelConfig(**MODELS[model]))
        data = RolloutDataModule(source=BuiltinTask("addition", max_operand=49), prompts_per_step=8, group_size=8,
                                 max_new_tokens=new_tokens, val_samples=0)
        module = RLVRModule(model=path, learning_rate=3e-4, max_grad_norm=1.0, micro_batch_size=micro_batch_size)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps + warmup, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0, num_sanity_val_steps=0, callbacks=[*callbacks, clock])
        trainer.fit(module, data)
        needs = module.needs()
    return {"steps_per_s": clock.steps_per_s(warmup),
            "passes": [name for name in ("old_stats", "ref_logprobs", "flow_stats", "entropy_grad")
                       if getattr(needs, name)] + (["nucleus"] if needs.nucleus_top_p else [])
                      + (["minibatch_stats"] if needs.minibatch_stats and micro_batch_size else []),
            "interventions": sum(isinstance(c, Intervention) for c in callbacks)}


def measure(row: str, model: str, new_tokens: int, steps: int, warmup: int, micro_batch_size: int | None) -> dict:
    command = [sys.executable, __file__, "--worker", row, "--model", model, "--new-tokens", str(new_tokens),
               "--steps", str(steps), "--warmup", str(warmup)]
    if micro_batch_size:
        command += ["--micro-batch-size", str(micro_batch_size)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{row} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratio_table(samples: dict[str, list[float]], details: dict[str, dict]) -> list[dict]:
    """Per row: the fastest round (other load on the machine only ever slows a round down, so the best round is
    the closest to the row's own cost, as ``timeit`` reports its minimum) and the median, each against GRPO's."""
    best_base, median_base = max(samples["grpo"]), statistics.median(samples["grpo"])
    return [{"row": row, "steps_per_s": max(speeds), "step_time_vs_grpo": best_base / max(speeds),
             "median_step_time_vs_grpo": median_base / statistics.median(speeds), "passes": details[row]["passes"],
             "rounds": speeds} for row, speeds in samples.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(DEFAULT_ROWS))
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny", help="bench_step.py's model shapes")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=None, help="completions per forward/backward")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.model, args.new_tokens, args.steps, args.warmup,
                                args.micro_batch_size)))
        return
    rows = ["grpo", *[r for r in args.rows if r != "grpo"]]
    samples: dict[str, list[float]] = {row: [] for row in rows}
    details: dict[str, dict] = {}
    for round_index in range(args.rounds):
        shift = round_index % len(rows)
        for row in rows[shift:] + rows[:shift]:
            result = measure(row, args.model, args.new_tokens, args.steps, args.warmup, args.micro_batch_size)
            samples[row].append(result["steps_per_s"])
            details[row] = result
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    table = ratio_table(samples, details)
    micro = f", micro-batches of {args.micro_batch_size}" if args.micro_batch_size else ""
    print(f"\n{args.model} model, {args.new_tokens} new tokens, 8 x 8 completions{micro}; best and median of "
          f"{args.rounds} rounds of {args.steps} steps")
    print("| interventions | steps/s (best) | step time × GRPO (best) | × GRPO (median) | extra passes |")
    print("|---|---|---|---|---|")
    for entry in table:
        print(f"| {entry['row']} | {entry['steps_per_s']:.1f} | {entry['step_time_vs_grpo']:.2f} | "
              f"{entry['median_step_time_vs_grpo']:.2f} | {', '.join(entry['passes']) or '—'} |")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "model": args.model,
                                         "new_tokens": args.new_tokens, "micro_batch_size": args.micro_batch_size,
                                         "rows": table}, indent=2))


if __name__ == "__main__":
    main()
