"""vLLM rollout engine, colocated: an in-process ``vllm.LLM`` on each rank, its weights pushed from the policy.

The production path on GPUs (``pip install 'lightning_rlvr[vllm]'``). Each rank holds its own engine
(tensor parallelism 1) sharing the GPU with the trainer, as TRL's and verl's colocated modes do
(``../shared/PEER_FRAMEWORKS.md`` §2):

- ``sync(policy, version)`` is called by the DataModule when the policy changed. It wakes the weights if the
  engine sleeps, then streams the policy's *full* weights into vLLM's model in buckets through the model's own
  ``load_weights`` (the path TRL, OpenRLHF and verl's workers use). The weights come from
  :func:`lightning_rlvr.sharding.full_weights`, which gathers FSDP2 shards and ZeRO-3 partitions, so every rank
  runs the sync. Then the prefix cache is reset, since cached KV blocks were computed by the old weights.
- ``generate`` wakes the KV cache, samples ``n`` completions per prompt with vLLM's ``SamplingParams`` built from
  the DataModule's sampling settings, returns vLLM's own log-probs of the sampled tokens, and (with
  ``enable_sleep_mode``) puts the engine to sleep, freeing its GPU memory for the update. vLLM stops on its
  tokenizer's EOS and its generation config's EOS ids by itself; the DataModule's stop ids are passed as
  ``stop_token_ids`` so that it stops on exactly the set the batch is cut at. Each row's length and whether it
  stopped come from vLLM's ``finish_reason`` (its ``token_ids`` include the stop id); a row vLLM stopped on an id
  outside that set is an error naming it.

vLLM's log-probs let the trainer measure the sampler/trainer mismatch (vLLM's kernels and precision are not the
trainer's); ``logprobs_mode="processed_logprobs"`` makes them the log-probs of the distribution actually sampled
from (after temperature), which is what the trainer computes.

Example::

    >>> engine = VLLMEngine(gpu_memory_utilization=0.3, enable_sleep_mode=True)  # the LLM starts at the first sync
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_rlvr.lora import is_lora, merged_weights
from lightning_rlvr.rng import preserved_rng_state
from lightning_rlvr.rollout.base import GenerationOutput, RolloutEngine, SamplingConfig
from lightning_rlvr.sharding import full_weights, is_sharded

__all__ = ["VLLMEngine"]

# Where vLLM keeps the model object whose `load_weights` takes (name, tensor) pairs, by engine generation:
# in-process V1 (the worker wraps the model runner), then V0.
_MODEL_PATHS = (
    ("llm_engine", "model_executor", "driver_worker", "worker", "model_runner", "model"),
    ("llm_engine", "model_executor", "driver_worker", "model_runner", "model"),
)


def _vllm_llm(**kwargs: Any):
    try:
        from vllm import LLM
    except ImportError as err:
        raise ImportError("VLLMEngine needs vLLM on a CUDA machine: pip install 'lightning_rlvr[vllm]' "
                          "(use HFEngine, the default, on CPUs)") from err
    return LLM(**kwargs)


def _vllm_sampling_params(**kwargs: Any):
    from vllm import SamplingParams

    return SamplingParams(**kwargs)


def _vllm_lora_request(**kwargs: Any):
    from vllm.lora.request import LoRARequest

    return LoRARequest(**kwargs)


def _vllm_lora_rank(policy: nn.Module) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts (its supported values) that holds the policy's adapter."""
    rank = max(config.r for config in policy.peft_config.values())
    return next(value for value in (8, 16, 32, 64, 128, 256, 320, 512) if value >= rank)


@contextlib.contextmanager
def _clean_context() -> Iterator[None]:
    """Where vLLM is built, fed and run: no inference mode, no autograd, no autocast, float32 default dtype.

    The engine is reached from inside Lightning's hooks: the first sync often happens in the sanity validation, under
    ``torch.inference_mode`` (vLLM's weights would become inference tensors, which no later in-place load may
    touch outside inference mode); ``precision="bf16-true"`` sets the default dtype to bfloat16 inside
    ``training_step``; ``bf16-mixed`` adds autocast. Each is switched off here and restored afterwards.
    """
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.no_grad())
            for device_type in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
            yield
    finally:
        torch.set_default_dtype(default_dtype)


def _set_launcher_environment() -> None:
    """The environment vLLM's ``external_launcher`` reads, from the process group Lightning already started.

    vLLM reads ``RANK`` and ``LOCAL_RANK`` from the environment (``KeyError`` without them); Lightning's own launcher
    sets ``LOCAL_RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT`` but never ``RANK`` (torchrun does), so
    ``--trainer.devices N`` without torchrun could not start vLLM. As TRL does, they are set from the process group.
    """
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    if "LOCAL_RANK" not in os.environ:  # one node: the device index the trainer placed this rank on
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device() if torch.cuda.is_available() else rank)


class VLLMEngine(RolloutEngine):
    """Colocated vLLM engine with in-place weight sync.

    Args:
        model: checkpoint vLLM starts from (its architecture and tokenizer must be the policy's; its weights are
            replaced at the first sync). ``None``: the policy's own ``name_or_path``.
        gpu_memory_utilization: share of the GPU vLLM may take (weights + KV cache); the trainer needs the rest.
        max_model_len: longest prompt + completion in tokens (``None``: the model's).
        dtype: vLLM's weight and compute dtype.
        enable_sleep_mode: free vLLM's GPU memory while the policy trains: the engine sleeps once a rollout (all its
            dynamic-sampling rounds) or a validation epoch is done (:meth:`release`) and wakes at the next sync or
            generation.
        sleep_level: 1 = weights offloaded to CPU, KV cache dropped; 2 = both dropped (the weights are pushed
            again on waking).
        weight_bucket_mb: size of one weight-sync bucket (bounds the gathered, not yet loaded tensors).
        enforce_eager: no CUDA graphs (slower decoding, faster start, less memory).
        logprobs_mode: which log-probs vLLM returns; ``"processed_logprobs"`` (after temperature) is what the trainer
            computes. ``None`` keeps vLLM's default.
        seed: the seed vLLM is built with (each rank adds its rank). vLLM's worker reseeds the process's global RNGs
            with it at construction; the engine restores them afterwards, so the run's random streams (and an exact
            resume) are untouched, and vLLM samples from the trainer's global generator like HFEngine.
        lora_mode: how a LoRA policy reaches vLLM: ``"merged"`` (default; its weights merged, ``W + scale·B·A``,
            pushed like a full model's: vLLM then runs a plain model at full speed, on any vLLM) or ``"adapter"``
            (vLLM's LoRA support, ``enable_lora``: the base weights are pushed once, and after each update only the
            adapter, written to a local directory and loaded through a ``LoRARequest``; less to transfer per sync,
            slower decoding through vLLM's LoRA kernels). Unsharded policies only.
        llm_factory: builds the LLM from keyword arguments (default ``vllm.LLM``); for tests and custom setups.
        sampling_params_factory: builds sampling parameters (default ``vllm.SamplingParams``).
        lora_request_factory: builds a LoRA request (default ``vllm.lora.request.LoRARequest``).
    """

    def __init__(
        self,
        model: str | None = None,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16",
        enable_sleep_mode: bool = False,
        sleep_level: Literal[1, 2] = 1,
        weight_bucket_mb: int = 256,
        enforce_eager: bool = False,
        logprobs_mode: str | None = "processed_logprobs",
        seed: int = 0,
        lora_mode: Literal["merged", "adapter"] = "merged",
        llm_factory: Callable[..., Any] | None = None,
        sampling_params_factory: Callable[..., Any] | None = None,
        lora_request_factory: Callable[..., Any] | None = None,
    ) -> None:
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"VLLMEngine: gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if sleep_level not in (1, 2):
            raise ValueError(f"VLLMEngine: sleep_level must be 1 or 2, got {sleep_level}")
        if weight_bucket_mb < 1:
            raise ValueError(f"VLLMEngine: weight_bucket_mb must be >= 1, got {weight_bucket_mb}")
        if lora_mode not in ("merged", "adapter"):
            raise ValueError(f"VLLMEngine: lora_mode must be 'merged' or 'adapter', got {lora_mode!r}")
        self.lora_mode = lora_mode
        self.lora_request_factory = lora_request_factory or _vllm_lora_request
        self._lora_request: Any = None
        self._adapter_dir: tempfile.TemporaryDirectory | None = None
        self._base_pushed: int | None = None  # the policy's merged_adapter_count when its base was last pushed
        self.model = model
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.enable_sleep_mode = enable_sleep_mode
        self.sleep_level = sleep_level
        self.weight_bucket_mb = weight_bucket_mb
        self.enforce_eager = enforce_eager
        self.logprobs_mode = logprobs_mode
        self.seed = seed
        self.llm_factory = llm_factory or _vllm_llm
        self.sampling_params_factory = sampling_params_factory or _vllm_sampling_params
        self.llm: Any = None
        self.llm_kwargs: dict[str, Any] = {}
        self.max_prompt_tokens: int | None = max_model_len  # known for sure once the engine has started
        self.policy: nn.Module | None = None
        self.version: int | None = None  # the policy version whose weights vLLM holds
        self._asleep: set[str] = set()  # "weights" / "kv_cache" while sleeping

    # -- engine lifecycle ----------------------------------------------------------------------------------
    def _start(self, policy: nn.Module) -> None:
        # The model must live in this process for `load_weights` to reach it (as TRL's colocate mode sets).
        multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if multiprocessing != "0":
            rank_zero_warn(f"VLLMEngine: VLLM_ENABLE_V1_MULTIPROCESSING={multiprocessing} would put vLLM's model in "
                           f"another process, out of reach of the weight sync; setting it to 0 for this process")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        kwargs: dict[str, Any] = dict(
            model=self.model or policy.config.name_or_path, gpu_memory_utilization=self.gpu_memory_utilization,
            dtype=self.dtype, enable_sleep_mode=self.enable_sleep_mode, enforce_eager=self.enforce_eager,
            seed=self.seed + rank, tensor_parallel_size=1,
        )
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.logprobs_mode is not None:
            kwargs["logprobs_mode"] = self.logprobs_mode
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"  # one engine per trainer rank
            _set_launcher_environment()
        if self._serves_adapter(policy):
            _check_adapter_mode(policy)
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=_vllm_lora_rank(policy))
        self.llm_kwargs = kwargs
        with preserved_rng_state():  # vLLM's worker reseeds random, numpy, torch and CUDA with `seed`
            self.llm = self.llm_factory(**kwargs)
        self.max_prompt_tokens = self.max_model_len or getattr(policy.config, "max_position_embeddings", None)

    def _model(self) -> Any:
        for path in _MODEL_PATHS:
            target = self.llm
            for attribute in path:
                target = getattr(target, attribute, None)
                if target is None:
                    break
            if target is not None and hasattr(target, "load_weights"):
                return target
        tried = ", ".join(".".join(path) for path in _MODEL_PATHS)
        raise RuntimeError(f"VLLMEngine: cannot reach vLLM's model to load weights into (tried {tried}); this vLLM "
                           f"version keeps it elsewhere or in another process (is VLLM_ENABLE_V1_MULTIPROCESSING=0?)")

    def _wake(self, tags: list[str]) -> None:
        asleep = [tag for tag in tags if tag in self._asleep]
        if asleep:
            self.llm.wake_up(tags=asleep)
            self._asleep -= set(asleep)

    def _serves_adapter(self, policy: nn.Module) -> bool:
        return self.lora_mode == "adapter" and is_lora(policy)

    def _push_weights(self) -> None:
        if self._serves_adapter(self.policy):
            self._push_adapter()
            return
        model = self._model()
        size = self.weight_bucket_mb * 2**20
        # A LoRA policy is pushed merged (W + scale·B·A) under its base model's names: vLLM serves a plain model.
        buckets = merged_weights(self.policy, size) if is_lora(self.policy) else full_weights(self.policy, size)
        self._load(model, buckets)

    def _load(self, model: Any, buckets) -> None:
        for bucket in buckets:
            # Names as in a Hugging Face checkpoint (vLLM maps them onto its fused layers); `_orig_mod.` is what
            # torch.compile adds.
            model.load_weights([(name.replace("_orig_mod.", ""), tensor) for name, tensor in bucket])
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def _push_adapter(self) -> None:
        """vLLM's LoRA path: the base weights when they changed (first sync, a warm start merged into them, a level-2
        sleep), then the adapter written to a directory vLLM loads it from, under a new id per push."""
        merges = getattr(self.policy, "merged_adapter_count", 0)
        if self._base_pushed != merges or self.sleep_level == 2:
            self._load(self._model(), merged_weights(self.policy, self.weight_bucket_mb * 2**20, with_adapter=False))
            self._base_pushed = merges
        if self._adapter_dir is None:
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="lightning_rlvr_adapter_")
        number = self._adapter_pushes = getattr(self, "_adapter_pushes", 0) + 1
        path = os.path.join(self._adapter_dir.name, f"v{number}")
        self.policy.save_pretrained(path)
        self._lora_request = self.lora_request_factory(lora_name=f"policy-{number}", lora_int_id=number,
                                                       lora_path=path)
        self.llm.reset_prefix_cache()

    # -- RolloutEngine -------------------------------------------------------------------------------------
    def sync(self, policy: nn.Module, version: int) -> None:
        """Push ``policy``'s weights into vLLM if they changed (a collective on sharded policies)."""
        with _clean_context():
            if self.llm is None:
                self._start(policy)
            self.policy = policy
            if version == self.version:
                return
            self._wake(["weights"])
            self._push_weights()
            self.version = version

    def release(self) -> None:
        """Put vLLM to sleep (with ``enable_sleep_mode``), freeing its GPU memory for the update: once per rollout
        and once per validation epoch, not after every ``generate`` (dynamic-sampling rounds and validation
        batches would each pay a wake: a CPU→GPU copy of the weights at level 1, a full push at level 2)."""
        if self.enable_sleep_mode and self.llm is not None and not self._asleep:
            with _clean_context():
                self.llm.sleep(level=self.sleep_level)
            self._asleep = {"weights", "kv_cache"}

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> GenerationOutput:
        if self.llm is None or self.policy is None:
            raise RuntimeError("VLLMEngine.generate called before sync(policy)")
        with _clean_context():
            return self._generate(prompts, n, sampling)

    def _generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> GenerationOutput:
        longest = max(len(p) for p in prompts)
        if self.max_prompt_tokens is not None and longest > self.max_prompt_tokens:
            raise ValueError(f"VLLMEngine: a prompt of {longest} tokens is longer than max_model_len="
                             f"{self.max_prompt_tokens}; vLLM would fail the whole batch")
        if "weights" in self._asleep:
            self._wake(["weights"])
            if self.sleep_level == 2:  # level 2 dropped the weights: they must be pushed again
                self._push_weights()
        self._wake(["kv_cache"])
        stop_ids = self.stop_ids(self.policy, sampling)
        # vLLM stops on its tokenizer's EOS and its generation config's EOS ids by itself; the stop ids are given
        # explicitly so that it stops on exactly the set the DataModule cuts at (user-added ids included).
        params = self.sampling_params_factory(
            n=n, max_tokens=sampling.max_new_tokens, logprobs=0,  # 0: the sampled token's log-prob only
            stop_token_ids=list(stop_ids),
            detokenize=False,  # the DataModule decodes the ids; vLLM would detokenise every token on the CPU
            **(dict(temperature=0.0) if sampling.greedy else
               dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or -1)),
        )
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        if self._lora_request is not None:
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora_request)
        else:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        return self._to_output(prompts, outputs, n, stop_ids)

    def _to_output(self, prompts: list[list[int]], outputs: list, n: int,
                   stop_ids: tuple[int, ...]) -> GenerationOutput:
        config = self.policy.generation_config
        pad_id = config.pad_token_id if config.pad_token_id is not None else stop_ids[0]
        if len(outputs) != len(prompts) or any(len(out.outputs) != n for out in outputs):
            raise RuntimeError(f"vLLM returned {[len(out.outputs) for out in outputs]} completions for "
                               f"{len(prompts)} prompts × n={n}")
        rows, logprobs, stopped = [], [], []
        for out in outputs:
            for completion in out.outputs:
                tokens = list(completion.token_ids)  # the stop id, if any, is the last token
                if completion.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a completion with reason {completion.finish_reason!r}")
                ended = completion.finish_reason == "stop"
                if ended and (not tokens or tokens[-1] not in stop_ids):
                    raise RuntimeError(
                        f"vLLM stopped a completion on token {tokens[-1:] or 'none'}, not one of the stop ids "
                        f"{list(stop_ids)}: the checkpoint vLLM runs ({self.llm_kwargs.get('model')!r}) stops on ids "
                        f"the policy's does not; add them to RolloutDataModule(stop_token_ids=...)")
                rows.append(tokens)
                stopped.append(ended)
                if completion.logprobs is None:
                    raise RuntimeError("vLLM returned no log-probs (SamplingParams.logprobs=0 asks for them)")
                logprobs.append([step[token].logprob for step, token in zip(completion.logprobs, tokens)])
        return self.from_rows(prompts, n, rows, logprobs, stopped, pad_id)


def installed_vllm_release() -> tuple[int, ...] | None:
    """``(major, minor)`` of the installed vLLM, or ``None`` where none is installed."""
    try:
        text = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in text.split(".")[:2])


def _check_adapter_mode(policy: nn.Module) -> None:
    """Refuse what vLLM's LoRA path cannot serve, before vLLM is built.

    - A sharded policy: its adapter cannot be written from one rank.
    - vLLM before 0.28: it wraps every LoRA-capable linear layer (``…q_proj.base_layer.weight``) and nothing forwards
      the base weights' plain names to the wrapped layer until 0.28, so the first push fails.
    - ``modules_to_save``: vLLM refuses such adapters (only ``classifier`` / ``score`` may be saved), and the trained
      copies would reach it only with the base weights, pushed once.
    """
    if is_sharded(policy):
        raise ValueError("VLLMEngine(lora_mode='adapter') needs an unsharded policy: use lora_mode='merged'")
    release = installed_vllm_release()
    if release is not None and release < (0, 28):
        raise ValueError(f"VLLMEngine(lora_mode='adapter') needs vLLM >= 0.28 (before it, the base weights cannot be "
                         f"loaded into an enable_lora model under their names); vLLM {'.'.join(map(str, release))} "
                         f"is installed: use lora_mode='merged'")
    saved = sorted({name for config in policy.peft_config.values() for name in (config.modules_to_save or [])}
                   - {"classifier", "score"})
    if saved:
        raise ValueError(f"VLLMEngine(lora_mode='adapter') cannot serve an adapter with modules_to_save={saved}: "
                         f"vLLM refuses it, and the trained copies would reach vLLM only once; use lora_mode='merged'")
