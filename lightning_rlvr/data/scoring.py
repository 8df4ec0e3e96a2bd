"""From prompts to a scored training batch: the prompt's token ids, one generate-and-verify round, and the batch.

A completion is cut where the engine says it ended: at its first stop id (:mod:`lightning_rlvr.rollout.stops`; the stop
id is trained on, nothing after it). A completion that reached ``max_new_tokens`` without one is *truncated* and scores
0, and one with a special token, or an id past the tokenizer's vocabulary (the padded embedding rows of Qwen-style
checkpoints, which decode to nothing), inside its answer scores 0: decoding with ``skip_special_tokens`` would let the
policy game the reward (``<pad>4<unk>4`` read as ``44``). The rest are scored by the verifier (a crash or hang scores
0 and is counted), and DAPO's overlong penalty is added to the reward when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_rlvr.algorithms.sampling import overlong_penalty
from lightning_rlvr.data.batch import RolloutBatch
from lightning_rlvr.rollout.base import RolloutEngine, SamplingConfig
from lightning_rlvr.tasks import Problem
from lightning_rlvr.verifiers.base import VerifierRunner

__all__ = ["CompletionScorer", "GeneratedRollout", "PromptFormatter", "ScoredCompletion", "component_names"]


@dataclass
class ScoredCompletion:
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
class GeneratedRollout:
    """A rollout's kept rows, the policy version that generated them and its statistics, not yet a batch."""

    rows: list[ScoredCompletion]
    version: int
    stats: dict[str, float]


def component_names(rows: list[ScoredCompletion]) -> set[str]:
    """The names of the reward components any of ``rows`` has."""
    return {name for r in rows for name in r.components}


class PromptFormatter:
    """The token ids the policy is prompted with: ``template`` filled with the prompt, optionally sent through the
    tokenizer's chat template (cached per prompt text).

    Args:
        template: ``str.format`` template with ``{prompt}``.
        chat_template: send the filled template as the user message through the tokenizer's chat template.
        system_prompt: a system message before it (only with ``chat_template``).
    """

    def __init__(self, template: str = "{prompt}", chat_template: bool = False,
                 system_prompt: str | None = None) -> None:
        if "{prompt}" not in template:
            raise ValueError(f"prompt_template must contain '{{prompt}}', got {template!r}")
        try:
            template.format(prompt="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"prompt_template {template!r} is not a valid str.format template ({err!r}); "
                             "write literal braces twice, e.g. \\boxed{{}}") from err
        if system_prompt is not None and not chat_template:
            raise ValueError("system_prompt needs chat_template=True (a plain prompt has no system message)")
        self.template = template
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.tokenizer = None
        self._cache: dict[str, list[int]] = {}

    def connect(self, tokenizer) -> None:
        if self.chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"chat_template=True but the tokenizer of {tokenizer.name_or_path!r} has no chat "
                             f"template; use a chat / instruct checkpoint, or chat_template=False")
        self.tokenizer = tokenizer
        self._cache.clear()

    def ids(self, problem: Problem) -> list[int]:
        """The rendered chat text is tokenized without adding special tokens: chat templates write their own (e.g. a
        BOS), as TRL and verl do; a plain prompt is tokenized with the tokenizer's special tokens."""
        ids = self._cache.get(problem.prompt)
        if ids is None:
            content = self.template.format(prompt=problem.prompt)
            if self.chat_template:
                messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
                text = self.tokenizer.apply_chat_template(messages + [{"role": "user", "content": content}],
                                                          add_generation_prompt=True, tokenize=False)
                ids = self.tokenizer(text, add_special_tokens=False).input_ids
            else:
                ids = self.tokenizer(content, add_special_tokens=True).input_ids
            self._cache[problem.prompt] = ids
        return ids


class CompletionScorer:
    """Generates, cuts, guards and verifies completions, and batches the scored rows.

    Args:
        runner: the verifier pool.
        overlong_buffer: DAPO's ``L_cache`` (0: no overlong shaping).
        overlong_penalty_factor: the penalty at ``max_new_tokens``.
    """

    def __init__(self, runner: VerifierRunner, overlong_buffer: int = 0, overlong_penalty_factor: float = 1.0) -> None:
        self.runner = runner
        self.overlong_buffer = overlong_buffer
        self.overlong_penalty_factor = overlong_penalty_factor
        self.tokenizer = None
        self.pad_token_id: int | None = None

    def connect(self, tokenizer, stop_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_token_ids[0]
        self._special_ids = set(tokenizer.all_special_ids)
        self._vocabulary_size = len(tokenizer)  # a model's embedding may have more rows (Qwen pads it to 64s)

    def generate_and_score(self, engine: RolloutEngine, problems: list[Problem], prompts: list[list[int]], n: int,
                           sampling: SamplingConfig, first_group: int = 0) -> tuple[list[ScoredCompletion], int]:
        """``n`` completions of each prompt, scored: the rows (group ids from ``first_group``) and the number of
        verifier failures."""
        limit = engine.max_prompt_tokens
        for problem, ids in zip(problems, prompts):
            if limit is not None and len(ids) > limit:
                raise ValueError(f"the prompt {problem.prompt[:80]!r} is {len(ids)} tokens long (templates included), "
                                 f"more than the engine takes ({type(engine).__name__}: {limit}); raise the "
                                 f"engine's max_model_len or leave such prompts out of the data")
        out = engine.generate(prompts, n, sampling)
        stop_ids = set(sampling.stop_token_ids)
        rows: list[ScoredCompletion] = []
        to_verify: list[int] = []
        engine_logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        behaviour = None if out.behaviour is None else torch.stack(
            [out.behaviour.logprobs, out.behaviour.entropy, out.behaviour.sbar], dim=-1).cpu()
        for i, (tokens, length, stopped) in enumerate(zip(out.completion_ids.tolist(), out.lengths.tolist(),
                                                          out.stopped.tolist())):
            problem_index = i // n
            if stopped and tokens[length - 1] not in stop_ids:
                raise RuntimeError(f"{type(engine).__name__} ended completion {i} on token {tokens[length - 1]}, "
                                   f"which is not a stop id {sorted(stop_ids)}")
            truncated = not stopped
            answer_tokens = tokens[: length - 1] if stopped else tokens[:length]
            invalid = any(t in self._special_ids or t >= self._vocabulary_size for t in answer_tokens)
            text = self.tokenizer.decode(answer_tokens, skip_special_tokens=False)
            rows.append(ScoredCompletion(first_group + problem_index, prompts[problem_index], tokens[:length], text,
                                         problems[problem_index].answer, 0.0, truncated, invalid,
                                         None if engine_logprobs is None else engine_logprobs[i][:length],
                                         None if behaviour is None else behaviour[i]))
            if not truncated and not invalid:
                to_verify.append(i)
        verdicts = self.runner.verify_batch([rows[i].text for i in to_verify], [rows[i].answer for i in to_verify])
        for i, verdict in zip(to_verify, verdicts):
            rows[i].score, rows[i].components, rows[i].failed = verdict.reward, verdict.components, verdict.failed
        return rows, sum(v.failed for v in verdicts)

    def shaped_rewards(self, rows: list[ScoredCompletion], max_new_tokens: int) -> torch.Tensor:
        """The verifier's scores plus DAPO's overlong penalty (with ``overlong_buffer > 0``)."""
        rewards = torch.tensor([r.score for r in rows], dtype=torch.float32)
        if self.overlong_buffer > 0:
            lengths = torch.tensor([len(r.completion_ids) for r in rows])
            rewards = rewards + overlong_penalty(lengths, max_new_tokens, self.overlong_buffer,
                                                 self.overlong_penalty_factor)
        return rewards

    def to_batch(self, rows: list[ScoredCompletion], version: int, sampling: SamplingConfig,
                 component_names_kept: list[str] | None = None) -> RolloutBatch:
        """Batch ``rows``; ``component_names_kept`` (default: those the rows have) are the reward components kept."""
        pad = self.pad_token_id
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
        rewards = self.shaped_rewards(rows, sampling.max_new_tokens)
        correct = scores > 0.5
        lengths = response_mask.sum(-1)
        names = sorted(component_names(rows)) if component_names_kept is None else component_names_kept
        components = {name: torch.tensor([r.components.get(name, 0.0) for r in rows], dtype=torch.float32)
                      for name in names}
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
            temperature=sampling.temperature,
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
