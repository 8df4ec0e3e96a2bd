"""One rollout's generation rounds: a single round, or DAPO's dynamic sampling (arXiv 2503.14476), which keeps only
groups whose rewards are not all equal and generates again for fresh prompts until ``prompts_per_step`` informative
groups are kept or ``max_generation_rounds`` is reached.

A policy sharded across ranks (FSDP2, ZeRO-3) generates collectively: every rank must run as many rounds as the
busiest one, so a rank that is done runs idle rounds (one prompt, discarded) until all are done. An engine with weights
of its own (a vLLM server fed the gathered weights) generates alone: no lockstep, which could not run in the
background thread of a policy lag anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_rlvr.algorithms.sampling import informative_groups
from lightning_rlvr.data.scoring import GeneratedRollout, ScoredCompletion
from lightning_rlvr.distributed import all_max, world_size
from lightning_rlvr.sharding import is_sharded
from lightning_rlvr.tasks import Problem

__all__ = ["RoundSettings", "all_ranks_done", "generate_rounds", "needs_lockstep"]

#: ``round(problems, first_group) -> (scored rows, verifier failures)``: one generate-and-verify round.
Round = Callable[[list[Problem], int], tuple[list[ScoredCompletion], int]]


@dataclass(frozen=True)
class RoundSettings:
    """What decides how many rounds a rollout runs and which rows it keeps."""

    prompts_per_step: int
    group_size: int
    dynamic_sampling: bool
    max_generation_rounds: int


def needs_lockstep(dynamic_sampling: bool, policy: torch.nn.Module | None, engine) -> bool:
    """Whether ranks must run the same number of rounds: refills, several ranks, a sharded policy that the engine
    generates with (not one with weights of its own)."""
    return (dynamic_sampling and world_size() > 1 and is_sharded(policy)
            and not getattr(engine, "holds_own_weights", False))


def all_ranks_done(done: bool, device: torch.device) -> bool:
    """Whether every rank is done (a collective every rank must run)."""
    return bool(-all_max(torch.tensor([-float(done)], device=device)).item())


def generate_rounds(run_round: Round, idle_round: Callable[[list[Problem]], object],
                    refill: Callable[[int], list[Problem]],
                    problems: list[Problem], version: int, settings: RoundSettings,
                    shaped_rewards: Callable[[list[ScoredCompletion]], torch.Tensor],
                    lockstep_device: torch.device | None = None) -> GeneratedRollout:
    """Run the rounds of one rollout of ``problems`` and keep its rows.

    Args:
        run_round: generates and verifies ``group_size`` completions per problem.
        idle_round: ``idle_round(pending)``: one discarded round on the first of the last round's problems, while
            this rank waits for the others (lockstep only).
        refill: ``refill(missing)`` draws that many fresh problems for the next round.
        problems: the step's prompts.
        version: the policy version the engine generates with.
        settings: group size, prompts per step, dynamic sampling and its round limit.
        shaped_rewards: ``shaped_rewards(rows)``, the rewards that decide which groups are informative.
        lockstep_device: run as many rounds as the busiest rank, agreeing on it with a collective on this device
            (``None``: no lockstep; :func:`needs_lockstep` says when it is needed).

    Returns:
        The kept rows (exactly ``prompts_per_step`` groups when dynamic sampling found enough) and the rollout's
        statistics.
    """
    group_size, wanted = settings.group_size, settings.prompts_per_step
    kept: list[ScoredCompletion] = []
    all_rows: list[ScoredCompletion] = []
    errors, rounds, n_groups_seen, n_groups_kept = 0, 0, 0, 0
    first_round_zero_std = 0.0
    pending = list(problems)
    last_rows: list[ScoredCompletion] = []
    idle = False
    while True:
        if idle:
            idle_round(pending)
            if all_ranks_done(True, lockstep_device):
                break
            continue
        rounds += 1
        rows, round_errors = run_round(pending, n_groups_seen)
        errors += round_errors
        all_rows += rows
        last_rows = rows
        rewards = shaped_rewards(rows)
        group_ids = torch.tensor([r.group for r in rows])
        informative = informative_groups(rewards, group_ids, keep_singletons=True)
        n_informative = int(informative.view(len(pending), group_size)[:, 0].sum()) if group_size > 1 \
            else len(pending)
        if rounds == 1:
            first_round_zero_std = 1.0 - n_informative / len(pending)
        n_groups_seen += len(pending)
        if not settings.dynamic_sampling:
            kept = rows
            n_groups_kept = len(pending)
            break
        kept += [r for r, keep in zip(rows, informative.tolist()) if keep]
        n_groups_kept += n_informative
        done = n_groups_kept >= wanted or rounds >= settings.max_generation_rounds
        if lockstep_device is not None and not all_ranks_done(done, lockstep_device):
            idle = done  # wait in idle rounds for the other ranks
        elif done:
            break
        if idle:
            continue
        pending = refill(wanted - n_groups_kept)
    if settings.dynamic_sampling:
        if n_groups_kept == 0:
            rank_zero_warn("dynamic sampling kept no informative group; training on the last (zero-advantage) round")
            kept, n_groups_kept = last_rows, len(last_rows) // group_size
        elif n_groups_kept > wanted:  # truncate to exactly prompts_per_step groups (DAPO)
            keep_groups = sorted({r.group for r in kept})[:wanted]
            kept = [r for r in kept if r.group in set(keep_groups)]
            n_groups_kept = wanted
        elif n_groups_kept < wanted:
            rank_zero_warn(f"dynamic sampling kept {n_groups_kept}/{wanted} groups after {rounds} rounds "
                           f"(max_generation_rounds); training on fewer prompts this step")
    generated = len(all_rows)
    return GeneratedRollout(kept, version, {
        "reward/verifier_errors": float(errors),
        "rollout/zero_std_groups": first_round_zero_std,
        "rollout/generation_rounds": float(rounds),
        "rollout/kept_groups": float(n_groups_kept),
        "rollout/truncated": sum(r.truncated for r in all_rows) / generated,
        "rollout/invalid": sum(r.invalid for r in all_rows) / generated,
    })
