"""GPU smoke test of VLLMEngine against the real vLLM (one GPU, about two minutes; two GPUs for the last check).

    python scripts/gpu_smoke_vllm.py                       # the built-in tiny model, built offline
    python scripts/gpu_smoke_vllm.py --chat                # builtin:tiny-chat (byte-level BPE, two stop ids)
    python scripts/gpu_smoke_vllm.py --model /path/to/Qwen2.5-0.5B-Instruct
    python scripts/gpu_smoke_vllm.py --model builtin:smollm2-135m-instruct   # the cached real model

Each check prints PASS or FAIL; the exit code is 1 if any failed. The checks are those a CPU stand-in cannot make
(``../shared/reviews/vllm-review.md``):

1. The engine is first built inside ``torch.inference_mode()`` (as in Lightning's sanity validation) and later
   synced outside it: the push must work and greedy completions equal Hugging Face ``generate`` (float32 on both
   sides, so greedy decoding agrees token for token up to ties).
2. After a few supervised steps toward another answer and a sync, the completions change and again equal
   ``generate`` (a sync that did not reach vLLM's model would leave them as in 1).
3. Sampled at temperature 1.0 and 0.7, vLLM's processed log-probs equal the trainer's ``log_softmax(logits / T)`` of
   the same tokens (mean gap < 1e-2; before vLLM 0.10.2 "processed" was before temperature: the 0.7 gap shows it).
4. After a level-2 sleep (the weights are discarded) the engine pushes them again: completions still equal
   ``generate``.
5. With two GPUs: a 2-step fit through Lightning's own launcher (``Trainer(devices=2)``, not torchrun), one
   colocated engine per rank (``external_launcher``), ``rollout/engine_kl`` near 0 on both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_rlvr.models import TinyModelConfig, build_tiny_chat_model, build_tiny_model, resolve_model  # noqa: E402
from lightning_rlvr.ops import token_logprobs_and_entropy  # noqa: E402
from lightning_rlvr.rollout import HFEngine, SamplingConfig, VLLMEngine  # noqa: E402
from lightning_rlvr.rollout.stops import resolve_stop_token_ids  # noqa: E402


def completions(output) -> list[list[int]]:
    """Each completion as long as the engine says it is (through its stop id, if it stopped)."""
    return [ids[:length] for ids, length in zip(output.completion_ids.tolist(), output.lengths.tolist())]


def logprob_gap(policy, sampled, temperature: float, device: str) -> float:
    """Mean |log p_trainer − log p_vLLM| over the sampled tokens, the trainer's at ``temperature`` (full softmax)."""
    ids = torch.cat([sampled.prompt_ids, sampled.completion_ids], 1).to(device)
    width = sampled.completion_ids.shape[1]
    valid = torch.arange(width)[None, :] < sampled.lengths[:, None]
    mask = torch.cat([sampled.prompt_mask, valid.long()], 1).to(device)
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # left padding: positions count real tokens, as in vLLM
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logits = logits[:, sampled.prompt_ids.shape[1] - 1 : -1]
        trainer = token_logprobs_and_entropy(logits, sampled.completion_ids.to(device), temperature,
                                             1024).logprobs.cpu()
    return (trainer - sampled.logprobs)[valid].abs().mean().item()


def float32_policy(path: str, device: str):
    """The checkpoint's tokenizer and float32 policy, four addition prompts, the stop ids and greedy settings."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    if policy.generation_config.pad_token_id is None:
        policy.generation_config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    prompts = [tokenizer(text).input_ids for text in ("12+30=", "7+8=", "40+9=", "3+3=")]
    stop_ids = resolve_stop_token_ids(tokenizer, policy.generation_config)
    greedy = SamplingConfig(max_new_tokens=6, greedy=True, stop_token_ids=stop_ids)
    return tokenizer, policy, prompts, stop_ids, greedy


def check_processed_logprobs(engine, policy, prompts, stop_ids, device: str, check) -> None:
    """Check 3: sampled at temperature 1.0 and 0.7, the engine's log-probs equal the trainer's (mean gap < 1e-2)."""
    for temperature in (1.0, 0.7):
        sampled = engine.generate(prompts, 4, SamplingConfig(max_new_tokens=6, temperature=temperature,
                                                             stop_token_ids=stop_ids))
        gap = logprob_gap(policy, sampled, temperature, device)
        check(f"3 processed log-probs at T={temperature} equal the trainer's", gap < 1e-2, f"mean gap {gap:.2e}")


def teach_another_answer(policy, tokenizer, prompt: list[int], device: str) -> None:
    """30 supervised steps teaching ``prompt`` the answer "99": the policy's greedy completions change."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    target = tokenizer("99", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    for _ in range(30):
        ids = torch.tensor([prompt + target] * 4, device=device)
        logits = policy(input_ids=ids).logits[:, len(prompt) - 1 : -1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.tensor(target * 4, device=device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def checkpoint(args) -> str:
    if args.model:
        return resolve_model(args.model)[0]  # a directory, or a packaged built-in model's cache
    if args.chat:
        return build_tiny_chat_model(tempfile.mkdtemp())
    return build_tiny_model(tempfile.mkdtemp(), TinyModelConfig(hidden_size=256, num_hidden_layers=4,
                                                                intermediate_size=512))


def one_gpu(path: str, device: str = "cuda") -> list[str]:
    """Checks 1-4; returns the failures (``device``: ``cpu`` only to dry-run the script against a vLLM stand-in)."""
    tokenizer, policy, prompts, stop_ids, greedy = float32_policy(path, device)
    engine = VLLMEngine(dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True, enable_sleep_mode=True)
    reference = HFEngine()
    failures: list[str] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        print(("PASS " if ok else "FAIL ") + name + (f" ({detail})" if detail else ""), flush=True)
        if not ok:
            failures.append(name)

    with torch.inference_mode():  # as Lightning's sanity validation would build it
        engine.sync(policy, 0)
        reference.sync(policy, 0)
        before = completions(engine.generate(prompts, 1, greedy))
        check("1a built under inference mode: greedy equals generate",
              before == completions(reference.generate(prompts, 1, greedy)))
    engine.release()

    teach_another_answer(policy, tokenizer, prompts[0], device)
    engine.sync(policy, 1)  # outside inference mode, into weights first created inside it
    after = completions(engine.generate(prompts, 1, greedy))
    check("2a the update reached vLLM", after != before, f"before {before}, after {after}")
    check("2b greedy equals generate after the update", after == completions(reference.generate(prompts, 1, greedy)))

    check_processed_logprobs(engine, policy, prompts, stop_ids, device, check)

    engine.sleep_level = 2  # the same engine (one sleep-mode engine per process): discard the weights this time
    engine.release()
    again = completions(engine.generate(prompts, 1, greedy))
    check("4 after a level-2 sleep the weights are pushed again", again == after, f"{again} vs {after}")
    return failures


DDP_RESULT = "VLLM_SMOKE_DDP_RESULT"


def two_gpus(path: str) -> list[str]:
    """Check 5: a 2-step fit on two GPUs started by Lightning's launcher (this script runs again for rank 1)."""
    import lightning.pytorch as pl

    from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
    from lightning_rlvr.loggers import InMemoryLogger

    engine = VLLMEngine(dtype="float32", gpu_memory_utilization=0.25, enforce_eager=True, enable_sleep_mode=True)
    data = RolloutDataModule(source=BuiltinTask("addition", warm_start_fraction=0.0), engine=engine,
                             prompts_per_step=4, group_size=4, max_new_tokens=4, val_samples=0)
    logger = InMemoryLogger()
    trainer = pl.Trainer(accelerator="gpu", devices=2, strategy="ddp", max_steps=2, logger=logger,
                         enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                         num_sanity_val_steps=0, log_every_n_steps=1)
    trainer.fit(RLVRModule(model=path), data)
    kl = list(logger.history["rollout/engine_kl"].values())
    Path(os.environ[DDP_RESULT]).with_suffix(f".rank{trainer.global_rank}").write_text(json.dumps(kl))
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local Hugging Face checkpoint or builtin:smollm2-135m-instruct "
                                        "(default: the built-in tiny model)")
    parser.add_argument("--chat", action="store_true", help="the built-in chat model (two stop ids) instead")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a dry run on a vLLM stand-in
    parser.add_argument("--ddp", help=argparse.SUPPRESS)  # the 2-GPU fit: a checkpoint path, run by check 5
    args = parser.parse_args()
    if args.ddp:
        two_gpus(args.ddp)
        return 0
    path = checkpoint(args)
    failures = one_gpu(path, args.device)
    if torch.cuda.device_count() < 2:
        print("SKIP 5 two GPUs through Lightning's launcher (one GPU here)")
    else:
        result = Path(tempfile.mkdtemp()) / "ddp"
        run = subprocess.run([sys.executable, __file__, "--ddp", path], env={**os.environ, DDP_RESULT: str(result)},
                             capture_output=True, text=True, timeout=600)
        kls = [json.loads(result.with_suffix(f".rank{r}").read_text()) for r in range(2)
               if result.with_suffix(f".rank{r}").exists()]
        ok = run.returncode == 0 and len(kls) == 2 and all(abs(v) < 1e-2 for kl in kls for v in kl)
        print(("PASS" if ok else "FAIL") + f" 5 two GPUs through Lightning's launcher (engine_kl {kls})")
        if not ok:
            print(run.stderr[-3000:])
            failures.append("5")
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
