"""The completions table in MLflow, and per-component rewards, after a real fit on the two-stop-id chat model.

The engine is scripted, so every completion, its stop and its verdict are known in advance: the table read back with
``mlflow.load_table`` must show the text before the first stop id (either of ``builtin:tiny-chat``'s two), the
tokens trained on, the verifier's verdict and named reward components, and the entropy of the policy that generated
it (checked at step 0 against ``torch.distributions`` on a fresh load of the same checkpoint).
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import MLFlowLogger
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_rlvr import RLVRModule, RolloutDataModule
from lightning_rlvr.loggers import completions_artifact
from lightning_rlvr.tasks import Problem
from lightning_rlvr.verifiers import CallableVerifier
from tests.conftest import ListSource, ScriptedEngine

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def correctness_and_format(completion: str, answer: str) -> dict[str, float]:
    return {"correct": float(completion == answer), "format": 0.1 if completion.isdigit() else 0.0}


@pytest.fixture(scope="module")
def fitted(tiny_chat_dir, tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_dir)
    im_end, endoftext = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))

    def text(string: str) -> list[int]:
        return tokenizer(string, add_special_tokens=False).input_ids

    script = [
        text("12") + [im_end],                        # stops on the tokenizer's EOS: correct
        text("12") + [endoftext, im_end] + text("7"),  # stops on the other stop id; nothing after it counts
        text("1234567"),                              # no stop within max_new_tokens: truncated, not verified
        text("13") + [endoftext],                     # stops, wrong answer
    ]
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    logger = MLFlowLogger(experiment_name="completions", tracking_uri=uri)
    module = RLVRModule(model=tiny_chat_dir, learning_rate=1e-3, log_completions_every_n_steps=2,
                        log_completions_max_rows=8)
    data = RolloutDataModule(
        source=ListSource([Problem("5+7=", "12"), Problem("6+6=", "12")]),
        engine=ScriptedEngine(script, pad_id=tokenizer.pad_token_id), chat_template=True, max_new_tokens=4,
        prompts_per_step=2, group_size=4, val_samples=0,
        verifier=CallableVerifier(correctness_and_format, isolation="inline"),
    )
    trainer = pl.Trainer(accelerator="cpu", max_steps=5, log_every_n_steps=1, logger=logger, limit_val_batches=0,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    return dict(uri=uri, run_id=logger.run_id, tokenizer=tokenizer, text=text, dir=tiny_chat_dir)


@pytest.fixture(scope="module")
def tables(fitted, tmp_path_factory):
    """Each logged step's table, read back with ``MlflowClient.load_table``, and as its artifact's own JSON
    (``load_table`` parses with pandas, which turns an all-digit text such as "12" into a number)."""
    import json

    import mlflow
    import pandas as pd
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=fitted["uri"])
    experiment = client.get_experiment_by_name("completions").experiment_id
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(fitted["uri"])  # load_table searches runs through the global tracking URI
    try:
        loaded = {step: client.load_table(experiment, completions_artifact(step), run_ids=[fitted["run_id"]])
                  for step in (0, 2, 4)}
    finally:
        mlflow.set_tracking_uri(previous)
    stored = {}
    for step in loaded:
        path = client.download_artifacts(fitted["run_id"], completions_artifact(step),
                                         str(tmp_path_factory.mktemp("artifact")))
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
        stored[step] = pd.DataFrame(content["data"], columns=content["columns"])
    return loaded, stored


def test_a_table_every_n_steps_with_its_columns(tables, fitted):
    from mlflow.tracking import MlflowClient

    logged = [a.path for a in MlflowClient(tracking_uri=fitted["uri"]).list_artifacts(fitted["run_id"], "completions")]
    assert logged == [completions_artifact(step) for step in (0, 2, 4)]  # steps 0, 2, 4 of 5
    loaded, _ = tables
    for step, table in loaded.items():
        assert list(table.columns) == ["step", "group", "prompt", "completion", "reward", "verdict",
                                       "response_length", "entropy_mean", "reward/correct", "reward/format"]
        assert table["step"].tolist() == [step] * 8
        assert table["group"].tolist() == [0] * 4 + [1] * 4


def test_completions_are_cut_at_the_stop_and_scored_as_the_verifier_saw_them(tables, fitted):
    loaded, stored = tables
    four_tokens = fitted["tokenizer"].decode(fitted["text"]("1234567")[:4])
    length_12, length_13 = len(fitted["text"]("12")) + 1, len(fitted["text"]("13")) + 1
    for step, rows in stored.items():
        assert rows.shape == loaded[step].shape
        assert rows["completion"].tolist() == ["12", "12", four_tokens, "13"] * 2
        assert rows["verdict"].tolist() == ["correct", "correct", "truncated", "wrong"] * 2
        assert rows["response_length"].tolist() == [length_12, length_12, 4, length_13] * 2
        assert rows["reward/correct"].tolist() == [1.0, 1.0, 0.0, 0.0] * 2
        assert rows["reward/format"].tolist() == pytest.approx([0.1, 0.1, 0.0, 0.1] * 2)
        assert rows["reward"].tolist() == pytest.approx([1.1, 1.1, 0.0, 0.1] * 2)
        assert not any("<|" in completion for completion in rows["completion"])
    prompts = stored[0]["prompt"].tolist()  # the two prompts, each over its whole group, in the sampler's order
    assert len(set(prompts[:4])) == 1 and len(set(prompts[4:])) == 1
    assert {prompts[0], prompts[4]} == {"<|im_start|>user\n5+7=<|im_end|>\n<|im_start|>assistant\n",
                                        "<|im_start|>user\n6+6=<|im_end|>\n<|im_start|>assistant\n"}


def test_entropy_mean_is_the_generating_policys_mean_token_entropy(tables, fitted):
    model = AutoModelForCausalLM.from_pretrained(fitted["dir"])  # the policy before its first update
    tokenizer = fitted["tokenizer"]
    first = tables[1][0].iloc[0]
    prompt = tokenizer(first["prompt"], add_special_tokens=False).input_ids
    completion = fitted["text"]("12") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    predicting = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    expected = torch.distributions.Categorical(logits=predicting).entropy().mean().item()
    assert first["entropy_mean"] == pytest.approx(expected, rel=1e-4)


def test_each_reward_component_is_logged_as_its_batch_mean(fitted):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=fitted["uri"])

    def history(name: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(fitted["run_id"], name), key=lambda m: m.step)]

    # Per step, 8 rows: 4 correct answers (1 each), 6 all-digit verified answers (0.1 each), 2 truncated rows (0).
    assert history("reward/correct") == [0.5] * 5
    assert history("reward/format") == pytest.approx([0.075] * 5)
    assert history("reward/mean") == pytest.approx([0.575] * 5)
    assert all(math.isfinite(v) for v in history("reward/mean"))
