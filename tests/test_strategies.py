"""What lightning_rlvr owns under Lightning's strategies, checked on the CPU.

The multi-rank fits (DDP, FSDP2) are in ``tests/test_distributed_fit.py``; DeepSpeed trains on CUDA GPUs only
(Lightning's DeepSpeedStrategy refuses CPUs), so here: its config builds, ``max_grad_norm`` becomes DeepSpeed's
``gradient_clipping``, ZeRO-3 loading is switched on for transformers, and what cannot work is refused clearly.
The GPU runs are ``scripts/gpu_check_strategies.py``.
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy

from lightning_rlvr import RLVRModule
from lightning_rlvr.callbacks import SupervisedWarmStart
from lightning_rlvr.cli import build_cli
from lightning_rlvr.training.loading import prepare_deepspeed
from lightning_rlvr.sharding import block_classes, full_weights, global_grad_norm, is_sharded

ROOT = Path(__file__).resolve().parents[1]


def test_full_weights_of_a_replicated_model_are_its_parameters_in_buckets_of_at_most_the_given_size():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))  # 48, 12, 24, 8 bytes
    buckets = list(full_weights(model, bucket_bytes=40))  # a tensor larger than a bucket goes alone
    assert [[name for name, _ in bucket] for bucket in buckets] == [["0.weight"], ["0.bias", "1.weight"], ["1.bias"]]
    for bucket in buckets:
        assert sum(t.numel() * t.element_size() for _, t in bucket) <= 40 or len(bucket) == 1
    named = dict(model.named_parameters())
    assert all(tensor is named[name].data or torch.equal(tensor, named[name]) for b in buckets for name, tensor in b)
    assert not is_sharded(model)
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(full_weights(model, bucket_bytes=0))


def test_global_grad_norm_of_replicated_gradients_matches_torch_clip_grad_norm():
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 1))
    model(torch.randn(7, 5)).square().sum().backward()
    parameters = list(model.parameters())
    ours = global_grad_norm(parameters)
    reference = torch.nn.utils.clip_grad_norm_(parameters, max_norm=float("inf"))
    torch.testing.assert_close(ours, reference)
    assert global_grad_norm([torch.nn.Parameter(torch.zeros(2))]).item() == 0.0  # no gradient yet


def test_block_classes_are_the_hugging_face_no_split_modules(tiny_model_dir):
    module = RLVRModule(model=tiny_model_dir)
    module.configure_model()
    assert [cls.__name__ for cls in block_classes(module.policy)] == ["LlamaDecoderLayer"]
    with pytest.raises(ValueError, match="transformer blocks"):
        block_classes(torch.nn.Linear(2, 2))


def test_fsdp1_strategy_is_refused_with_a_pointer_to_fsdp2(tiny_model_dir):
    module = RLVRModule(model=tiny_model_dir)
    module._trainer = types.SimpleNamespace(strategy=FSDPStrategy())  # Lightning's FSDP1 needs a GPU to get this far
    with pytest.raises(ValueError, match="ModelParallelStrategy"):
        module.configure_model()


requires_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                        reason="needs deepspeed: pip install -e '.[deepspeed]'")


def deepspeed_cli(*overrides: str):
    return build_cli(["--config", str(ROOT / "configs/deepspeed_zero3.yaml"), "--trainer.accelerator", "cpu",
                      "--trainer.devices", "1", "--trainer.logger", "false", *overrides], run=False)


def attach(cli) -> None:
    """What Trainer.fit does before ``configure_model``: connect the module, format the DeepSpeed config."""
    cli.model.trainer = cli.trainer
    cli.trainer.strategy.connect(cli.model)
    cli.trainer.strategy._init_config_if_needed()


@requires_deepspeed
def test_deepspeed_config_builds_a_zero3_strategy_that_never_checkpoints_the_reference():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    cli = deepspeed_cli()
    strategy = cli.trainer.strategy
    assert isinstance(strategy, DeepSpeedStrategy)
    assert strategy.zero_stage_3 and strategy.exclude_frozen_parameters
    assert cli.model.hparams.kl_coef > 0 and cli.model.hparams.max_grad_norm == 1.0


@requires_deepspeed
def test_max_grad_norm_becomes_deepspeed_gradient_clipping_and_zero3_switches_on_transformers_loading():
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    cli = deepspeed_cli("--model.max_grad_norm", "0.7")
    attach(cli)
    hf_config = prepare_deepspeed(cli.trainer.strategy, cli.model.hparams.max_grad_norm)
    assert cli.trainer.strategy.config["gradient_clipping"] == 0.7
    assert is_deepspeed_zero3_enabled()  # from_pretrained now loads into ZeRO-3 partitions
    del hf_config
    assert not is_deepspeed_zero3_enabled()  # only while the models load

    zero2 = deepspeed_cli("--trainer.strategy.init_args.stage", "2")
    attach(zero2)
    assert prepare_deepspeed(zero2.trainer.strategy, zero2.model.hparams.max_grad_norm) is None


@requires_deepspeed
def test_a_conflicting_deepspeed_gradient_clipping_is_refused_naming_max_grad_norm():
    cli = deepspeed_cli()
    attach(cli)
    cli.trainer.strategy.config["gradient_clipping"] = 5.0
    with pytest.raises(ValueError, match="max_grad_norm"):
        prepare_deepspeed(cli.trainer.strategy, cli.model.hparams.max_grad_norm)


@requires_deepspeed
def test_deepspeed_refuses_cpus_at_fit_time(tiny_model_dir):
    cli = deepspeed_cli("--model.model", tiny_model_dir)
    with pytest.raises(RuntimeError, match="only supported on CUDA GPUs"):
        cli.trainer.fit(cli.model, cli.datamodule)


@requires_deepspeed
def test_supervised_warm_start_refuses_deepspeed():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    trainer = types.SimpleNamespace(strategy=DeepSpeedStrategy(stage=2))
    with pytest.raises(ValueError, match="DeepSpeed"):
        SupervisedWarmStart(steps=1).on_fit_start(trainer, types.SimpleNamespace())


@requires_deepspeed
def test_lora_under_zero3_is_refused_with_the_reason():
    pytest.importorskip("peft")
    cli = deepspeed_cli("--model.lora", "{rank: 4}")
    attach(cli)
    with pytest.raises(ValueError, match="LoRA under DeepSpeed ZeRO-3 is not supported"):
        cli.model.configure_model()
