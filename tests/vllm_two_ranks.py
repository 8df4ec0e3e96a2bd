"""A 2-rank CPU fit (gloo) with VLLMEngine on the vLLM stand-in, started by Lightning's own launcher, not torchrun.

    python tests/vllm_two_ranks.py MODEL_DIR OUT_DIR

Lightning runs this script again for rank 1 (its subprocess launcher sets ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``PORT`` but not ``RANK``). Each rank writes ``OUT_DIR/rank{r}.json``: what the engine was built with,
what the stand-in read from the environment, and the logged mismatch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402

from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule  # noqa: E402
from lightning_rlvr.loggers import InMemoryLogger  # noqa: E402
from lightning_rlvr.rollout import VLLMEngine  # noqa: E402
from lightning_rlvr.verifiers import CallableVerifier  # noqa: E402
from tests.fake_vllm import FakeLLM, fake_sampling_params  # noqa: E402


def reward_stopping(completion: str, answer: str) -> float:
    return 1.0


def main(model_dir: str, out_dir: str) -> None:
    pl.seed_everything(0, verbose=False)
    engine = VLLMEngine(llm_factory=FakeLLM, sampling_params_factory=fake_sampling_params, enable_sleep_mode=True,
                        logprobs_mode="processed_logprobs")
    data = RolloutDataModule(source=BuiltinTask("addition", warm_start_fraction=0.0), engine=engine,
                             verifier=CallableVerifier(reward_stopping), prompts_per_step=2, group_size=8,
                             max_new_tokens=40, val_samples=0, verifier_workers=1)
    logger = InMemoryLogger()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=logger,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1)
    trainer.fit(RLVRModule(model=model_dir, engine_is_cap=2.0), data)
    llm = engine.llm
    result = {"rank": trainer.global_rank, "world_size": trainer.world_size, "global_step": trainer.global_step,
              "backend": llm.kwargs.get("distributed_executor_backend"), "seed": llm.kwargs["seed"],
              "llm_rank": llm.rank, "llm_local_rank": llm.local_rank,
              "pushes": sum(call[0] == "load_weights" for call in llm.calls),
              "engine_kl": list(logger.history["rollout/engine_kl"].values())}
    (Path(out_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
