"""LoRA against full fine-tuning where a reference model is needed: a KL term, and EP-GRPO.

Full fine-tuning loads a second, frozen copy of the model for the reference; a LoRA policy's reference is itself
with the adapter switched off. Per row, in its own process: step time (rollout + update, HFEngine), the bytes of
parameters held (policy + reference), of AdamW's state, the process's peak resident memory, and the size of a
checkpoint written at the end.

    python benchmarks/bench_lora.py                          # bench_step.py's 2.4M-parameter model
    python benchmarks/bench_lora.py --model tiny --steps 40 --json lora.json

Rows: ``full_kl`` / ``lora_kl`` (GRPO + KL k3, β = 0.01) and ``full_ep_grpo`` / ``lora_ep_grpo`` (EP-GRPO, whose
progress term reads the reference's log-probs). LoRA: rank 16, α 32, the attention and MLP projections.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_step import MODELS  # the same model shapes (this folder is on sys.path when a script runs)

ROWS = ("full_kl", "lora_kl", "full_ep_grpo", "lora_ep_grpo")
LORA = {"rank": 16, "alpha": 32.0}


def worker(row: str, model: str, steps: int, warmup: int) -> dict:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
    from lightning_rlvr.callbacks import EPGRPO
    from lightning_rlvr.models import TinyModelConfig, build_tiny_model

    from _setting import StepClock

    torch.set_num_threads(2)
    torch.manual_seed(0)
    clock = StepClock()

    lora = LORA if row.startswith("lora") else None
    kl = 0.01 if row.endswith("_kl") else 0.0
    callbacks = [EPGRPO()] if row.endswith("ep_grpo") else []
    with tempfile.TemporaryDirectory() as directory:
        path = build_tiny_model(Path(directory) / "model", TinyModelConfig(**MODELS[model]))
        data = RolloutDataModule(source=BuiltinTask("addition", max_operand=49), prompts_per_step=8, group_size=8,
                                 max_new_tokens=4, val_samples=0)
        module = RLVRModule(model=path, learning_rate=3e-4, kl_coef=kl, lora=lora)
        checkpoint_dir = Path(directory) / "checkpoints"
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps + warmup, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             num_sanity_val_steps=0,
                             callbacks=[*callbacks, clock, ModelCheckpoint(dirpath=checkpoint_dir)])
        trainer.fit(module, data)
        models = [m for m in (module.policy, module.ref_model) if m is not None]
        parameter_bytes = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
        optimizer_bytes = sum(t.numel() * t.element_size() for state in trainer.optimizers[0].state.values()
                              for t in state.values() if torch.is_tensor(t))
        (checkpoint,) = checkpoint_dir.glob("*.ckpt")
        checkpoint_bytes = os.path.getsize(checkpoint)
    return {"steps_per_s": clock.steps_per_s(warmup), "parameter_bytes": parameter_bytes,
            "optimizer_bytes": optimizer_bytes, "checkpoint_bytes": checkpoint_bytes,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "reference_model": module.ref_model is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--model", choices=sorted(MODELS), default="larger", help="bench_step.py's model shapes")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.model, args.steps, args.warmup)))
        return
    results = {}
    for row in args.rows:
        command = [sys.executable, __file__, "--worker", row, "--model", args.model, "--steps", str(args.steps),
                   "--warmup", str(args.warmup)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{row} failed:\n{done.stderr[-3000:]}")
        results[row] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\n{args.model} model, 8 x 8 completions, 4 new tokens, {args.steps} timed steps per row (one process "
          f"each)")
    print("| row | steps/s | × full fine-tuning | parameters held (MB) | AdamW state (MB) | peak RSS (MB) | "
          "checkpoint (MB) |")
    print("|---|---|---|---|---|---|---|")
    mb = 2**20
    for row, result in results.items():
        baseline = results.get(row.replace("lora", "full"), result)
        print(f"| {row} | {result['steps_per_s']:.1f} | {baseline['steps_per_s'] / result['steps_per_s']:.2f} | "
              f"{result['parameter_bytes'] / mb:.2f} | {result['optimizer_bytes'] / mb:.2f} | "
              f"{result['peak_rss_bytes'] / mb:.0f} | {result['checkpoint_bytes'] / mb:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "model": args.model,
                                         "steps": args.steps, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
