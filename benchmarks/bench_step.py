"""Training speed of lightning_rlvr against TRL's GRPOTrainer and a bare PyTorch GRPO loop, on the same setting.

Every trainer gets the same tiny Llama (built offline), the same `a+b=` problems, 8 prompts x 8 completions per
step, the same sampling (temperature 1, no top-k/top-p), one AdamW update per rollout at lr 3e-4 with gradient
clipping at 1.0, token-mean GRPO loss, no KL and no reference model. What is timed is a whole RL step:
generation, reward, advantages, the log-prob forward, backward and the optimizer step; the first steps (warm-up)
are not counted. Each measurement runs in its own process (two torch threads), and the trainers take turns
round after round, so that a slow patch of the machine hits all of them alike; the table shows the median.

    python benchmarks/bench_step.py                       # 4 and 16 new tokens, tiny and larger model
    python benchmarks/bench_step.py --rounds 5 --steps 60 --json step.json
    python benchmarks/bench_step.py --trainers lightning_rlvr bare   # without TRL (pip install -e '.[bench]')
    python benchmarks/bench_step.py --trainers lightning_rlvr lightning_rlvr_lag1 lightning_rlvr_lag1_process \
        --models larger --new-tokens 16 64

``lightning_rlvr_lag1`` is lightning_rlvr with asynchronous rollouts (``max_policy_lag=1``: the next rollout is
generated in a background thread on ``HFEngine(weights="copy")`` while the step trains, TIS-corrected with cap 2);
``lightning_rlvr_lag1_process`` generates it in a process of its own (``ProcessEngine(threads=1)``, the weights
broadcast over gloo at each step) beside the trainer's two threads. The "× lag 0" column compares each with
``lightning_rlvr`` measured in the same rounds.

Settings: ``tiny`` is the embedded model (h64, 2 layers, ~77k parameters); ``larger`` is h256, 4 layers,
~2.4M parameters, where the update dominates the step.
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

TRAINERS = ("lightning_rlvr", "lightning_rlvr_lag1", "lightning_rlvr_lag1_process", "bare", "trl")
MODELS = {"tiny": {}, "larger": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
                                  "num_key_value_heads": 4, "intermediate_size": 512}}
PROMPTS, GROUP, LR = 8, 8, 3e-4


# ------------------------------------------------------------------------------------------------ the workers
def _setting(model: str, directory: str, new_tokens: int):
    import torch

    from lightning_rlvr import BuiltinTask
    from lightning_rlvr.models import TinyModelConfig, build_tiny_model

    torch.set_num_threads(2)
    torch.manual_seed(0)
    max_positions = 64 if new_tokens <= 48 else 128  # prompt (≤ 8 tokens) + completion must fit
    path = build_tiny_model(directory, TinyModelConfig(max_position_embeddings=max_positions, **MODELS[model]))
    return path, BuiltinTask("addition", max_operand=49)


def run_lightning_rlvr(path: str, task, new_tokens: int, steps: int, engine=None) -> list[float]:
    """``engine``: ``None`` for the default (strictly on-policy), else the engine of a ``max_policy_lag=1`` run."""
    import lightning.pytorch as pl

    from lightning_rlvr import RLVRModule, RolloutDataModule

    stamps: list[float] = []

    class Stamp(pl.Callback):
        def on_train_batch_end(self, *args, **kwargs) -> None:
            stamps.append(time.perf_counter())

    lagged = {"engine": engine, "max_policy_lag": 1} if engine is not None else {}
    data = RolloutDataModule(source=task, prompts_per_step=PROMPTS, group_size=GROUP, max_new_tokens=new_tokens,
                             val_samples=0, **lagged)
    module = RLVRModule(model=path, learning_rate=LR, max_grad_norm=1.0, loss_aggregation="token-mean",
                        engine_is_cap=2.0 if engine is not None else None)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, callbacks=[Stamp()])
    trainer.fit(module, data)
    return stamps


def run_bare(path: str, task, new_tokens: int, steps: int) -> list[float]:
    """The textbook loop, written for speed and nothing else: no entropy, no metrics."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    problems = task.train_problems()
    rng = random.Random(0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    stamps = []
    for _ in range(steps):
        batch = rng.sample(problems, PROMPTS)
        prompts = tokenizer([p.prompt for p in batch], return_tensors="pt", padding=True)
        with torch.no_grad():
            sequences = model.generate(**prompts, do_sample=True, max_new_tokens=new_tokens, temperature=1.0,
                                       top_k=0, top_p=1.0, num_return_sequences=GROUP, pad_token_id=pad,
                                       eos_token_id=eos)
        width = prompts.input_ids.shape[1]
        completions = sequences[:, width:]
        # Tokens up to and including the first EOS.
        after_eos = torch.cumsum((completions == eos).long(), dim=1) - (completions == eos).long()
        mask = (after_eos == 0).float()
        texts = tokenizer.batch_decode(completions * mask.long() + pad * (1 - mask.long()), skip_special_tokens=True)
        answers = [p.answer for p in batch for _ in range(GROUP)]
        rewards = torch.tensor([float(t == a) for t, a in zip(texts, answers, strict=True)]).view(PROMPTS, GROUP)
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        attention = torch.cat([prompts.attention_mask.repeat_interleave(GROUP, 0), mask.long()], dim=1)
        positions = (attention.cumsum(1) - 1).clamp_min(0)
        logits = model(input_ids=sequences, attention_mask=attention, position_ids=positions,
                       logits_to_keep=new_tokens + 1).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logprobs - logprobs.detach())  # one on-policy update: the ratio is 1, its gradient is not
        loss = -(ratio * advantages * mask).sum() / mask.sum().clamp_min(1)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        stamps.append(time.perf_counter())
    return stamps


def run_trl(path: str, task, new_tokens: int, steps: int) -> list[float]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            stamps.append(time.perf_counter())

    def exact_reward(prompts, completions, answer, **kwargs):
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    problems = task.train_problems()
    dataset = datasets.Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
            per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP, max_completion_length=new_tokens,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            beta=0.0, loss_type="dapo", scale_rewards="group", num_iterations=1, temperature=1.0, top_k=0, top_p=1.0,
            max_steps=steps, logging_steps=10_000, use_vllm=False, seed=0, dataloader_num_workers=0,
            disable_tqdm=True)
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=exact_reward,
                              args=config, train_dataset=dataset,
                              processing_class=AutoTokenizer.from_pretrained(path), callbacks=[Stamp()])
        trainer.train()
    return stamps


def worker(trainer: str, model: str, new_tokens: int, steps: int, warmup: int) -> dict:
    from lightning_rlvr.rollout import HFEngine, ProcessEngine

    with tempfile.TemporaryDirectory() as directory:
        path, task = _setting(model, directory, new_tokens)
        lagged = {"lightning_rlvr_lag1": lambda: HFEngine(weights="copy"),
                  "lightning_rlvr_lag1_process": lambda: ProcessEngine(threads=1)}
        if trainer in lagged:
            stamps = run_lightning_rlvr(path, task, new_tokens, steps + warmup, engine=lagged[trainer]())
        else:
            stamps = {"lightning_rlvr": run_lightning_rlvr, "bare": run_bare, "trl": run_trl}[trainer](
                path, task, new_tokens, steps + warmup)
    if len(stamps) < warmup + 2:
        raise RuntimeError(f"{trainer} stamped {len(stamps)} steps, expected {steps + warmup}")
    timed = stamps[warmup:]
    seconds = timed[-1] - timed[0]
    steps_per_s = (len(timed) - 1) / seconds
    return {"steps_per_s": steps_per_s, "completions_per_s": steps_per_s * PROMPTS * GROUP}


# ------------------------------------------------------------------------------------------------ the driver
def measure(trainer: str, model: str, new_tokens: int, steps: int, warmup: int) -> dict:
    command = [sys.executable, __file__, "--worker", trainer, "--model", model, "--new-tokens", str(new_tokens),
               "--steps", str(steps), "--warmup", str(warmup)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{trainer} ({model}, {new_tokens} tokens) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "larger"])
    parser.add_argument("--new-tokens", nargs="+", type=int, default=[4, 16])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per trainer and setting (median)")
    parser.add_argument("--json", type=Path, help="also write the table here")
    parser.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=sorted(MODELS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.model, args.new_tokens[0], args.steps, args.warmup)))
        return

    rows = []
    for model in args.models:
        for new_tokens in args.new_tokens:
            samples: dict[str, list[float]] = {t: [] for t in args.trainers}
            for round_index in range(args.rounds):
                shift = round_index % len(args.trainers)  # each round starts with another trainer
                for trainer in args.trainers[shift:] + args.trainers[:shift]:
                    samples[trainer].append(measure(trainer, model, new_tokens, args.steps, args.warmup)["steps_per_s"])
            median = {t: statistics.median(v) for t, v in samples.items()}
            for trainer in args.trainers:
                rows.append({
                    "model": model, "new_tokens": new_tokens, "trainer": trainer, "steps_per_s": median[trainer],
                    "completions_per_s": median[trainer] * PROMPTS * GROUP, "rounds": samples[trainer],
                    "vs_bare": median[trainer] / median["bare"] if "bare" in median else None,
                    "vs_trl": median[trainer] / median["trl"] if "trl" in median else None,
                    "vs_lag0": (median[trainer] / median["lightning_rlvr"]
                                if "lightning_rlvr" in median and trainer.startswith("lightning_rlvr") else None),
                })
            print(f"{model}, {new_tokens} new tokens: " + ", ".join(f"{t} {median[t]:.1f}" for t in args.trainers),
                  file=sys.stderr, flush=True)

    print(f"\n{PROMPTS} prompts x {GROUP} completions per step; median of {args.rounds} rounds of {args.steps} steps")
    print("| model | new tokens | trainer | steps/s | completions/s | × bare loop | × TRL | × lag 0 |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        ratio = lambda key: "—" if row[key] is None else f"{row[key]:.2f}"  # noqa: E731
        print(f"| {row['model']} | {row['new_tokens']} | {row['trainer']} | {row['steps_per_s']:.1f} | "
              f"{row['completions_per_s']:.0f} | {ratio('vs_bare')} | {ratio('vs_trl')} | {ratio('vs_lag0')} |")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
