"""GPU smoke test of VLLMServerEngine against a real ``vllm serve`` (vLLM >= 0.21; two GPUs for the weight checks).

    python scripts/gpu_smoke_vllm_server.py              # the built-in tiny model, built offline; starts the server
    python scripts/gpu_smoke_vllm_server.py --chat       # builtin:tiny-chat (byte-level BPE, two stop ids)
    python scripts/gpu_smoke_vllm_server.py --model /path/to/Qwen2.5-0.5B-Instruct

The script starts ``VLLM_SERVER_DEV_MODE=1 vllm serve`` on the last GPU (``--weight-transfer-config
'{"backend": "nccl"}' --logprobs-mode processed_logprobs``, float32) and trains on GPU 0; ``--url`` uses a server
already running instead. Each check prints PASS or FAIL; the exit code is 1 if any failed. These are the checks a
CPU stand-in cannot make (tests/fake_vllm_server.py enforces the protocol; only a real server has vLLM's kernels,
its NCCL handshake and its ``load_weights``):

1. Generation over HTTP: greedy completions of the served checkpoint equal Hugging Face ``generate`` (float32 on both
   sides), with the server's stop ids; one GPU suffices (the server and the reference share it).
2. (Two GPUs: NCCL cannot put the trainer and a server worker on one device.) The NCCL weight push: after a few
   supervised steps toward another answer, a sync changes the server's greedy completions, and they equal
   ``generate`` of the trained policy.
3. Sampled at temperature 1.0 and 0.7, the server's processed log-probs equal the trainer's ``log_softmax(logits /
   T)`` of the same tokens (mean gap < 1e-2).
4. A 3-step fit at ``max_policy_lag=1``: the policy lag is 0, 1, 1 and ``rollout/engine_kl`` is near 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_smoke_vllm import (  # noqa: E402
    check_processed_logprobs,
    checkpoint,
    completions,
    float32_policy,
    teach_another_answer,
)

from lightning_rlvr.rollout import HFEngine, VLLMServerEngine  # noqa: E402


@contextlib.contextmanager
def vllm_server(path: str, gpu: int, port: int = 8765):
    """``vllm serve path`` on GPU ``gpu`` in dev mode with the NCCL weight transfer, until the block ends."""
    import requests

    command = ["vllm", "serve", path, "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
               "--gpu-memory-utilization", "0.3", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
               "--weight-transfer-config", '{"backend": "nccl"}']
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": str(gpu)}
    server = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not come up (exit code {server.poll()})")
            time.sleep(2)
        yield url
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=60)
        if server.poll() is None:
            server.kill()


def run_checks(path: str, url: str, device: str, push_weights: bool, engine_kwargs: dict) -> list[str]:
    tokenizer, policy, prompts, stop_ids, greedy = float32_policy(path, device)
    engine = VLLMServerEngine(url, **engine_kwargs)
    reference = HFEngine()
    reference.sync(policy, 0)
    failures: list[str] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        print(("PASS " if ok else "FAIL ") + name + (f" ({detail})" if detail else ""), flush=True)
        if not ok:
            failures.append(name)

    # 1: the served checkpoint as it is (no push): the HTTP generation path alone
    engine._start()
    engine.policy = policy
    served = completions(engine.generate(prompts, 1, greedy))
    check("1 greedy over HTTP equals generate", served == completions(reference.generate(prompts, 1, greedy)),
          f"{served}")
    if not push_weights:
        print("SKIP 2-4 the weight push (one GPU: NCCL cannot put the trainer and the server on one device)")
        return failures

    teach_another_answer(policy, tokenizer, prompts[0], device)
    start = time.perf_counter()
    engine.sync(policy, 1)
    seconds = time.perf_counter() - start
    after = completions(engine.generate(prompts, 1, greedy))
    check("2a the push reached the server", after != served, f"before {served}, after {after}; sync {seconds:.2f} s")
    check("2b greedy equals generate after the push", after == completions(reference.generate(prompts, 1, greedy)))
    check_processed_logprobs(engine, policy, prompts, stop_ids, device, check)
    lagged_fit(path, url, device, engine_kwargs, check)
    return failures


def lagged_fit(path: str, url: str, device: str, engine_kwargs: dict, check) -> None:
    import lightning.pytorch as pl

    from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
    from lightning_rlvr.loggers import InMemoryLogger

    data = RolloutDataModule(source=BuiltinTask("addition", warm_start_fraction=0.0), prompts_per_step=4,
                             group_size=4, max_new_tokens=4, val_samples=0, max_policy_lag=1,
                             engine=VLLMServerEngine(url, **engine_kwargs))
    logger = InMemoryLogger()
    trainer = pl.Trainer(accelerator="cpu" if device == "cpu" else "gpu", devices=1, max_steps=3, logger=logger,
                         enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                         num_sanity_val_steps=0, log_every_n_steps=1)
    trainer.fit(RLVRModule(model=path, engine_is_cap=2.0), data)
    lags = [logger.history["rollout/policy_lag"][s] for s in sorted(logger.history["rollout/policy_lag"])]
    kl = list(logger.history["rollout/engine_kl"].values())
    check("4 a fit at max_policy_lag=1", lags == [0.0, 1.0, 1.0] and all(abs(v) < 1e-2 for v in kl),
          f"lags {lags}, engine_kl {kl}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local Hugging Face checkpoint (default: the built-in tiny model)")
    parser.add_argument("--chat", action="store_true", help="the built-in chat model (two stop ids) instead")
    parser.add_argument("--url", help="a running server (dev mode, NCCL weight transfer) instead of starting one")
    parser.add_argument("--stand-in", action="store_true", help=argparse.SUPPRESS)  # CPU dry run on the stand-in
    args = parser.parse_args()
    path = checkpoint(args)
    if args.stand_in:
        from fake_vllm_server import FakeVLLMServer, GlooWeightTransport

        with FakeVLLMServer(path) as server:
            failures = run_checks(path, server.url, "cpu", True, {"transport_factory": GlooWeightTransport})
    else:
        gpus = torch.cuda.device_count()
        with contextlib.nullcontext(args.url) if args.url else vllm_server(path, gpus - 1) as url:
            failures = run_checks(path, url, "cuda:0", gpus >= 2 or bool(args.url), {})
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
