"""RolloutDataModule: prompts in, scored rollouts out — generation and verification live here.

The dataloader yields *prompts* (cheap to prefetch); completions are generated only when the training step asks for
them through :meth:`RolloutDataModule.rollout`, with the policy as it is at that moment (Lightning's fit loop fetches
one batch ahead, so generating in the dataloader would train on rollouts of the previous policy). Each batch records
the policy version that generated it, and the module checks it against the version it trains. One rollout:

1. sync the policy into the engine if its version moved (:class:`~lightning_rlvr.data.policy_handle.EngineWeights`);
2. generate ``group_size`` completions per prompt, cut them at their stop ids and score them
   (:mod:`lightning_rlvr.data.scoring`);
3. optionally add DAPO's overlong penalty, and with ``dynamic_sampling`` drop groups whose rewards are all equal and
   generate again for fresh prompts (:mod:`lightning_rlvr.data.dynamic_sampling`);
4. batch the kept rows. With ``max_policy_lag=k >= 1`` the next ``k`` steps' rollouts are generated in the background
   while this one trains (:mod:`lightning_rlvr.data.async_rollouts`).

The policy is handed over once per fit, in :meth:`~RolloutDataModule.setup` (or :meth:`~RolloutDataModule.connect`),
as a :class:`~lightning_rlvr.data.policy_handle.PolicyHandle`.

Exact resume: :meth:`RolloutDataModule.state_dict` (in every checkpoint) records the epoch's shuffle seed, the prompts
already trained, the refill sampler and the global RNG states, of every rank (:mod:`lightning_rlvr.data.samplers`).
At ``max_policy_lag=k >= 1`` a resume is not exact: the background queue is not saved (a checkpoint does not wait for
it), so the first step after the resume generates in the foreground with the current policy, and the queue fills
again from there.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import replace

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_rlvr.data.async_rollouts import LaggedRollouts, steps_left
from lightning_rlvr.data.batch import RolloutBatch
from lightning_rlvr.data.dynamic_sampling import RoundSettings, generate_rounds, needs_lockstep
from lightning_rlvr.data.evaluation import PolicySampling
from lightning_rlvr.data.policy_handle import EngineWeights, PolicyHandle
from lightning_rlvr.data.samplers import ProblemDataset, ResumableShuffle, as_list, resumable_shuffle
from lightning_rlvr.data.scoring import (
    CompletionScorer, GeneratedRollout, PromptFormatter, ScoredCompletion, component_names)
from lightning_rlvr.data.sources import BuiltinTask, PromptSource
from lightning_rlvr.distributed import all_union
from lightning_rlvr.rng import rng_state, set_rng_state
from lightning_rlvr.rollout.base import RolloutEngine, SamplingConfig
from lightning_rlvr.rollout.hf import HFEngine
from lightning_rlvr.rollout.stops import resolve_stop_token_ids
from lightning_rlvr.sharding import strategy_shards
from lightning_rlvr.tasks import Problem
from lightning_rlvr.verifiers.base import Verifier, VerifierRunner
from lightning_rlvr.verifiers.exact import ExactMatchVerifier

__all__ = ["RolloutDataModule"]


class RolloutDataModule(PolicySampling, pl.LightningDataModule):
    """Owns the prompt source, the rollout engine and the verifier.

    Args:
        source: where problems come from (default: the built-in ``addition`` task).
        verifier: scores completions (default: the source's own, such as
            :class:`~lightning_rlvr.data.ReasoningGymVerifier` for a :class:`~lightning_rlvr.data.ReasoningGymSource`,
            else :class:`~lightning_rlvr.verifiers.ExactMatchVerifier`).
        engine: generates completions (default: :class:`~lightning_rlvr.rollout.HFEngine`).
        prompts_per_step: prompts per rollout batch (per rank under DDP).
        group_size: ``G``, completions per prompt.
        max_new_tokens: generation limit per completion.
        temperature: sampling temperature (the trainer computes log-probs at the same temperature).
        top_p: nucleus sampling (1.0 = off).
        top_k: top-k sampling (0 = off).
        prompt_template: ``str.format`` template applied to each prompt (``{prompt}``).
        chat_template: format prompts with the tokenizer's chat template (instruct / chat models): the templated
            prompt is the user message, and the assistant's generation prompt is appended.
        system_prompt: a system message before the user message (only with ``chat_template``).
        stop_token_ids: ids that end a completion besides the checkpoint's own (its generation config's
            ``eos_token_id``, an int or a list, and the tokenizer's EOS, which always count).
        dynamic_sampling: DAPO dynamic sampling (keep only groups with non-identical rewards, refill).
        max_generation_rounds: generation rounds allowed per step when dynamic sampling refills.
        overlong_buffer: DAPO's ``L_cache`` (tokens before ``max_new_tokens`` where the length penalty ramps);
            0 disables overlong shaping.
        overlong_penalty_factor: the penalty at ``max_new_tokens``.
        val_batch_size: held-out prompts per validation batch.
        val_max_prompts: cap on held-out prompts evaluated (``None`` = all).
        val_samples: samples per held-out prompt for pass@k (0 disables pass@k).
        val_k: the ``k`` of ``val/pass_at_k`` (``1 ≤ k ≤ val_samples``).
        verifier_timeout_s: time limit of one verifier call.
        verifier_workers: verifier pool size (thread / process isolation).
        seed: seed of the refill sampler of dynamic sampling (and of the background generations' samplers).
        max_policy_lag: ``0`` (default): every rollout is generated by the policy that trains on it, at the start
            of its step. ``k >= 1``: the rollouts of the next ``k`` steps are generated in the background while this
            step trains, each by a policy at most ``k`` rollout steps older than the one that trains on it, so
            generation overlaps training (see "Asynchronous rollouts" in the module docstring). Needs an engine with
            its own weights (``HFEngine(weights="copy")`` in a thread of this process, ``ProcessEngine()`` in a
            process of its own, ``VLLMServerEngine`` on other GPUs) and ``RLVRModule(engine_is_cap=...)``.
    """


    def __init__(
        self,
        source: PromptSource | None = None,
        verifier: Verifier | None = None,
        engine: RolloutEngine | None = None,
        prompts_per_step: int = 16,
        group_size: int = 8,
        max_new_tokens: int = 4,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        prompt_template: str = "{prompt}",
        chat_template: bool = False,
        system_prompt: str | None = None,
        stop_token_ids: list[int] | None = None,
        dynamic_sampling: bool = False,
        max_generation_rounds: int = 3,
        overlong_buffer: int = 0,
        overlong_penalty_factor: float = 1.0,
        val_batch_size: int = 512,
        val_max_prompts: int | None = None,
        val_samples: int = 8,
        val_k: int = 8,
        verifier_timeout_s: float = 5.0,
        verifier_workers: int = 2,
        seed: int = 0,
        max_policy_lag: int = 0,
    ) -> None:
        super().__init__()
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if max_generation_rounds < 1:
            raise ValueError(f"max_generation_rounds must be >= 1, got {max_generation_rounds}")
        if not 0 <= overlong_buffer <= max_new_tokens:
            raise ValueError(f"overlong_buffer must be in [0, max_new_tokens={max_new_tokens}], got {overlong_buffer}")
        if val_samples < 0 or (val_samples > 0 and not 1 <= val_k <= val_samples):
            raise ValueError(f"need val_samples >= 0 and 1 <= val_k <= val_samples, got {val_samples=}, {val_k=}")
        if val_batch_size < 1:
            raise ValueError(f"val_batch_size must be >= 1, got {val_batch_size}")
        if stop_token_ids is not None and any(not isinstance(i, int) or i < 0 for i in stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (ints >= 0), got {stop_token_ids!r}")
        if not isinstance(max_policy_lag, int) or max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be an int >= 0 (0: on-policy; k: rollouts generated up to k steps "
                             f"ahead), got {max_policy_lag!r}")
        self.prompts = PromptFormatter(prompt_template, chat_template, system_prompt)
        self.source = source if source is not None else BuiltinTask()
        if verifier is None:
            verifier = self.source.default_verifier() or ExactMatchVerifier()
        self.verifier = verifier
        self.engine = engine if engine is not None else HFEngine()
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.sampling = SamplingConfig(max_new_tokens, temperature, top_p, top_k)
        self.extra_stop_token_ids = tuple(stop_token_ids or ())
        self.stop_token_ids: tuple[int, ...] = ()  # resolved in connect()
        self.end_token_id: int | None = None
        self.round_settings = RoundSettings(prompts_per_step, group_size, dynamic_sampling, max_generation_rounds)
        self.val_batch_size = val_batch_size
        self.val_max_prompts = val_max_prompts
        self.val_samples = val_samples
        self.val_k = val_k
        self.runner = VerifierRunner(self.verifier, verifier_timeout_s, verifier_workers)
        self.scorer = CompletionScorer(self.runner, overlong_buffer, overlong_penalty_factor)
        self._refill_rng = random.Random(seed)
        self.tokenizer = None
        self.policy_handle: PolicyHandle | None = None
        self.engine_weights = EngineWeights()
        self._shuffle: ResumableShuffle | None = None  # or its distributed twin: where the epoch stands
        self._restored: dict | None = None
        self.max_policy_lag = max_policy_lag
        self.seed = seed
        self.lagged = (LaggedRollouts(max_policy_lag, seed, self.engine, self.engine_weights, self._generate)
                       if max_policy_lag else None)

    # -- exact resume --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where training stands in the epoch, the refill sampler and the global RNG states (saved in checkpoints).

        Restored by :meth:`load_state_dict`: the interrupted epoch continues with its remaining prompts, and the
        global RNG states are set again right before the first rollout after the resume — the point the
        uninterrupted run had reached when the checkpoint was written (Lightning's sanity check is skipped on a
        restart and isolates its RNG anyway; validation between the checkpoint and the next step does draw from
        the global RNG, so a checkpoint written right before a validation resumes exactly only if validation
        draws nothing, e.g. ``val_samples=0``). With several ranks every rank's position and RNG states are
        gathered (``per_rank``; checkpoints are written on every rank, so the gather is a collective they all run).
        """
        # No wait for the background queue: it draws from samplers of its own, and a resume does not restore it.
        version, internal, gauss = self._refill_rng.getstate()
        state = {**(self._shuffle.position() if self._shuffle is not None else {"consumed": 0}),
                 "refill_rng": [version, list(internal), gauss], "rng": rng_state(),
                 "generations": self.lagged.generations if self.lagged is not None else 0}
        if self.trainer is not None and self.trainer.world_size > 1:
            per_rank: list = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(per_rank, state)
            return {"per_rank": per_rank}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        if "per_rank" in state_dict:
            per_rank, world = state_dict["per_rank"], self.trainer.world_size
            if len(per_rank) != world:
                rank_zero_warn(f"the checkpoint was written by {len(per_rank)} ranks, this run has {world}: the "
                               f"interrupted epoch restarts and each rank keeps its own random state")
                return
            state_dict = per_rank[self.trainer.global_rank]
        version, internal, gauss = state_dict["refill_rng"]
        self._refill_rng.setstate((version, tuple(internal), gauss))
        if self.lagged is not None:
            self.lagged.generations = int(state_dict.get("generations", 0))
        self._restored = state_dict

    # -- wiring --------------------------------------------------------------------------------------------
    def connect(self, tokenizer, generation_config=None, policy: PolicyHandle | None = None) -> None:
        """Give the DataModule the policy's tokenizer, generation config and the policy itself (done in
        :meth:`setup` under a Trainer, with the LightningModule as the policy).

        The stop ids are resolved here, once, for every generation: the generation config's ``eos_token_id`` (int
        or list), the tokenizer's EOS and ``stop_token_ids``
        (:func:`~lightning_rlvr.rollout.stops.resolve_stop_token_ids`).
        """
        self.stop_token_ids = resolve_stop_token_ids(tokenizer, generation_config, self.extra_stop_token_ids)
        self.sampling = replace(self.sampling, stop_token_ids=self.stop_token_ids)
        # What a completion the policy is taught to write ends with (the warm start): the tokenizer's EOS, which
        # for a chat checkpoint is the end of an assistant turn (<|im_end|>), else the first stop id.
        self.end_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else self.stop_token_ids[0]
        self.prompts.connect(tokenizer)
        self.scorer.connect(tokenizer, self.stop_token_ids)
        self.tokenizer = tokenizer
        if policy is not None:
            self.policy_handle = policy

    def setup(self, stage: str) -> None:
        if self.max_policy_lag and not getattr(self.engine, "holds_own_weights", False):
            raise ValueError(f"max_policy_lag={self.max_policy_lag} generates while the policy trains: the engine "
                             f"needs its own copy of the weights, e.g. HFEngine(weights='copy'), ProcessEngine() "
                             f"or VLLMServerEngine(); {type(self.engine).__name__} generates with the live policy")
        if self.trainer is None:
            self.engine.setup_fit(self.max_policy_lag, world_size=1, sharded_policy=False)
            return
        self.engine.setup_fit(self.max_policy_lag, self.trainer.world_size, strategy_shards(self.trainer.strategy))
        if self.lagged is not None:
            self.lagged.for_run(int(os.environ.get("PL_GLOBAL_SEED", "0")), self.trainer.global_rank)
        module = self.trainer.lightning_module
        if self.tokenizer is None:
            tokenizer = getattr(module, "tokenizer", None)
            if tokenizer is None:
                raise RuntimeError("RolloutDataModule needs a LightningModule with a `tokenizer` attribute")
            self.connect(tokenizer, getattr(module, "generation_config", None))
        self.policy_handle = module

    def teardown(self, stage: str) -> None:
        if self.lagged is not None:
            self.lagged.shutdown()
        self.engine.close()
        self.engine_weights.version = None  # a closed engine holds no weights: the next fit syncs again
        self.runner.close()

    def on_exception(self, exception: BaseException) -> None:
        """The fit failed (Lightning calls this, not :meth:`teardown`): stop the background generations, the engine
        and the verifier pool at once, without waiting for queued or running work."""
        if self.lagged is not None:
            self.lagged.abort()
        self.engine.abort()
        self.engine_weights.version = None
        self.runner.close()

    def train_dataloader(self) -> DataLoader:
        problems = self.source.train_problems()
        if len(problems) < self.prompts_per_step:
            raise ValueError(f"{len(problems)} training problems, fewer than prompts_per_step={self.prompts_per_step}")
        dataset = ProblemDataset(problems)
        distributed = self.trainer is not None and self.trainer.world_size > 1
        self._shuffle = resumable_shuffle(dataset, self.trainer.strategy.distributed_sampler_kwargs if distributed
                                          else None)
        if self._restored is not None and self._shuffle.resume_from(self._restored, self.prompts_per_step):
            self._restored = None  # the next epoch's shuffle drew from the checkpoint's RNG states, as it would have
        return DataLoader(dataset, batch_size=self.prompts_per_step, sampler=self._shuffle, drop_last=True,
                          collate_fn=as_list)

    def val_dataloader(self) -> DataLoader:
        problems = self.source.held_out_problems()[: self.val_max_prompts]
        return DataLoader(ProblemDataset(problems), batch_size=self.val_batch_size, shuffle=False, collate_fn=as_list)

    # -- generation ----------------------------------------------------------------------------------------
    def prompt_ids(self, problem: Problem) -> list[int]:
        """The token ids the policy is prompted with for ``problem`` (cached per prompt text).

        ``prompt_template`` filled with the prompt, then either tokenized with the tokenizer's special tokens or,
        with ``chat_template=True``, sent as the user message (after an optional system message) through the
        tokenizer's chat template with the generation prompt appended (:class:`~lightning_rlvr.data.scoring.
        PromptFormatter`).
        """
        return self.prompts.ids(problem)

    def rollout(self, problems: list[Problem]) -> RolloutBatch:
        """Generate, verify and batch ``group_size`` completions for each prompt (with ``max_policy_lag > 0``: take
        the batch generated in the background for this step, and queue the next ones)."""
        handle = self._policy("rollout")
        if self._restored is not None:  # the first step after a resume starts from the checkpoint's RNG states
            set_rng_state(self._restored["rng"])
            self._restored = None
        if self._shuffle is not None:
            self._shuffle.consumed += len(problems)
        start = time.perf_counter()
        if self.lagged is not None:
            batch = self.lagged.as_lagged(self._batch(self.lagged.take(problems, handle, self.sampling)))
            if self._shuffle is not None:
                self.lagged.top_up(self._upcoming_problems, handle, self.sampling)
        else:
            version = self.engine_weights.sync(self.engine, handle)
            # The engine's behaviour stats replace the trainer's no-grad pass, if the trainer would run one.
            sampling = replace(self.sampling, behaviour_stats=bool(handle.wants_behaviour_stats()))
            batch = self._batch(self._generate(problems, version, sampling))
        batch.stats["perf/generate_wait_s"] = time.perf_counter() - start
        return batch

    def _policy(self, caller: str) -> PolicyHandle:
        if self.tokenizer is None or self.policy_handle is None:
            raise RuntimeError(f"RolloutDataModule.{caller} called before setup() or connect(tokenizer, policy=...)")
        return self.policy_handle

    def _upcoming_problems(self, steps_ahead: int) -> list[Problem] | None:
        """The prompts of the step ``steps_ahead`` after this one, from the shuffle's order (``None``: next epoch, or
        past the last step that ``max_steps`` or ``limit_train_batches`` leave)."""
        if steps_ahead >= steps_left(self.trainer, self.policy_handle):
            return None
        upcoming = self._shuffle.upcoming(steps_ahead * self.prompts_per_step)
        if upcoming is None:
            return None
        dataset = self.source.train_problems()
        return [dataset[i] for i in upcoming[-self.prompts_per_step:]]

    def _score(self, problems: list[Problem], n: int, sampling: SamplingConfig,
               first_group: int = 0) -> tuple[list[ScoredCompletion], int]:
        return self.scorer.generate_and_score(self.engine, problems, [self.prompt_ids(p) for p in problems], n,
                                              sampling, first_group)

    def _generate(self, problems: list[Problem], version: int, sampling: SamplingConfig,
                  refill_seed: int | None = None) -> GeneratedRollout:
        """Generate, verify and refill (dynamic sampling) ``problems`` with the engine's weights (``version``): the
        kept rows and the rollout's statistics (no collective but the lockstep of sharded generation). Refills are
        drawn from the refill sampler, or from one seeded with ``refill_seed`` (a background generation's)."""
        handle = self.policy_handle
        refill_rng = self._refill_rng if refill_seed is None else random.Random(refill_seed)
        lockstep = needs_lockstep(self.round_settings.dynamic_sampling, handle.policy, self.engine)
        generated = generate_rounds(
            run_round=lambda pending, first_group: self._score(pending, self.group_size, sampling, first_group),
            idle_round=lambda pending: self.engine.generate([self.prompt_ids(pending[0])], self.group_size, sampling),
            refill=lambda missing: refill_rng.sample(self.source.train_problems(), missing),
            problems=problems, version=version, settings=self.round_settings,
            shaped_rewards=lambda rows: self.scorer.shaped_rewards(rows, self.sampling.max_new_tokens),
            lockstep_device=handle.device if lockstep else None)
        self.engine.release()  # all rounds are generated: the update may have the memory
        return generated

    def _batch(self, generated: GeneratedRollout) -> RolloutBatch:
        """The training batch of generated rows, built in the training thread: the reward-component names are united
        over ranks (a collective), so that every rank logs the same reward/<name> metrics, averaged over ranks in one
        all-reduce (a rank whose rows lack a component logs its mean 0)."""
        names = component_names(generated.rows)
        batch = self.scorer.to_batch(generated.rows, generated.version, self.sampling, sorted(all_union(names)))
        batch.stats.update(generated.stats)
        return batch
