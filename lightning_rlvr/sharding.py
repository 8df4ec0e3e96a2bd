"""How the policy and the reference live under Lightning's strategies: single device, DDP, FSDP2, DeepSpeed ZeRO.

lightning_rlvr has no strategy of its own; this module holds the few things a sharded *RL* model needs beyond
what Lightning's strategies do for a supervised one:

- :func:`fsdp2_shard`: FSDP2 (``torch.distributed.fsdp.fully_shard``) applied in ``configure_model`` under
  Lightning's ``ModelParallelStrategy`` — each transformer block (the classes the Hugging Face model lists in
  ``_no_split_modules``) is its own unit, then the root. The policy stays a plain Hugging Face module whose
  forward hooks gather the parameters, so ``policy.generate`` and every log-prob pass work unchanged.
- :func:`is_sharded`: whether a forward pass is a collective (FSDP2 or ZeRO-3). Then every rank must run the
  same number of forwards: generation uses ``synced_gpus`` and dynamic sampling runs its rounds in lockstep.
- :func:`full_weights`: the full (unsharded) tensors of a model, name by name and in buckets, for a rollout engine
  that holds its own copy of the weights (vLLM): ``DTensor.full_tensor()`` under FSDP2,
  ``deepspeed.zero.GatheredParameters`` under ZeRO-3, the parameters themselves otherwise. A collective on
  sharded models: every rank iterates it to the end.
- :func:`global_grad_norm`: the L2 norm of the *global* gradient when gradients are FSDP2 shards.

Example::

    >>> import torch
    >>> model = torch.nn.Linear(3, 2)
    >>> [[name for name, _ in bucket] for bucket in full_weights(model)]
    [['weight', 'bias']]
    >>> is_sharded(model)
    False
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["block_classes", "fsdp2_shard", "full_weights", "global_grad_norm", "is_dtensor", "is_sharded", "is_zero3", "strategy_shards"]


try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without distributed support: nothing can be a DTensor
    DTensor = ()


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 shard)."""
    # Imported once above: an import statement here cost ~1.5 us a call, ~0.1 ms a step of the tiny model.
    return isinstance(tensor, DTensor)


def is_zero3(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are partitioned by DeepSpeed ZeRO-3 (they carry a ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are sharded across ranks (FSDP2 ``DTensor`` or ZeRO-3 partitions).

    A forward pass of a sharded module gathers parameters from every rank: all ranks must run it together.
    """
    return any(is_dtensor(p) or hasattr(p, "ds_id") for p in module.parameters())


def strategy_shards(strategy) -> bool:
    """Whether a Lightning strategy shards the policy across ranks (FSDP, FSDP2's ``ModelParallelStrategy``, DeepSpeed
    ZeRO-3): known at ``setup``, before the policy is sharded in ``configure_model``."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
        return strategy.world_size > 1
    return isinstance(strategy, DeepSpeedStrategy) and bool(getattr(strategy, "zero_stage_3", False))


def block_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The transformer-block classes of a Hugging Face model (its ``_no_split_modules``), found in ``model``.

    Raises:
        ValueError: if the model names none, or none of them occurs in it (then FSDP would make one giant unit).
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = tuple({type(m) for m in model.modules() if type(m).__name__ in names})
    if not found:
        raise ValueError(f"{type(model).__name__}: cannot find its transformer blocks for FSDP (the model's "
                         f"_no_split_modules is {sorted(names) or 'empty'}); FSDP2 needs one unit per block")
    return found


def fsdp2_shard(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to each transformer block of ``model``, then to ``model`` itself (in place).

    One unit per block bounds the gathered parameters to a block at a time (plus the root's embeddings and
    head); the root unit makes ``model(...)`` and ``model.generate(...)`` gather what they need through forward
    hooks. A model whose parameters are all frozen (the reference) is sharded the same way and only ever runs
    forward passes.

    Args:
        model: a Hugging Face causal LM (anything with ``_no_split_modules``).
        mesh: the 1-D data-parallel ``DeviceMesh`` (``self.device_mesh["data_parallel"]`` in a LightningModule).
        reshard_after_forward: free gathered parameters after each block's forward (ZeRO-3-like, least memory);
            ``False`` keeps them until backward (ZeRO-2-like, fewer all-gathers).
    """
    from torch.distributed.fsdp import fully_shard

    classes = block_classes(model)
    for module in list(model.modules()):
        if isinstance(module, classes):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def full_weights(model: nn.Module, bucket_bytes: int = 256 * 2**20) -> Iterator[list[tuple[str, Tensor]]]:
    """Yield ``model``'s full parameters as buckets of ``(name, tensor)``, each bucket at most ``bucket_bytes``.

    Names are the model's own (``model.layers.0.self_attn.q_proj.weight``), as a Hugging Face checkpoint or
    ``vllm``'s ``load_weights`` expects them. Tensors are full on every rank: FSDP2 shards are all-gathered
    (``DTensor.full_tensor``), ZeRO-3 partitions are gathered for the duration of the bucket
    (``GatheredParameters``), plain parameters are yielded as they are. The tensors of a bucket are valid until
    the next bucket is requested (under ZeRO-3 they are released then): copy what must outlive it.

    On a sharded model this is a collective: every rank must iterate it to the end.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    named = list(model.named_parameters())
    buckets: list[list[tuple[str, nn.Parameter]]] = [[]]
    size = 0
    for name, parameter in named:
        nbytes = _full_numel(parameter) * parameter.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, parameter))
        size += nbytes
    zero3 = any(hasattr(p, "ds_id") for _, p in named)
    for bucket in buckets:
        if not bucket:
            continue
        if zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
                yield [(name, p.data) for name, p in bucket]
        else:
            yield [(name, p.full_tensor() if is_dtensor(p) else p.data) for name, p in bucket]


def _full_numel(parameter: nn.Parameter) -> int:
    if hasattr(parameter, "ds_numel"):  # a ZeRO-3 partition's full size
        return int(parameter.ds_numel)
    return parameter.numel()  # a DTensor's numel is its global size


def global_grad_norm(parameters: list[nn.Parameter]) -> Tensor:
    """L2 norm of the full gradient of ``parameters`` (FSDP2 ``DTensor`` shards are reduced across ranks).

    A collective when gradients are ``DTensor`` shards: every rank must call it. ``0`` when no gradient exists.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    if any(is_dtensor(g) for g in grads):
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)  # DTensor-aware
        return norm.full_tensor() if is_dtensor(norm) else norm
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
