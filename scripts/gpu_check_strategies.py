"""GPU check of lightning_rlvr under Lightning's FSDP2 and DeepSpeed ZeRO-2/3 strategies (one GPU, < 5 minutes).

Run from the repository root on a machine with a CUDA GPU (``pip install -e '.[deepspeed]'`` first)::

    python scripts/gpu_check_strategies.py            # prints a table; exit code 1 if a check fails
    python scripts/gpu_check_strategies.py --json out.json

What it checks, each case in a fresh process (a process group and DeepSpeed's globals are per process):

1. ``single``: a plain one-GPU fit (fp32, KL term with a frozen reference, 4 micro-batches per update, active
   gradient clipping, TopEntropyTokens + ClipCov), 3 rollout steps with a policy-independent scripted engine.
2. ``fsdp`` / ``zero2`` / ``zero3``: the same fit under ``ModelParallelStrategy`` (FSDP2) and ``DeepSpeedStrategy``
   stage 2 and 3. Final weights (gathered with :func:`lightning_rlvr.sharding.full_weights`) and every step's
   losses must equal the single-GPU run's to float tolerance: this catches lost micro-batch gradients (DeepSpeed
   reduces at accumulation boundaries), an unclipped or wrongly-normed gradient, a reference not loaded.
3. ``zero3_resume``: resumes the ZeRO-3 run from its step-2 checkpoint (a folder written by DeepSpeed): the
   checkpoint holds no reference weights, and step 3 logs what the uninterrupted run logged.
4. ``cli_fsdp`` / ``cli_zero3``: ``configs/fsdp.yaml`` and ``configs/deepspeed_zero3.yaml`` through the CLI
   (bf16, the real Hugging Face ``generate`` engine on the sharded policy), 30 rollout steps on one GPU.

Several GPUs: the CPU test suite already checks 2-rank DDP and FSDP2 against one process
(``tests/test_distributed_fit.py``); DeepSpeed's multi-rank run is only checked by running the configs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
EQUIVALENCE_CASES = ("fsdp", "zero2", "zero3")


def run_case(case: str, work: Path, accelerator: str = "gpu") -> dict:
    """One fit in this process; returns its per-step metrics, final weights' path and facts about the checkpoint."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy
    from test_distributed_fit import Digits, PromptSeededEngine, RankShards, odd_length  # scripted rollouts

    from lightning_rlvr import RLVRModule
    from lightning_rlvr.callbacks import ClipCov, TopEntropyTokens
    from lightning_rlvr.loggers import InMemoryLogger
    from lightning_rlvr.models import TinyModelConfig, build_tiny_model
    from lightning_rlvr.sharding import full_weights, is_sharded
    from lightning_rlvr.verifiers import CallableVerifier

    model_dir = work / "model"
    if not model_dir.exists():
        build_tiny_model(model_dir, TinyModelConfig(hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                                                    num_attention_heads=8, num_key_value_heads=4))
    pl.seed_everything(0, verbose=False)
    module = RLVRModule(model=str(model_dir), learning_rate=1e-3, max_grad_norm=0.5, kl_coef=0.05, micro_batch_size=8)
    token_ids = [module.tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]
    engine = PromptSeededEngine(token_ids, module.tokenizer.eos_token_id, module.tokenizer.pad_token_id)
    data = RankShards(source=Digits(), engine=engine, verifier=CallableVerifier(odd_length), prompts_per_step=8,
                      group_size=4, max_new_tokens=4, val_samples=0)
    base = case.removesuffix("_resume")
    strategy = {"single": "auto", "fsdp": ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
                "zero2": DeepSpeedStrategy(stage=2, exclude_frozen_parameters=True, logging_batch_size_per_gpu=1),
                "zero3": DeepSpeedStrategy(stage=3, exclude_frozen_parameters=True, logging_batch_size_per_gpu=1)}[base]
    logger = InMemoryLogger()
    checkpoints = work / f"{base}_checkpoints"
    trainer = pl.Trainer(accelerator=accelerator, devices=1, strategy=strategy, max_steps=STEPS, logger=logger,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, log_every_n_steps=1, use_distributed_sampler=False,
                         callbacks=[TopEntropyTokens(ratio=0.5), ClipCov(ratio=0.2, lower=-1.0, upper=5.0, seed=3),
                                    ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1)])
    ckpt_path = str(checkpoints / "epoch=0-step=2.ckpt") if case.endswith("_resume") else None
    trainer.fit(module, data, ckpt_path=ckpt_path)
    weights = {name: t.detach().float().cpu().clone() for bucket in full_weights(module.policy) for name, t in bucket}
    torch.save(weights, work / f"{case}_weights.pt")
    result = {"history": {k: {str(s): v for s, v in steps.items()} for k, steps in logger.history.items()},
              "policy_sharded": is_sharded(module.policy), "reference_sharded": is_sharded(module.ref_model)}
    checkpoint = checkpoints / "epoch=0-step=2.ckpt"
    if (checkpoint / ".metadata").is_file():  # FSDP2 distributed checkpoint
        from torch.distributed.checkpoint import FileSystemReader

        keys = list(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
        result["checkpoint_keys"] = len(keys)
        result["checkpoint_reference_keys"] = sum("ref_model" in k for k in keys)
    elif checkpoint.is_dir():  # DeepSpeed: model states file(s) in a folder; keys must not name the reference
        keys = []
        for states in checkpoint.rglob("*model_states.pt"):
            state = torch.load(states, map_location="cpu", weights_only=False)  # DeepSpeed's own format
            keys += list(state.get("module") or {}) + list(state.get("frozen_param_shapes") or {})
        result["checkpoint_keys"] = len(keys)
        result["checkpoint_reference_keys"] = sum("ref_model" in k for k in keys)
    elif checkpoint.is_file():
        keys = list(torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"])
        result["checkpoint_keys"] = len(keys)
        result["checkpoint_reference_keys"] = sum("ref_model" in k for k in keys)
    result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return result


def run_cli(config: str, extra: list[str]) -> dict:
    start = time.perf_counter()
    args = [sys.executable, "-m", "lightning_rlvr", "fit", "--config", config, "--trainer.devices", "1",
            "--trainer.max_steps", "30", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
            "--trainer.val_check_interval", "30", "--data.val_max_prompts", "64", *extra]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=240)
    tail = (done.stdout + done.stderr)[-1500:]
    return {"ok": done.returncode == 0, "seconds": time.perf_counter() - start, "tail": tail}


def compare(reference: dict, other: dict, work: Path, case: str) -> tuple[bool, str]:
    import torch

    ref_w, w = torch.load(work / "single_weights.pt"), torch.load(work / f"{case}_weights.pt")
    weight_diff = max((ref_w[k] - w[k]).abs().max().item() for k in ref_w)
    moved = max((ref_w[k]).abs().max().item() for k in ref_w)
    worst_metric, worst_key = 0.0, ""
    for key in ("loss/pg", "loss/kl", "loss/total", "policy/grad_norm", "policy/clipfrac_high", "entropy/token_mean"):
        for step, value in reference["history"][key].items():
            diff = abs(other["history"][key][step] - value) / (1e-6 + abs(value))
            if diff > worst_metric:
                worst_metric, worst_key = diff, f"{key}@{step}"
    ok = weight_diff < 2e-4 and worst_metric < 2e-3
    return ok, f"max |Δweight| {weight_diff:.2e} (weights up to {moved:.2f}); worst relative metric diff " \
               f"{worst_metric:.2e} ({worst_key})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--cli", nargs="*", default=["fsdp", "deepspeed_zero3"],
                        help="configs to run for 30 steps through the CLI (none: skip)")
    parser.add_argument("--cases", nargs="+", default=["single", *EQUIVALENCE_CASES, "zero3_resume"],
                        help="which fits to run (default: all)")
    parser.add_argument("--accelerator", default="gpu", help="'cpu' dry-runs the non-DeepSpeed cases")
    args = parser.parse_args()
    if args.case:  # child process
        result = run_case(args.case, Path(args.work), args.accelerator)
        Path(args.work, f"{args.case}.json").write_text(json.dumps(result))
        return 0
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    results, rows, failed = {}, [], False
    for case in args.cases:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--case", case, "--work", str(work), "--accelerator",
                               args.accelerator], capture_output=True, text=True, timeout=300)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            failed = True
            rows.append((case, "FAIL", f"{seconds:.0f}s; " + (done.stdout + done.stderr)[-3000:]))
            continue
        results[case] = json.loads((work / f"{case}.json").read_text())
        rows.append((case, "ran", f"{seconds:.0f}s; peak {results[case]['peak_memory_gib']:.2f} GiB; policy sharded "
                     f"{results[case]['policy_sharded']}, reference sharded {results[case]['reference_sharded']}; "
                     f"checkpoint keys {results[case].get('checkpoint_keys')}, of the reference "
                     f"{results[case].get('checkpoint_reference_keys')}"))
    if "single" in results:
        for case in EQUIVALENCE_CASES:
            if case in results:
                ok, detail = compare(results["single"], results[case], work, case)
                failed |= not ok or bool(results[case].get("checkpoint_reference_keys"))
                rows.append((f"{case} = single", "PASS" if ok else "FAIL", detail))
    if "zero3" in results and "zero3_resume" in results:
        full, resumed = results["zero3"]["history"], results["zero3_resume"]["history"]
        last = str(STEPS - 1)
        diffs = {k: abs(resumed[k][last] - full[k][last]) / (1e-6 + abs(full[k][last]))
                 for k in ("loss/pg", "loss/kl", "loss/total", "policy/grad_norm") if last in resumed.get(k, {})}
        ok = len(diffs) == 4 and max(diffs.values()) < 1e-3
        failed |= not ok
        rows.append(("zero3 resume = uninterrupted", "PASS" if ok else "FAIL", f"step {last}: {diffs}"))
    for name in args.cli:
        config = f"configs/{name}.yaml"
        extra = ["--trainer.strategy.init_args.data_parallel_size", "1"] if name == "fsdp" else []
        out = run_cli(config, extra)
        failed |= not out["ok"]
        rows.append((config, "PASS" if out["ok"] else "FAIL",
                     f"{out['seconds']:.0f}s" + ("" if out["ok"] else "; " + out["tail"])))
    for name, status, detail in rows:
        print(f"{status:5} {name}: {detail}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "results": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
