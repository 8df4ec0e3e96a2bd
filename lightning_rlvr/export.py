"""``lightning_rlvr export``: a training checkpoint as files other tools load.

    lightning_rlvr export --ckpt_path path/to/last.ckpt --output exported/            # LoRA: a PEFT adapter
    lightning_rlvr export --ckpt_path path/to/last.ckpt --output exported/ --merged   # and the merged model

- A LoRA policy becomes a standard PEFT adapter directory (``exported/adapter``: ``adapter_config.json`` and
  ``adapter_model.safetensors``) over the checkpoint's base model, which ``peft.PeftModel.from_pretrained`` and
  vLLM's LoRA support load. An adapter a warm start merged into the base (``SupervisedWarmStart(reset_reference=
  True)``) is folded into it exactly: ``Σ_i s_i·B_i·A_i = [s_1 B_1, …, s_k B_k]·[A_1; …; A_k]``, an adapter of rank
  ``Σ r_i`` with scale 1.
- ``--merged`` (and any full fine-tuning checkpoint) writes ``exported/model``: a plain Hugging Face checkpoint with
  the tokenizer, for transformers and vLLM.
- A random-init built-in model's base (``builtin:tiny``, ``builtin:tiny-chat``) lives in a temporary directory: it is
  written to ``exported/base`` and the adapter points at it. ``builtin:smollm2-135m-instruct``'s adapter points at its
  cache directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lightning_rlvr.models import TINY_MODELS

__all__ = ["export_checkpoint", "main"]


def _load(ckpt_path: str):
    from lightning_rlvr.module import RLVRModule

    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    # LightningCLI adds its own entries (``_instantiator``, ``_class_path``) to the hyperparameters it saves
    arguments = {key: value for key, value in checkpoint["hyper_parameters"].items() if not key.startswith("_")}
    module = RLVRModule(**arguments)
    module.configure_model()
    module.on_load_checkpoint(checkpoint)
    result = module.load_state_dict(checkpoint["state_dict"], strict=False)
    policy_missing = [key for key in result.missing_keys if key.startswith("policy.")
                      and (module.hparams.lora is None or ".lora_" in key)]
    if policy_missing:
        raise ValueError(f"{ckpt_path}: the checkpoint lacks policy weights {policy_missing[:3]}…")
    return module


def _combined_adapter(module, base_path: str):
    """One PEFT adapter equal to every merged adapter plus the trained one, on a freshly loaded base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_rlvr.lora import ADAPTER, _lora_layers

    policy = module.policy
    states = [*module.merged_adapters, {n: p.detach() for n, p in policy.named_parameters() if p.requires_grad}]
    layers = dict(_lora_layers(policy))
    some_layer = next(iter(layers))
    rank = sum(int(state[f"base_model.model.{some_layer}.lora_A.{ADAPTER}.weight"].shape[0]) for state in states)
    settings = policy.peft_config[ADAPTER]
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=sorted({name.rsplit(".", 1)[-1] for name in layers}),
                        modules_to_save=settings.modules_to_save, task_type="CAUSAL_LM")
    exported = get_peft_model(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32), config)
    targets = dict(_lora_layers(exported))
    with torch.no_grad():
        for name, layer in layers.items():
            a = [state[f"base_model.model.{name}.lora_A.{ADAPTER}.weight"].float() for state in states]
            b = [state[f"base_model.model.{name}.lora_B.{ADAPTER}.weight"].float() * layer.scaling[ADAPTER]
                 for state in states]
            targets[name].lora_A[ADAPTER].weight.copy_(torch.cat(a, dim=0))
            targets[name].lora_B[ADAPTER].weight.copy_(torch.cat(b, dim=1))
        trained = dict(exported.named_parameters())
        for key, value in states[-1].items():
            if f".modules_to_save.{ADAPTER}." in key:
                trained[key].copy_(value)
    return exported


def export_checkpoint(ckpt_path: str, output: str, merged: bool = False) -> dict[str, str]:
    """Write the checkpoint's policy under ``output``; returns ``{"adapter" | "model" | "base": directory}``."""
    from transformers import AutoModelForCausalLM

    from lightning_rlvr.lora import is_lora

    module = _load(ckpt_path)
    output_dir = Path(output)
    written: dict[str, str] = {}
    lora = is_lora(module.policy)
    base_path = module.model_path
    if lora and module.hparams.model in TINY_MODELS:  # a temporary directory: keep a copy by the adapter
        base_path = written["base"] = str(output_dir / "base")
        AutoModelForCausalLM.from_pretrained(module.model_path).save_pretrained(base_path)
        module.tokenizer.save_pretrained(base_path)
    model = module.policy
    if lora:
        adapter = _combined_adapter(module, base_path)
        adapter.peft_config["default"].base_model_name_or_path = base_path
        adapter.save_pretrained(written.setdefault("adapter", str(output_dir / "adapter")))
        model = adapter.merge_and_unload() if merged else None
    if model is not None:
        model.save_pretrained(written.setdefault("model", str(output_dir / "model")))
        module.tokenizer.save_pretrained(written["model"])
    return written


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning_rlvr export", description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written during fit")
    parser.add_argument("--output", required=True, help="the directory to write into")
    parser.add_argument("--merged", action="store_true", help="also write the merged model (LoRA)")
    parsed = parser.parse_args(args)
    for kind, directory in export_checkpoint(parsed.ckpt_path, parsed.output, parsed.merged).items():
        print(f"{kind}: {directory}")
