"""LoRA policies through Hugging Face ``peft`` (``pip install 'lightning_rlvr[lora]'``).

``RLVRModule(lora=LoRA(rank=16))`` wraps the policy in a LoRA adapter: only the adapter's parameters train and
reach the optimizer, the reference of a KL term (or of EP-GRPO) is the same module with the adapter switched off
(no second model), checkpoints hold the adapter (megabytes, not the base weights), and a rollout engine that keeps
its own copy of the weights (vLLM) receives them merged, ``W + (α/r)·B·A``, under the base model's names.

Example::

    >>> LoRA(rank=8, alpha=16).as_peft_config().r
    8
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_rlvr.sharding import is_dtensor

__all__ = ["DEFAULT_TARGET_MODULES", "LoRA", "adapter_state", "attach_lora", "is_lora", "merge_adapter_state",
           "merged_weights", "reset_adapter"]

# The attention and MLP projections of Llama / Qwen / Mistral-style blocks.
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER = "default"  # peft's name of the (single) trained adapter


@dataclass
class LoRA:
    """The LoRA adapter of a policy (``peft.LoraConfig``'s fields that matter for RL, plus where to start from).

    Attributes:
        rank: ``r``, the rank of ``B·A``.
        alpha: ``α``; the update is scaled by ``α / r`` (``α / √r`` with ``rslora``).
        dropout: dropout on the adapter's input while training. It makes the training forward stochastic, so the
            PPO ratio of an on-policy token is no longer exactly 1: 0 (default) is what RL wants.
        target_modules: module names that get an adapter (default: attention and MLP projections), or
            ``"all-linear"``.
        modules_to_save: modules trained in full besides the adapters (e.g. ``["lm_head"]``).
        rslora: rank-stabilised scaling ``α / √r``.
        adapter_path: an existing PEFT adapter directory to continue training from (``rank``, ``alpha``, targets
            then come from its ``adapter_config.json``).
        seed: seed of the adapter's initialisation (``A`` is random, ``B`` zero): the same adapter on every rank,
            in every run.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    modules_to_save: list[str] | None = None
    rslora: bool = False
    adapter_path: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA: rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA: alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA: dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            raise ValueError(f"LoRA: target_modules must be a list of module names or 'all-linear', "
                             f"got {self.target_modules!r}")
        if not isinstance(self.target_modules, str) and not self.target_modules:
            raise ValueError("LoRA: target_modules is empty: no module would get an adapter")

    def as_peft_config(self):
        """The equivalent ``peft.LoraConfig``."""
        from peft import LoraConfig

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          modules_to_save=self.modules_to_save, use_rslora=self.rslora, task_type="CAUSAL_LM")


def _peft():
    try:
        import peft
    except ImportError as err:
        raise ImportError("LoRA policies need peft: pip install 'lightning_rlvr[lora]'") from err
    return peft


def attach_lora(model: nn.Module, lora: LoRA) -> nn.Module:
    """``model`` wrapped in its LoRA adapter (new, or loaded from ``lora.adapter_path``), only the adapter trainable.

    The adapter is initialised under ``lora.seed`` in a forked RNG: the run's random streams are untouched.
    """
    peft = _peft()
    tied = getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None
    adapted = (["all-linear"] if isinstance(lora.target_modules, str) else list(lora.target_modules)) + list(
        lora.modules_to_save or [])
    if tied and any(name in ("lm_head", "embed_tokens") for name in adapted):
        # The head *is* the embedding matrix: an adapter merged into one (vLLM's weights, a warm start, export) would
        # change the other, and vLLM, which aliases them, would drop the head's name.
        raise ValueError(f"LoRA: {type(model).__name__} ties its output head to its input embeddings; an adapter or "
                         f"a trained copy of lm_head / embed_tokens cannot be merged into one without the other")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(lora.seed)
        if lora.adapter_path is not None:
            wrapped = peft.PeftModel.from_pretrained(model, lora.adapter_path, is_trainable=True)
        else:
            wrapped = peft.get_peft_model(model, lora.as_peft_config())
    if any(getattr(config, "use_dora", False) for config in wrapped.peft_config.values()):
        raise ValueError("LoRA: DoRA adapters are not supported (their merged weight is not W + scale·B·A)")
    return wrapped


def is_lora(model: nn.Module | None) -> bool:
    """Whether ``model`` is a ``peft`` model (a LoRA-wrapped policy)."""
    return model is not None and hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.get_base_model().named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name, module


def _full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def _delta(layer: nn.Module, lora_a: Tensor, lora_b: Tensor) -> Tensor:
    """``scale · B·A`` in the base weight's layout."""
    delta = (lora_b.float() @ lora_a.float()) * layer.scaling[ADAPTER]
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


def merged_weights(model: nn.Module, bucket_bytes: int = 256 * 2**20,
                   with_adapter: bool = True) -> Iterator[list[tuple[str, Tensor]]]:
    """The policy as a plain checkpoint: each adapted weight merged (``W + scale·B·A``, computed out of place, so
    the trained weights never drift), adapter tensors left out, every name the base model's own
    (``model.layers.0.self_attn.q_proj.weight``), in buckets of about ``bucket_bytes``. ``with_adapter=False``:
    the base weights alone (what an engine that applies the adapter itself needs).

    FSDP2 shards are gathered (a collective: every rank iterates to the end).
    """
    base = model.get_base_model()
    layers = dict(_lora_layers(model))
    saved = {name for name, module in base.named_modules() if type(module).__name__ == "ModulesToSaveWrapper"}
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, parameter in base.named_parameters():
        if ".lora_" in name or any(name.startswith(f"{s}.original_module.") for s in saved):
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer") and owner[: -len(".base_layer")] in layers:
            layer = layers[owner[: -len(".base_layer")]]
            tensor = _full(parameter).detach()
            if leaf == "weight" and with_adapter:
                delta = _delta(layer, _full(layer.lora_A[ADAPTER].weight), _full(layer.lora_B[ADAPTER].weight))
                tensor = (tensor.float() + delta).to(tensor.dtype)
            name = f"{owner[: -len('.base_layer')]}.{leaf}"
        else:
            for s in saved:
                if name.startswith(f"{s}.modules_to_save.{ADAPTER}."):
                    name = f"{s}.{name[len(f'{s}.modules_to_save.{ADAPTER}.'):]}"
            tensor = _full(parameter).detach()
        if bucket and size + tensor.numel() * tensor.element_size() > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    if bucket:
        yield bucket


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapter's trainable tensors (LoRA ``A``/``B``, ``modules_to_save`` copies), by parameter name."""
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters() if parameter.requires_grad}


@torch.no_grad()
def merge_adapter_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Add an adapter (``state`` from :func:`adapter_state`) into the base weights, in place: ``W += scale·B·A``;
    ``modules_to_save`` copies become the original modules. The model's own adapter is left as it is."""
    prefix = "base_model.model."
    parameters = dict(model.named_parameters())
    for name, layer in _lora_layers(model):
        a, b = (state.get(f"{prefix}{name}.lora_{part}.{ADAPTER}.weight") for part in ("A", "B"))
        if a is None or b is None:
            raise KeyError(f"the adapter state has no LoRA weights for {name}")
        weight = layer.get_base_layer().weight
        weight.add_(_delta(layer, a.to(weight.device), b.to(weight.device)).to(weight.dtype))
    for key, value in state.items():
        if f".modules_to_save.{ADAPTER}." in key:
            original = key.replace(f".modules_to_save.{ADAPTER}.", ".original_module.")
            parameters[original].copy_(value)
    model.merged_adapter_count = getattr(model, "merged_adapter_count", 0) + 1  # engines re-send the base


@torch.no_grad()
def reset_adapter(model: nn.Module, seed: int) -> None:
    """Start the adapter afresh (``A`` re-drawn under ``seed``, ``B = 0``: the policy is the base model again)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _, layer in _lora_layers(model):
            layer.reset_lora_parameters(ADAPTER, init_lora_weights=True)
    for name, module in model.get_base_model().named_modules():
        if type(module).__name__ == "ModulesToSaveWrapper":
            module.modules_to_save[ADAPTER].load_state_dict(module.original_module.state_dict())


def as_dict(lora: LoRA | dict | None) -> dict[str, Any] | None:
    """``lora`` as plain data (hyperparameters that load with ``weights_only=True``), validated."""
    if lora is None:
        return None
    settings = dataclasses.asdict(lora) if isinstance(lora, LoRA) else dict(lora)
    return dataclasses.asdict(LoRA(**settings))
