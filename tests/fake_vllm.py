"""A stand-in for vLLM's offline API (``vllm.LLM``, ``vllm.SamplingParams``) that behaves as vLLM does where
``VLLMEngine`` depends on it (vLLM itself needs a CUDA build of torch; scripts/gpu_smoke_vllm.py runs the real one).

What it enforces, as vLLM does (read from vLLM's source: ``engine/arg_utils.py``, ``sampling_params.py``,
``v1/core/sched/utils.py``, ``v1/sample/sampler.py``, ``v1/engine/detokenizer.py``):

- ``LLM(**kwargs)`` accepts only ``EngineArgs`` fields and ``LLM``'s own parameters (anything else: ``TypeError``);
  ``SamplingParams(**kwargs)`` only its fields (``TypeError``), and greedy decoding only with ``n == 1``
  (``ValueError``);
- it starts from the checkpoint on disk like vLLM: its config, its weights, its tokenizer's EOS and its
  ``generation_config.json``; a prompt longer than ``max_model_len`` is refused (``ValueError``);
- ``load_weights`` takes Hugging Face names; a name the model does not have raises ``KeyError``; a tied
  ``lm_head.weight`` is skipped (vLLM's models alias it to the embedding);
- generation stops when the sampled token is the tokenizer's EOS (``stop_reason=None``), one of
  ``stop_token_ids`` or the generation config's other EOS ids (``stop_reason=<id>``), or at ``max_tokens`` /
  ``max_model_len`` (``finish_reason="length"``); ``token_ids`` include the stop token;
- sampling is vLLM's order: temperature, then top-k (``-1`` or ``0`` = off), then top-p; greedy when the temperature
  is 0. The returned log-probs are ``raw_logprobs`` (vLLM's default: the model's log-softmax) or, with
  ``logprobs_mode="processed_logprobs"``, those of the distribution actually sampled (after temperature, renormalised
  under top-k / top-p);
- a level-2 sleep discards the weights (they become NaN) and generating before new weights are pushed raises;
  generating while asleep raises; only one sleep-mode engine may live in a process (vLLM's memory pool is one);
- with ``distributed_executor_backend="external_launcher"`` it reads ``RANK`` and ``LOCAL_RANK`` from the environment
  (``KeyError`` without them, as vLLM's executor does) and checks ``RANK`` against the running process group;
- its construction reseeds the process's global RNGs (``random``, numpy, torch) with ``seed``, as vLLM's worker
  does, and it samples from torch's global generator, as vLLM's sampler does for requests without their own seed;
- it records the autograd / inference-mode / autocast / default-dtype context of every call (``contexts``), so
  tests can check what the engine is called under (vLLM itself would not complain, it would misbehave);
- a ``lora_request`` needs ``enable_lora=True`` and an adapter of rank at most ``max_lora_rank``; it generates with
  the adapter read from ``lora_path`` (a PEFT directory) applied to the weights it holds;
- ``version`` (default 0.33.0): with ``enable_lora`` before 0.28 the LoRA-capable linear layers' weights are named
  ``…q_proj.base_layer.weight``, and ``load_weights`` refuses their plain names, as vLLM 0.21-0.27 does.

It generates with a real copy of the model (``transformers``, float32, a full forward per token: an independent
implementation, not HFEngine's loop), so a stale, partial or misnamed weight push changes what it samples and its
log-probs (``rollout/engine_kl > 0``). Every call is recorded in ``calls``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import re
import sys
import types
import weakref
from pathlib import Path

import numpy as np
import torch

# vLLM's EngineArgs fields (0.10 - 0.11) and LLM.__init__'s own parameters: the keyword arguments LLM accepts.
LLM_ARGUMENTS = {
    "model", "served_model_name", "tokenizer", "hf_config_path", "runner", "convert", "task", "skip_tokenizer_init",
    "enable_prompt_embeds", "tokenizer_mode", "trust_remote_code", "allowed_local_media_path", "allowed_media_domains",
    "download_dir", "safetensors_load_strategy", "load_format", "config_format", "dtype", "kv_cache_dtype", "seed",
    "max_model_len", "cuda_graph_sizes", "cudagraph_capture_sizes", "max_cudagraph_capture_size",
    "distributed_executor_backend", "pipeline_parallel_size", "tensor_parallel_size", "decode_context_parallel_size",
    "data_parallel_size", "data_parallel_rank", "data_parallel_start_rank", "data_parallel_size_local",
    "data_parallel_address", "data_parallel_rpc_port", "data_parallel_hybrid_lb", "data_parallel_backend",
    "enable_expert_parallel", "all2all_backend", "enable_dbo", "eplb_config", "enable_eplb",
    "max_parallel_loading_workers", "block_size", "enable_prefix_caching", "prefix_caching_hash_algo",
    "disable_sliding_window", "disable_cascade_attn", "swap_space", "cpu_offload_gb", "gpu_memory_utilization",
    "kv_cache_memory_bytes", "max_num_batched_tokens", "max_num_partial_prefills", "max_long_partial_prefills",
    "long_prefill_token_threshold", "max_num_seqs", "max_logprobs", "logprobs_mode", "disable_log_stats", "revision",
    "code_revision", "rope_scaling", "rope_theta", "hf_token", "hf_overrides", "tokenizer_revision", "quantization",
    "enforce_eager", "disable_custom_all_reduce", "limit_mm_per_prompt", "mm_processor_kwargs", "enable_lora",
    "max_loras", "max_lora_rank", "fully_sharded_loras", "max_cpu_loras", "lora_dtype", "lora_extra_vocab_size",
    "num_gpu_blocks_override", "num_lookahead_slots", "model_loader_extra_config", "ignore_patterns",
    "enable_chunked_prefill", "disable_hybrid_kv_cache_manager", "reasoning_parser", "guided_decoding_backend",
    "logits_processor_pattern", "speculative_config", "scheduling_policy", "scheduler_cls", "pooler_config",
    "override_pooler_config", "compilation_config", "worker_cls", "worker_extension_cls", "kv_transfer_config",
    "generation_config", "enable_sleep_mode", "override_generation_config", "model_impl", "calculate_kv_scales",
    "additional_config", "use_tqdm_on_load", "logits_processors", "async_scheduling", "max_seq_len_to_capture",
    "disable_async_output_proc", "structured_outputs_config",
}
SAMPLING_FIELDS = {
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "logits_processors",
    "include_stop_str_in_output", "truncate_prompt_tokens", "output_kind", "guided_decoding", "structured_outputs",
    "logit_bias", "allowed_token_ids", "extra_args", "bad_words",
}
LOGPROBS_MODES = {"raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs"}
_GREEDY = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy


class SamplingParams:
    """vLLM's ``SamplingParams`` fields with its defaults (those the stand-in reads) and its argument checks."""

    def __init__(self, **kwargs) -> None:
        unknown = set(kwargs) - SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"SamplingParams: unexpected keyword argument(s) {sorted(unknown)}")
        self.n, self.temperature, self.top_p, self.top_k = 1, 1.0, 1.0, 0
        self.max_tokens, self.logprobs, self.stop_token_ids, self.ignore_eos, self.min_tokens = 16, None, [], False, 0
        self.__dict__.update(kwargs)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.temperature < _GREEDY and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        if not all(isinstance(i, int) for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")


def fake_sampling_params(**kwargs) -> SamplingParams:
    return SamplingParams(**kwargs)


def _context(call: str) -> dict:
    return {"call": call, "inference_mode": torch.is_inference_mode_enabled(), "grad": torch.is_grad_enabled(),
            "autocast": torch.is_autocast_enabled("cpu"), "default_dtype": torch.get_default_dtype()}


_LORA_LINEAR = re.compile(r"\.((?:q|k|v|o|gate|up|down)_proj)\.(weight|bias)$")


class FakeLLM:
    """``vllm.LLM`` as VLLMEngine uses it (module docstring)."""

    _sleep_mode_instances: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, model: str, version: str = "0.33.0", **kwargs) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        unknown = set(kwargs) - LLM_ARGUMENTS
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got unexpected keyword argument(s) {sorted(unknown)}")
        self.contexts = [_context("LLM")]
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            self.rank, self.local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
            if torch.distributed.is_initialized() and self.rank != torch.distributed.get_rank():
                raise RuntimeError(f"RANK={self.rank} but this process is rank {torch.distributed.get_rank()}")
        if kwargs.get("enable_sleep_mode"):
            gc.collect()  # a dropped engine releases its memory pool
            if len(FakeLLM._sleep_mode_instances):
                raise RuntimeError("Sleep mode can only be used for one instance per process.")
            FakeLLM._sleep_mode_instances.add(self)
        seed = int(kwargs.get("seed") or 0)
        random.seed(seed)  # vLLM's worker: set_random_seed(seed) at init_device
        np.random.seed(seed)
        torch.manual_seed(seed)
        mode = kwargs.get("logprobs_mode", "raw_logprobs")
        if mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {sorted(LOGPROBS_MODES)}, got {mode!r}")
        self.kwargs = {"model": model, **kwargs}
        self.calls: list[tuple] = []
        self.logprobs_mode = mode
        config = AutoConfig.from_pretrained(model)
        self.max_model_len = kwargs.get("max_model_len") or config.max_position_embeddings
        if self.max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"{config.max_position_embeddings}")
        self.eos_token_id = AutoTokenizer.from_pretrained(model).eos_token_id
        try:
            eos = GenerationConfig.from_pretrained(model).eos_token_id
        except OSError:
            eos = None
        self.generation_eos = set([eos] if isinstance(eos, int) else eos or [])
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.parameters = dict(self.model.named_parameters())
        self.release = tuple(int(part) for part in version.split(".")[:2])
        if kwargs.get("enable_lora") and self.release < (0, 28):
            # vLLM wraps each LoRA-capable linear layer; before 0.28 nothing forwards the plain names to it
            self.parameters = {_LORA_LINEAR.sub(r".\1.base_layer.\2", name): p for name, p in self.parameters.items()}
        self.asleep: set[str] = set()
        model_handle = types.SimpleNamespace(load_weights=self._load_weights)
        worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model_handle))
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(
            driver_worker=types.SimpleNamespace(worker=worker)))
        self.last_outputs: list | None = None
        self.lora_requests: list = []
        self._adapters: dict = {}

    # -- weights -------------------------------------------------------------------------------------------
    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return {name: parameter.detach() for name, parameter in self.parameters.items()}

    def _load_weights(self, pairs) -> set[str]:
        pairs = list(pairs)
        self._adapters = {}  # new base weights: an adapter applied to the old ones is stale
        self.calls.append(("load_weights", tuple(name for name, _ in pairs)))
        self.contexts.append(_context("load_weights"))
        loaded = set()
        with torch.no_grad():
            for name, tensor in pairs:
                if self.tied and name == "lm_head.weight":
                    continue  # vLLM's model aliases the tied head to the embedding and skips the name
                if name not in self.parameters:
                    raise KeyError(name)
                target = self.parameters[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
                target.copy_(tensor.to(target.dtype))
                loaded.add(name)
        return loaded

    # -- memory --------------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        if self.asleep:
            raise RuntimeError("sleep while asleep")
        if level == 2:  # the weights are discarded, not offloaded: they must be pushed again after waking
            with torch.no_grad():
                for parameter in self.parameters.values():
                    parameter.fill_(float("nan"))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tuple(tags) if tags is not None else None))
        self.asleep -= set(tags) if tags is not None else set(self.asleep)

    # -- generation ----------------------------------------------------------------------------------------
    def _with_adapter(self, request) -> torch.nn.Module:
        """The held model with the request's adapter applied (vLLM applies it in its LoRA kernels)."""
        import copy
        import json

        from peft import PeftModel

        if not self.kwargs.get("enable_lora"):
            raise ValueError("LoRA is not enabled: build the LLM with enable_lora=True")
        rank = json.loads((Path(request.lora_path) / "adapter_config.json").read_text())["r"]
        if rank > self.kwargs.get("max_lora_rank", 16):
            raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank {self.kwargs.get('max_lora_rank', 16)}")
        key = (request.lora_int_id, id(self.parameters))
        if self._adapters.get("key") != key:
            merged = PeftModel.from_pretrained(copy.deepcopy(self.model), request.lora_path).merge_and_unload()
            self._adapters = {"key": key, "model": merged.eval()}
        return self._adapters["model"]

    def generate(self, prompts, sampling_params=None, use_tqdm=True, lora_request=None):
        params = sampling_params if sampling_params is not None else SamplingParams()
        self.calls.append(("generate", len(prompts)))
        self.lora_requests.append(lora_request)
        self.contexts.append(_context("generate"))
        self.params = params
        if self.asleep:
            raise RuntimeError(f"generate while asleep ({sorted(self.asleep)}): wake_up first")
        if any(torch.isnan(p).any() for p in self.parameters.values()):
            raise RuntimeError("generate with discarded weights (sleep level 2) before new weights were pushed")
        rows = []
        for prompt in prompts:
            ids = list(prompt["prompt_token_ids"])
            if len(ids) > self.max_model_len:
                raise ValueError(f"The decoder prompt (length {len(ids)}) is longer than the maximum model length "
                                 f"of {self.max_model_len}.")
            rows += [ids] * params.n
        completions = self._sample(rows, params, self._with_adapter(lora_request) if lora_request else self.model)
        outputs = [types.SimpleNamespace(prompt_token_ids=rows[i * params.n], finished=True,
                                         outputs=completions[i * params.n:(i + 1) * params.n])
                   for i in range(len(prompts))]
        self.last_outputs = outputs
        return outputs

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], params: SamplingParams, model: torch.nn.Module) -> list:
        """All rows at once: left-padded, a full forward of every sequence per step (no KV cache)."""
        stops = (set(params.stop_token_ids) | self.generation_eos) - {self.eos_token_id}
        greedy = params.temperature < _GREEDY
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[dict]] = [[] for _ in prompts]
        finish: list[tuple[str, int | None] | None] = [None] * len(prompts)
        for step in range(params.max_tokens):
            for row, prompt in enumerate(prompts):  # out of room: the length cap
                if finish[row] is None and len(prompt) + step >= self.max_model_len:
                    finish[row] = ("length", None)
            if all(finish):
                break
            positions = (mask.cumsum(-1) - 1).clamp_min(0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
            chosen = []
            for row in range(len(prompts)):
                raw = logits[row]
                processed = raw if greedy else self._process(raw, params)
                # vLLM's sampler draws from the device's global generator when a request has no seed of its own
                token = int(processed.argmax()) if greedy else int(torch.multinomial(processed.softmax(-1), 1))
                chosen.append(token)
                if finish[row] is not None:
                    continue
                scores = processed if self.logprobs_mode.startswith("processed") else raw
                value = scores.log_softmax(-1)[token] if self.logprobs_mode.endswith("logprobs") else scores[token]
                tokens[row].append(token)
                logprobs[row].append({token: types.SimpleNamespace(logprob=float(value), rank=1,
                                                                   decoded_token=None)})
                if token == self.eos_token_id and not params.ignore_eos:
                    finish[row] = ("stop", None)
                elif token in stops:
                    finish[row] = ("stop", token)
            ids = torch.cat([ids, torch.tensor(chosen)[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
        n = params.n
        return [types.SimpleNamespace(index=row % n, text="", token_ids=tokens[row],
                                      finish_reason=(finish[row] or ("length", None))[0],
                                      stop_reason=(finish[row] or ("length", None))[1],
                                      logprobs=logprobs[row] if params.logprobs is not None else None,
                                      cumulative_logprob=None)
                for row in range(len(prompts))]

    @staticmethod
    def _process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Temperature, then top-k, then top-p (the smallest set of most likely tokens with mass >= top_p)."""
        logits = logits / params.temperature
        if params.top_k not in (-1, 0) and params.top_k < logits.numel():
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, -float("inf"))
        if params.top_p < 1.0:
            order = logits.argsort(descending=True)
            mass_before = logits[order].softmax(-1).cumsum(-1) - logits[order].softmax(-1)
            dropped = order[mass_before >= params.top_p]
            logits = logits.clone()
            logits[dropped] = -float("inf")
        return logits


@dataclasses.dataclass
class LoRARequest:
    """``vllm.lora.request.LoRARequest``'s fields."""

    lora_name: str
    lora_int_id: int
    lora_path: str


def install(monkeypatch) -> types.ModuleType:
    """Make ``import vllm`` give the stand-in (``LLM``, ``SamplingParams``, ``LoRARequest``) for one test, as an
    installed vLLM would."""
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = FakeLLM, SamplingParams
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    module.lora, lora.request = lora, request
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.lora", lora)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"))
    return module
