"""GPU smoke test of VLLMEngine's weight sync, end to end (one GPU, about a minute; needs ``pip install vllm``).

    python scripts/gpu_smoke_vllm.py                       # the built-in tiny model, built offline
    python scripts/gpu_smoke_vllm.py --chat                # builtin:tiny-chat (byte-level BPE, two stop ids)
    python scripts/gpu_smoke_vllm.py --model /path/to/Qwen2.5-0.5B-Instruct

1. Start a colocated ``VLLMEngine`` from the policy's checkpoint and sync the policy (version 0).
2. Greedy-generate for a few prompts; the completions must equal Hugging Face ``generate`` on the same policy
   (float32 on both sides, so greedy decoding agrees token for token up to ties).
3. Change the policy in place (a few supervised steps toward another answer), sync version 1, generate again: the
   completions must change and again equal ``generate`` on the updated policy. If the sync did not reach vLLM's
   model, vLLM would still answer as in step 2.
4. Sampled completions' vLLM log-probs against the trainer's own log-probs of the same tokens: the mean absolute
   gap is printed (the sampler/trainer mismatch that ``RLVRModule(engine_is_cap=...)`` corrects).

Exit code 1 if a check fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_rlvr.models import TinyModelConfig, build_tiny_chat_model, build_tiny_model  # noqa: E402
from lightning_rlvr.ops import token_logprobs_and_entropy  # noqa: E402
from lightning_rlvr.rollout import HFEngine, SamplingConfig, VLLMEngine  # noqa: E402
from lightning_rlvr.rollout.stops import resolve_stop_token_ids  # noqa: E402


def completions(output) -> list[list[int]]:
    """Each completion as long as the engine says it is (through its stop id, if it stopped)."""
    return [ids[:length] for ids, length in zip(output.completion_ids.tolist(), output.lengths.tolist())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local Hugging Face checkpoint (default: the built-in tiny model)")
    parser.add_argument("--chat", action="store_true", help="the built-in chat model (two stop ids) instead")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = TinyModelConfig(hidden_size=256, num_hidden_layers=4, intermediate_size=512)
    build = build_tiny_chat_model if args.chat else build_tiny_model
    path = args.model or build(tempfile.mkdtemp(), shape if not args.chat else None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    if policy.generation_config.pad_token_id is None:
        policy.generation_config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    prompts = [tokenizer(text).input_ids for text in ("12+30=", "7+8=", "40+9=", "3+3=")]
    stop_ids = resolve_stop_token_ids(tokenizer, policy.generation_config)
    greedy = SamplingConfig(max_new_tokens=6, greedy=True, stop_token_ids=stop_ids)
    engine = VLLMEngine(dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True, enable_sleep_mode=True)
    reference = HFEngine()
    failures = []

    engine.sync(policy, 0)
    reference.sync(policy, 0)
    before = completions(engine.generate(prompts, 1, greedy))
    if before != completions(reference.generate(prompts, 1, greedy)):
        failures.append("version 0: vLLM's greedy completions differ from Hugging Face generate's")

    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    target = tokenizer("99", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    for _ in range(30):  # teach the first prompt the answer "99": the greedy completions change
        ids = torch.tensor([p + target for p in prompts[:1]] * 4, device="cuda")
        logits = policy(input_ids=ids).logits[:, len(prompts[0]) - 1 : -1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.tensor(target * 4, device="cuda"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    engine.sync(policy, 1)
    after = completions(engine.generate(prompts, 1, greedy))
    if after == before:
        failures.append("version 1: vLLM still answers as before the update (weights not synced)")
    if after != completions(reference.generate(prompts, 1, greedy)):
        failures.append("version 1: vLLM's greedy completions differ from Hugging Face generate's")

    sampled = engine.generate(prompts, 4, SamplingConfig(max_new_tokens=6, temperature=1.0, stop_token_ids=stop_ids))
    ids = torch.cat([sampled.prompt_ids, sampled.completion_ids], 1).cuda()
    mask = torch.cat([sampled.prompt_mask, torch.ones_like(sampled.completion_ids)], 1).cuda()
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # left padding: positions count real tokens, as in vLLM
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logits = logits[:, sampled.prompt_ids.shape[1] - 1 : -1]
        trainer = token_logprobs_and_entropy(logits, sampled.completion_ids.cuda(), 1.0, 1024).logprobs.cpu()
    width = sampled.completion_ids.shape[1]
    valid = torch.arange(width)[None, :] < sampled.lengths[:, None]
    gap = (trainer - sampled.logprobs)[valid].abs().mean().item()
    print(f"before: {before}\nafter:  {after}\nmean |log p_trainer - log p_vllm| on sampled tokens: {gap:.2e}")
    if gap > 1e-2:
        failures.append(f"vLLM's log-probs are far from the trainer's ({gap:.2e})")
    for failure in failures:
        print("FAIL", failure)
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
