"""RolloutDataModule: prompts in, scored rollouts out — generation and verification live here.

The dataloader yields *prompts* (cheap to prefetch); completions are generated only when the training
step asks for them through :meth:`RolloutDataModule.rollout`, with the policy as it is at that moment.
Lightning's fit loop fetches one batch ahead, so generating inside the dataloader's iterator would train
on rollouts of the previous policy (silently off-policy by one step). Each batch records the policy version
that generated it, and the module checks it against the version it trains.

One rollout of ``prompts_per_step`` prompts:

1. sync the policy into the engine if it changed (its version counter moved);
2. generate ``group_size`` completions per prompt;
3. cut each completion where the engine says it ended: at its first stop id
   (:mod:`lightning_rlvr.rollout.stops`: the generation config's EOS ids, the tokenizer's EOS and any
   ``stop_token_ids``; the stop id is trained on, nothing after it). A completion that reached ``max_new_tokens``
   without one is *truncated* and scores 0, and one with a special token, or an id past the tokenizer's vocabulary
   (the padded embedding rows of Qwen-style checkpoints, which decode to nothing), inside its answer scores 0
   (decoding with ``skip_special_tokens`` would let the policy game the reward: ``<pad>4<unk>4`` read as ``44``);
4. score the rest with the verifier (a crash or hang scores 0 and is counted);
5. optionally add DAPO's overlong penalty, and with ``dynamic_sampling`` drop groups whose rewards are all
   equal and generate again for fresh prompts until ``prompts_per_step`` informative groups are kept or
   ``max_generation_rounds`` is reached.

Asynchronous rollouts (``max_policy_lag=k``, ``k >= 1``): at each step the batch generated in the background for it is
trained on, and the queue of background generations is topped up to the next ``k`` steps (their prompts are known
from the resumable shuffle's order; the first step of an epoch has none ahead). The newest one is generated with the
weights as they are at the start of this step, so a step trains on a rollout of a policy at most ``k`` steps old.
The generations run one after the other in a background thread on the engine's own copy of the weights, each with a
``torch.Generator`` of its own (``HFEngine(weights="copy")`` decodes in that thread, sharing the interpreter with
training; a ``ProcessEngine`` decodes in its own process while the thread waits). With ``k > 1`` a generation queued
behind others gets a snapshot of the policy (a deep copy, up to ``k − 1`` alive at once), synced into the engine
right before it runs. The batch's ``engine_logprobs`` are the generating policy's log-probs and it carries no
behaviour statistics, so the trainer's old policy is the current one and ``RLVRModule(engine_is_cap=...)``
importance-corrects the staleness. Anything else that uses the engine (validation, probes, a checkpoint) waits for
the background generations first. Under DDP each rank runs its own background generations on its own engine; the
background does no collective (the reward-component names are united over ranks when the batch is built, in the
training thread). A policy sharded across ranks (FSDP2, ZeRO-3) cannot be copied into ``HFEngine`` or
``ProcessEngine``; ``VLLMServerEngine`` gathers its weights for the push (a collective, in the training thread), so
it takes a lag of 1.

Exact resume: :meth:`RolloutDataModule.state_dict` (in every checkpoint) records the epoch's shuffle seed, the
prompts already trained, the refill sampler and the global RNG states — of every rank when there are several (the
rank shards are Lightning's ``DistributedSampler`` order); after a resume the epoch continues with its remaining
prompts and the RNG states are set again right before the first rollout.
"""

from __future__ import annotations

import copy
import os
import random
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from lightning_rlvr.algorithms.sampling import informative_groups, overlong_penalty
from lightning_rlvr.data.batch import RolloutBatch
from lightning_rlvr.data.sources import BuiltinTask, PromptSource
from lightning_rlvr.distributed import all_max, all_union, world_size
from lightning_rlvr.metrics.pass_at_k import pass_at_k
from lightning_rlvr.metrics.rcea import majority_vote_correct
from lightning_rlvr.rng import rng_state, set_rng_state
from lightning_rlvr.rollout.base import RolloutEngine, SamplingConfig
from lightning_rlvr.rollout.hf import HFEngine
from lightning_rlvr.rollout.stops import resolve_stop_token_ids
from lightning_rlvr.sharding import is_sharded
from lightning_rlvr.tasks import Problem
from lightning_rlvr.verifiers.base import Verifier, VerifierRunner
from lightning_rlvr.verifiers.exact import ExactMatchVerifier

__all__ = ["RolloutDataModule"]


class _ProblemDataset(Dataset):
    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems

    def __len__(self) -> int:
        return len(self.problems)

    def __getitem__(self, index: int) -> Problem:
        return self.problems[index]


class _ResumableShuffle(Sampler[int]):
    """``RandomSampler`` order (a per-epoch seed drawn from torch's global RNG), plus where the epoch stands.

    It draws exactly what ``RandomSampler(shuffle=True)`` draws, so runs are unchanged by it; after a resume it
    replays the interrupted epoch's permutation from its stored seed, starting after the prompts already trained.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.epoch_seed: int | None = None
        self.consumed = 0  # prompts of the current epoch handed to a rollout
        self._resume: tuple[int, int] | None = None

    def position(self) -> dict:
        return {"epoch_seed": self.epoch_seed, "consumed": self.consumed}

    def resume(self, position: dict, inside_epoch: bool) -> None:
        if inside_epoch:  # else the next epoch's seed is drawn from the (restored) global RNG, as it would have been
            self._resume = (position["epoch_seed"], position["consumed"])

    def __len__(self) -> int:
        return self.size  # the full epoch: Lightning's restored batch counter covers the skipped part

    def __iter__(self):
        if self._resume is not None:
            (seed, start), self._resume = self._resume, None
        else:
            seed, start = int(torch.empty((), dtype=torch.int64).random_().item()), 0
        self.epoch_seed, self.consumed = seed, start
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.order = torch.randperm(self.size, generator=generator).tolist()
        yield from self.order[start:]

    def upcoming(self, count: int) -> list[int] | None:
        """The indices of the next ``count`` prompts of this epoch, or ``None`` past its end."""
        return _upcoming(self, count)


class _ResumableDistributedShuffle(DistributedSampler):
    """Lightning's ``DistributedSampler`` order (seeded by ``PL_GLOBAL_SEED`` and the epoch, disjoint rank shards),
    plus where the epoch stands, so a multi-rank resume continues the interrupted epoch.

    Being a ``DistributedSampler``, Lightning keeps it instead of injecting its own, and calls ``set_epoch`` on it.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.consumed = 0  # this rank's prompts of the current epoch handed to a rollout
        self.started = False
        self._resume: tuple[int, int] | None = None

    def position(self) -> dict:
        return {"epoch": self.epoch if self.started else None, "seed": self.seed, "consumed": self.consumed}

    def resume(self, position: dict, inside_epoch: bool) -> None:
        self.seed = position["seed"]  # the run's order, even if the resumed process was seeded differently
        if inside_epoch:
            self._resume = (position["epoch"], position["consumed"])

    def __iter__(self):
        start = 0
        if self._resume is not None:
            (epoch, consumed), self._resume = self._resume, None
            start = consumed if epoch == self.epoch else 0
        self.started, self.consumed = True, start
        self.order = list(super().__iter__())
        yield from self.order[start:]

    def upcoming(self, count: int) -> list[int] | None:
        """The indices of this rank's next ``count`` prompts of this epoch, or ``None`` past its end."""
        return _upcoming(self, count)


def _upcoming(sampler, count: int) -> list[int] | None:
    order = getattr(sampler, "order", None)
    if order is None or sampler.consumed + count > len(order):
        return None
    return order[sampler.consumed : sampler.consumed + count]


def _as_list(items: list[Problem]) -> list[Problem]:
    return list(items)


@dataclass
class _Scored:
    """One scored completion before batching."""

    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    answer: str
    score: float
    truncated: bool
    invalid: bool
    logprobs: list[float] | None = None  # the engine's log-probs of completion_ids, if it returned them
    behaviour: torch.Tensor | None = None  # (T_round, 3): log-prob, entropy, S̄ per token of the engine's row
    components: dict[str, float] = field(default_factory=dict)  # the verifier's named components
    failed: bool = False  # the verifier raised, hung or returned a non-finite value

    @property
    def verdict(self) -> str:
        if self.truncated:
            return "truncated"
        if self.invalid:
            return "invalid"
        if self.failed:
            return "error"
        return "correct" if self.score > 0.5 else "wrong"


@dataclass
class _Generated:
    """A rollout's kept rows, the policy version that generated them and its statistics, not yet a batch."""

    rows: list[_Scored]
    version: int
    stats: dict[str, float]


@dataclass
class _Prefetch:
    """A rollout generating in the background for an upcoming step's prompts."""

    problems: list[Problem]
    future: Future

    def matches(self, problems: list[Problem]) -> bool:
        return [(p.prompt, p.answer) for p in self.problems] == [(p.prompt, p.answer) for p in problems]


def _component_names(rows: list[_Scored]) -> set[str]:
    return {name for r in rows for name in r.components}


class RolloutDataModule(pl.LightningDataModule):
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
        if "{prompt}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{prompt}}', got {prompt_template!r}")
        try:
            prompt_template.format(prompt="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"prompt_template {prompt_template!r} is not a valid str.format template ({err!r}); "
                             "write literal braces twice, e.g. \\boxed{{}}") from err
        if stop_token_ids is not None and any(not isinstance(i, int) or i < 0 for i in stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (ints >= 0), got {stop_token_ids!r}")
        if system_prompt is not None and not chat_template:
            raise ValueError("system_prompt needs chat_template=True (a plain prompt has no system message)")
        if not isinstance(max_policy_lag, int) or max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be an int >= 0 (0: on-policy; k: rollouts generated up to k steps "
                             f"ahead), got {max_policy_lag!r}")
        self.source = source if source is not None else BuiltinTask()
        if verifier is None:
            verifier = self.source.default_verifier() or ExactMatchVerifier()
        self.verifier = verifier
        self.engine = engine if engine is not None else HFEngine()
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.sampling = SamplingConfig(max_new_tokens, temperature, top_p, top_k)
        self.prompt_template = prompt_template
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.extra_stop_token_ids = tuple(stop_token_ids or ())
        self.stop_token_ids: tuple[int, ...] = ()  # resolved in connect()
        self.end_token_id: int | None = None
        self.dynamic_sampling = dynamic_sampling
        self.max_generation_rounds = max_generation_rounds
        self.overlong_buffer = overlong_buffer
        self.overlong_penalty_factor = overlong_penalty_factor
        self.val_batch_size = val_batch_size
        self.val_max_prompts = val_max_prompts
        self.val_samples = val_samples
        self.val_k = val_k
        self.runner = VerifierRunner(self.verifier, verifier_timeout_s, verifier_workers)
        self._refill_rng = random.Random(seed)
        self.tokenizer = None
        self._prompt_cache: dict[str, list[int]] = {}
        self._synced_version: int | None = None
        self._shuffle: _ResumableShuffle | _ResumableDistributedShuffle | None = None
        self._restored: dict | None = None
        self.max_policy_lag = max_policy_lag
        self.seed = seed
        self._generations = 0  # background-mode generations so far: each one's sampler seed
        self._pending: deque[_Prefetch] = deque()  # background generations for the next steps, in step order
        self._executor: ThreadPoolExecutor | None = None

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
        self._wait_for_background()  # a background refill draws from the refill sampler
        version, internal, gauss = self._refill_rng.getstate()
        state = {**(self._shuffle.position() if self._shuffle is not None else {"consumed": 0}),
                 "refill_rng": [version, list(internal), gauss], "rng": rng_state(), "generations": self._generations}
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
        self._generations = int(state_dict.get("generations", 0))
        self._restored = state_dict

    # -- wiring --------------------------------------------------------------------------------------------
    def connect(self, tokenizer, generation_config=None) -> None:
        """Give the DataModule the policy's tokenizer and generation config (done in :meth:`setup` under a Trainer).

        The stop ids are resolved here, once, for every generation: the generation config's ``eos_token_id`` (int
        or list), the tokenizer's EOS and ``stop_token_ids``
        (:func:`~lightning_rlvr.rollout.stops.resolve_stop_token_ids`).
        """
        self.stop_token_ids = resolve_stop_token_ids(tokenizer, generation_config, self.extra_stop_token_ids)
        self.sampling = replace(self.sampling, stop_token_ids=self.stop_token_ids)
        # What a completion the policy is taught to write ends with (the warm start): the tokenizer's EOS, which
        # for a chat checkpoint is the end of an assistant turn (<|im_end|>), else the first stop id.
        self.end_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else self.stop_token_ids[0]
        if self.chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"chat_template=True but the tokenizer of {tokenizer.name_or_path!r} has no chat "
                             f"template; use a chat / instruct checkpoint, or chat_template=False")
        self.tokenizer = tokenizer
        self._special_ids = set(tokenizer.all_special_ids)
        self._vocabulary_size = len(tokenizer)  # a model's embedding may have more rows (Qwen pads it to 64s)
        self._prompt_cache.clear()

    def setup(self, stage: str) -> None:
        if self.max_policy_lag:
            if not getattr(self.engine, "holds_own_weights", False):
                raise ValueError(f"max_policy_lag={self.max_policy_lag} generates while the policy trains: the engine "
                                 f"needs its own copy of the weights, e.g. HFEngine(weights='copy'), ProcessEngine() "
                                 f"or VLLMServerEngine(); {type(self.engine).__name__} generates with the live policy")
        if self.tokenizer is None and self.trainer is not None:
            module = self.trainer.lightning_module
            tokenizer = getattr(module, "tokenizer", None)
            if tokenizer is None:
                raise RuntimeError("RolloutDataModule needs a LightningModule with a `tokenizer` attribute")
            self.connect(tokenizer, getattr(module, "generation_config", None))

    def teardown(self, stage: str) -> None:
        if self._executor is not None:
            self._wait_for_background()
            self._pending.clear()
            self._executor.shutdown()
            self._executor = None
        self.engine.close()
        self._synced_version = None  # a closed engine holds no weights: the next fit syncs again
        self.runner.close()

    def train_dataloader(self) -> DataLoader:
        problems = self.source.train_problems()
        if len(problems) < self.prompts_per_step:
            raise ValueError(f"{len(problems)} training problems, fewer than prompts_per_step={self.prompts_per_step}")
        dataset = _ProblemDataset(problems)
        if self.trainer is not None and self.trainer.world_size > 1:
            self._shuffle = _ResumableDistributedShuffle(dataset, seed=int(os.getenv("PL_GLOBAL_SEED", 0)),
                                                         **self.trainer.strategy.distributed_sampler_kwargs)
            started = "epoch"
        else:
            self._shuffle = _ResumableShuffle(len(problems))
            started = "epoch_seed"
        restored = self._restored
        if restored is not None and restored.get(started) is not None:
            inside_epoch = restored["consumed"] + self.prompts_per_step <= len(self._shuffle)
            self._shuffle.resume(restored, inside_epoch)
            if not inside_epoch:  # the next epoch's shuffle draws from the checkpoint's RNG states, as it would have
                set_rng_state(restored["rng"])
                self._restored = None
        return DataLoader(dataset, batch_size=self.prompts_per_step, sampler=self._shuffle, drop_last=True,
                          collate_fn=_as_list)

    def val_dataloader(self) -> DataLoader:
        problems = self.source.held_out_problems()[: self.val_max_prompts]
        return DataLoader(_ProblemDataset(problems), batch_size=self.val_batch_size, shuffle=False,
                          collate_fn=_as_list)

    # -- generation ----------------------------------------------------------------------------------------
    def prompt_ids(self, problem: Problem) -> list[int]:
        """The token ids the policy is prompted with for ``problem`` (cached per prompt text).

        ``prompt_template`` filled with the prompt, then either tokenized with the tokenizer's special tokens or,
        with ``chat_template=True``, sent as the user message (after an optional system message) through the
        tokenizer's chat template with the generation prompt appended. The rendered chat text is tokenized
        without adding special tokens: chat templates write their own (e.g. a BOS), as TRL and verl do.
        """
        ids = self._prompt_cache.get(problem.prompt)
        if ids is None:
            content = self.prompt_template.format(prompt=problem.prompt)
            if self.chat_template:
                messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
                text = self.tokenizer.apply_chat_template(messages + [{"role": "user", "content": content}],
                                                          add_generation_prompt=True, tokenize=False)
                ids = self.tokenizer(text, add_special_tokens=False).input_ids
            else:
                ids = self.tokenizer(content, add_special_tokens=True).input_ids
            self._prompt_cache[problem.prompt] = ids
        return ids

    def _sync_policy(self) -> int:
        module = self.trainer.lightning_module
        version = int(module.policy_version)
        if self._synced_version != version:
            self.engine.sync(module.policy, version)
            self._synced_version = version
        return version

    def _generate_and_score(self, problems: list[Problem], n: int, sampling: SamplingConfig,
                            first_group: int = 0) -> tuple[list[_Scored], int]:
        prompts = [self.prompt_ids(p) for p in problems]
        limit = self.engine.max_prompt_tokens
        for problem, ids in zip(problems, prompts):
            if limit is not None and len(ids) > limit:
                raise ValueError(f"the prompt {problem.prompt[:80]!r} is {len(ids)} tokens long (templates included), "
                                 f"more than the engine takes ({type(self.engine).__name__}: {limit}); raise the "
                                 f"engine's max_model_len or leave such prompts out of the data")
        out = self.engine.generate(prompts, n, sampling)
        stop_ids = set(sampling.stop_token_ids)
        rows: list[_Scored] = []
        to_verify: list[int] = []
        engine_logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        behaviour = None if out.behaviour is None else torch.stack(
            [out.behaviour.logprobs, out.behaviour.entropy, out.behaviour.sbar], dim=-1).cpu()
        for i, (tokens, length, stopped) in enumerate(zip(out.completion_ids.tolist(), out.lengths.tolist(),
                                                          out.stopped.tolist())):
            problem_index = i // n
            if stopped and tokens[length - 1] not in stop_ids:
                raise RuntimeError(f"{type(self.engine).__name__} ended completion {i} on token {tokens[length - 1]}, "
                                   f"which is not a stop id {sorted(stop_ids)}")
            truncated = not stopped
            answer_tokens = tokens[: length - 1] if stopped else tokens[:length]
            invalid = any(t in self._special_ids or t >= self._vocabulary_size for t in answer_tokens)
            text = self.tokenizer.decode(answer_tokens, skip_special_tokens=False)
            rows.append(_Scored(first_group + problem_index, prompts[problem_index], tokens[:length], text,
                                problems[problem_index].answer, 0.0, truncated, invalid,
                                None if engine_logprobs is None else engine_logprobs[i][:length],
                                None if behaviour is None else behaviour[i]))
            if not truncated and not invalid:
                to_verify.append(i)
        verdicts = self.runner.verify_batch([rows[i].text for i in to_verify], [rows[i].answer for i in to_verify])
        for i, verdict in zip(to_verify, verdicts):
            rows[i].score, rows[i].components, rows[i].failed = verdict.reward, verdict.components, verdict.failed
        return rows, sum(v.failed for v in verdicts)

    def rollout(self, problems: list[Problem]) -> RolloutBatch:
        """Generate, verify and batch ``group_size`` completions for each prompt (with ``max_policy_lag > 0``: take
        the batch generated in the background for this step, and queue the next ones)."""
        if self.tokenizer is None:
            raise RuntimeError("RolloutDataModule.rollout called before setup()/connect(tokenizer)")
        if self._restored is not None:  # the first step after a resume starts from the checkpoint's RNG states
            set_rng_state(self._restored["rng"])
            self._restored = None
        if self._shuffle is not None:
            self._shuffle.consumed += len(problems)
        start = time.perf_counter()
        if self.max_policy_lag:
            batch = self._lagged_rollout(problems)
        else:
            version = self._sync_policy()
            # The engine's behaviour stats replace the trainer's no-grad pass, if the trainer would run one.
            wants = getattr(self.trainer.lightning_module, "wants_behaviour_stats", None)
            batch = self._batch(self._generate(problems, version,
                                               replace(self.sampling, behaviour_stats=bool(wants and wants()))))
        batch.stats["perf/generate_wait_s"] = time.perf_counter() - start
        return batch

    # -- asynchronous rollouts (max_policy_lag=k) -------------------------------------------------------------
    def _lagged_rollout(self, problems: list[Problem]) -> RolloutBatch:
        """This step's batch (generated ahead when an earlier step foresaw these prompts, else now), then the queue of
        background generations topped up to the next ``max_policy_lag`` steps, the newest with the weights as they
        are now, before this step's updates."""
        pending = self._pending.popleft() if self._pending else None
        if pending is not None and pending.matches(problems):
            generated = pending.future.result()  # re-raises what went wrong in the background
        else:  # prompts not foreseen (never expected): what was generated ahead is dropped
            for dropped in ([pending] if pending is not None else []) + list(self._pending):
                dropped.future.exception()
            self._pending.clear()
            generated = self._background_generation(problems).result()
        batch = self._generating_policy_batch(generated)
        if self._shuffle is not None:
            dataset = self.source.train_problems()
            while len(self._pending) < self.max_policy_lag:
                # the prompts of the step after the last one queued; none: the epoch ends first (its successor's
                # first step generates in the foreground)
                upcoming = self._shuffle.upcoming((len(self._pending) + 1) * self.prompts_per_step)
                if upcoming is None:
                    break
                next_problems = [dataset[i] for i in upcoming[-self.prompts_per_step:]]
                self._pending.append(_Prefetch(next_problems, self._background_generation(next_problems)))
        return batch

    def _background_generation(self, problems: list[Problem]) -> Future:
        """Generate ``problems`` in the background with the weights as they are now and a sampler of its own (the
        training thread keeps torch's global random stream).

        With no generation queued the weights are synced into the engine here, in the calling thread. Behind queued
        ones (``max_policy_lag > 1``) the engine's weights belong to those until they finish, so a snapshot of the
        policy is taken here and synced in the background right before this generation.
        """
        module = self.trainer.lightning_module
        version = int(module.policy_version)
        snapshot = None
        if not self._pending:
            self._sync_policy()
        elif self._synced_version != version:
            snapshot = copy.deepcopy(module.policy)
            self._synced_version = version  # what the engine holds once the queue has run
        self._generations += 1
        seed = self.seed * 1_000_003 + self._generations
        # the decoding loop's float32 stats give the log-probs for free; where it has none (bf16), the engine scores
        sampling = replace(self.sampling, behaviour_stats=True, logprobs=True)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        return self._executor.submit(self._generate_in_background, problems, version, sampling, snapshot, seed,
                                     module.device)

    def _generate_in_background(self, problems: list[Problem], version: int, sampling: SamplingConfig,
                                snapshot: torch.nn.Module | None, seed: int, device: torch.device) -> _Generated:
        if snapshot is not None:
            self.engine.sync(snapshot, version)
        self.engine.generator = torch.Generator(device=device).manual_seed(seed)
        return self._generate(problems, version, sampling)

    def _generating_policy_batch(self, generated: _Generated) -> RolloutBatch:
        """The batch of rows generated in the background (built here, in the training thread, where the reward-component
        names may be united over ranks), whose ``engine_logprobs`` are the generating policy's log-probs and which
        carries no behaviour stats: the trainer's old policy is the current one, and the gap is importance-corrected."""
        batch = self._batch(generated)
        if batch.engine_logprobs is None:
            raise RuntimeError(f"max_policy_lag={self.max_policy_lag}: {type(self.engine).__name__} returned no "
                               f"log-probs of the policy that generated the batch (SamplingConfig.logprobs asks for "
                               f"them)")
        return replace(batch, behaviour_logprobs=None, behaviour_entropy=None, behaviour_sbar=None)

    def _wait_for_background(self) -> None:
        """Let the background generations finish before anything else uses the engine (validation, probes, a
        checkpoint's refill-sampler state); their rows are kept for the steps they were made for."""
        for pending in self._pending:
            pending.future.exception()
        if self.max_policy_lag:
            self.engine.generator = None  # evaluations and probes draw from torch's global random stream, as at lag 0

    def _generate(self, problems: list[Problem], version: int, sampling: SamplingConfig) -> _Generated:
        """Generate, verify and refill (dynamic sampling) ``problems`` with the engine's weights (``version``): the
        kept rows and the rollout's statistics (no collective but the lockstep of sharded generation)."""
        kept: list[_Scored] = []
        all_rows: list[_Scored] = []
        errors, rounds, n_groups_seen, n_groups_kept = 0, 0, 0, 0
        first_round_zero_std = 0.0
        pending = list(problems)
        last_rows: list[_Scored] = []
        # A sharded policy (FSDP2, ZeRO-3) generates collectively: every rank must run as many rounds as the
        # busiest one, so a rank that is done runs idle rounds (one prompt, discarded) until all are done. An engine
        # with weights of its own (a vLLM server fed the gathered weights) generates alone: no lockstep, which could
        # not run in the background thread of a lag anyway.
        lockstep = (self.dynamic_sampling and world_size() > 1 and is_sharded(self.trainer.lightning_module.policy)
                    and not getattr(self.engine, "holds_own_weights", False))
        idle = False
        while True:
            if idle:
                self.engine.generate([self.prompt_ids(pending[0])], self.group_size, sampling)
                if self._all_ranks_done(True):
                    break
                continue
            rounds += 1
            rows, round_errors = self._generate_and_score(pending, self.group_size, sampling, n_groups_seen)
            errors += round_errors
            all_rows += rows
            last_rows = rows
            rewards = self._shaped_rewards(rows)
            group_ids = torch.tensor([r.group for r in rows])
            informative = informative_groups(rewards, group_ids, keep_singletons=True)
            n_informative = int(informative.view(len(pending), self.group_size)[:, 0].sum()) if self.group_size > 1 \
                else len(pending)
            if rounds == 1:
                first_round_zero_std = 1.0 - n_informative / len(pending)
            n_groups_seen += len(pending)
            if not self.dynamic_sampling:
                kept = rows
                n_groups_kept = len(pending)
                break
            kept += [r for r, keep in zip(rows, informative.tolist()) if keep]
            n_groups_kept += n_informative
            done = n_groups_kept >= self.prompts_per_step or rounds >= self.max_generation_rounds
            if lockstep and not self._all_ranks_done(done):
                idle = done  # wait in idle rounds for the other ranks
            elif done:
                break
            if idle:
                continue
            missing = self.prompts_per_step - n_groups_kept
            pending = self._refill_rng.sample(self.source.train_problems(), missing)
        if self.dynamic_sampling:
            if n_groups_kept == 0:
                rank_zero_warn("dynamic sampling kept no informative group; "
                               "training on the last (zero-advantage) round")
                kept, n_groups_kept = last_rows, len(last_rows) // self.group_size
            elif n_groups_kept > self.prompts_per_step:  # truncate to exactly prompts_per_step groups (DAPO)
                keep_groups = sorted({r.group for r in kept})[: self.prompts_per_step]
                kept = [r for r in kept if r.group in set(keep_groups)]
                n_groups_kept = self.prompts_per_step
            elif n_groups_kept < self.prompts_per_step:
                rank_zero_warn(
                    f"dynamic sampling kept {n_groups_kept}/{self.prompts_per_step} groups after "
                    f"{rounds} rounds (max_generation_rounds); training on fewer prompts this step"
                )
        self.engine.release()  # all rounds are generated: the update may have the memory
        generated = len(all_rows)
        return _Generated(kept, version, {
            "reward/verifier_errors": float(errors),
            "rollout/zero_std_groups": first_round_zero_std,
            "rollout/generation_rounds": float(rounds),
            "rollout/kept_groups": float(n_groups_kept),
            "rollout/truncated": sum(r.truncated for r in all_rows) / generated,
            "rollout/invalid": sum(r.invalid for r in all_rows) / generated,
        })

    def _batch(self, generated: _Generated) -> RolloutBatch:
        """The training batch of generated rows, built in the training thread: the reward-component names are united
        over ranks (a collective), so that every rank logs the same reward/<name> metrics, averaged over ranks in one
        all-reduce (a rank whose rows lack a component logs its mean 0)."""
        names = _component_names(generated.rows)
        batch = self._to_batch(generated.rows, generated.version, sorted(all_union(names)))
        batch.stats.update(generated.stats)
        return batch

    def _all_ranks_done(self, done: bool) -> bool:
        return bool(-all_max(torch.tensor([-float(done)], device=self.trainer.lightning_module.device)).item())

    def _shaped_rewards(self, rows: list[_Scored]) -> torch.Tensor:
        rewards = torch.tensor([r.score for r in rows], dtype=torch.float32)
        if self.overlong_buffer > 0:
            lengths = torch.tensor([len(r.completion_ids) for r in rows])
            rewards = rewards + overlong_penalty(lengths, self.sampling.max_new_tokens, self.overlong_buffer,
                                                 self.overlong_penalty_factor)
        return rewards

    def _to_batch(self, rows: list[_Scored], version: int, component_names: list[str] | None = None) -> RolloutBatch:
        """Batch ``rows``; ``component_names`` (default: those the rows have) are the reward components kept."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_token_ids[0]
        prompt_ids, prompt_mask = RolloutEngine.left_pad([r.prompt_ids for r in rows], pad)
        width = max(len(r.completion_ids) for r in rows)
        # Right-padded nested lists, one tensor each (a copy per row would dominate on small batches).
        completion = torch.tensor([r.completion_ids + [pad] * (width - len(r.completion_ids)) for r in rows],
                                  dtype=torch.long)
        response_mask = torch.tensor([[1.0] * len(r.completion_ids) + [0.0] * (width - len(r.completion_ids))
                                      for r in rows], dtype=torch.float32)
        with_logprobs = all(r.logprobs is not None for r in rows)
        engine_logprobs = torch.tensor([list(r.logprobs) + [0.0] * (width - len(r.logprobs)) for r in rows],
                                       dtype=torch.float32) if with_logprobs else None
        behaviour: list[torch.Tensor | None] = [None, None, None]
        if all(r.behaviour is not None for r in rows):
            # Rows keep their round's full width; past each row's EOS the values are zeroed like the other fields.
            stacked = torch.nn.utils.rnn.pad_sequence([r.behaviour for r in rows], batch_first=True)[:, :width]
            behaviour = [t.contiguous() for t in (stacked * response_mask.unsqueeze(-1)).unbind(-1)]
        # Group ids are renumbered 0..n_groups-1 in order of appearance.
        remap: dict[int, int] = {}
        group_ids = torch.tensor([remap.setdefault(r.group, len(remap)) for r in rows], dtype=torch.long)
        scores = torch.tensor([r.score for r in rows], dtype=torch.float32)
        rewards = self._shaped_rewards(rows)
        correct = scores > 0.5
        lengths = response_mask.sum(-1)
        components = {name: torch.tensor([r.components.get(name, 0.0) for r in rows], dtype=torch.float32)
                      for name in (sorted(_component_names(rows)) if component_names is None else component_names)}
        return RolloutBatch(
            input_ids=torch.cat([prompt_ids, completion], dim=1),
            attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
            response_mask=response_mask,
            prompt_length=prompt_ids.shape[1],
            rewards=rewards,
            scores=scores,
            correct=correct,
            truncated=torch.tensor([r.truncated for r in rows]),
            group_ids=group_ids,
            policy_version=version,
            temperature=self.sampling.temperature,
            completions=[r.text for r in rows],
            answers=[r.answer for r in rows],
            verdicts=[r.verdict for r in rows],
            reward_components=components,
            engine_logprobs=engine_logprobs,
            behaviour_logprobs=behaviour[0],
            behaviour_entropy=behaviour[1],
            behaviour_sbar=behaviour[2],
            stats={
                "reward/mean": rewards.mean().item(),
                "reward/accuracy": correct.float().mean().item(),
                "rollout/response_length": lengths.mean().item(),
                "rollout/response_length_max": lengths.max().item(),
                **{f"reward/{name}": values.mean().item() for name, values in components.items()},
            },
        )

    # -- evaluation ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def sample_batch(self, problems: list[Problem], n: int) -> RolloutBatch:
        """``n`` scored completions per problem with the current policy and the training sampling settings, as a
        :class:`RolloutBatch` (rows grouped by problem, in order); for diagnostics that need the completions' tokens,
        e.g. their entropy under the policy. Nothing is filtered: no dynamic sampling."""
        if self.tokenizer is None:
            raise RuntimeError("RolloutDataModule.sample_batch called before setup()/connect(tokenizer)")
        self._wait_for_background()
        version = self._sync_policy()
        rows, _ = self._generate_and_score(problems, n, self.sampling)
        self.engine.release()
        return self._to_batch(rows, version)

    @torch.no_grad()
    def sample_completions(self, problems: list[Problem], n: int) -> list[list[tuple[str, bool]]]:
        """``n`` completions per problem with the current policy and the training sampling settings.

        Returns per problem a list of ``(text, correct)``; for diagnostics (e.g. mode retention on a probe set).
        """
        if self.tokenizer is None:
            raise RuntimeError("RolloutDataModule.sample_completions called before setup()/connect(tokenizer)")
        self._wait_for_background()
        self._sync_policy()
        rows, _ = self._generate_and_score(problems, n, self.sampling)
        self.engine.release()
        return [[(r.text, r.score > 0.5) for r in rows[i * n : (i + 1) * n]] for i in range(len(problems))]

    @torch.no_grad()
    def evaluate(self, problems: list[Problem]) -> dict[str, torch.Tensor]:
        """Greedy correctness and (if ``val_samples > 0``) unbiased pass@k and maj@k per held-out problem.

        maj@k votes over the first ``val_k`` of the ``val_samples`` samples, by the verifier's ``answer_key``.
        """
        if self.tokenizer is None:
            raise RuntimeError("RolloutDataModule.evaluate called before setup()/connect(tokenizer)")
        self._wait_for_background()
        self._sync_policy()
        greedy = replace(self.sampling, greedy=True)
        rows, _ = self._generate_and_score(problems, 1, greedy)
        result = {"greedy_correct": torch.tensor([r.score > 0.5 for r in rows], dtype=torch.float32)}
        if self.val_samples > 0:
            rows, _ = self._generate_and_score(problems, self.val_samples, self.sampling)
            correct = torch.tensor([r.score > 0.5 for r in rows], dtype=torch.float32).view(len(problems), -1)
            result["pass_at_k"] = pass_at_k(self.val_samples, correct.sum(-1), self.val_k)
            k = self.val_k
            keys = [[self.verifier.answer_key(r.text) for r in rows[i * self.val_samples : i * self.val_samples + k]]
                    for i in range(len(problems))]
            result["maj_at_k"] = majority_vote_correct(keys, correct[:, :k].bool())
        return result
