"""Pure functions of RLVR losses and advantages (no Lightning imports; each tested against a reference)."""

from lightning_rlvr.algorithms.advantages import grpo_advantages, group_mean_std, rloo_advantages
from lightning_rlvr.algorithms.aggregation import (
    AGGREGATION_MODES,
    AggregationMode,
    aggregate_loss,
    aggregation_normalizer,
)
from lightning_rlvr.algorithms.kl import KLEstimator, kl_penalty
from lightning_rlvr.algorithms.policy_loss import PolicyLossOutput, ppo_clip_loss
from lightning_rlvr.algorithms.sampling import informative_groups, overlong_penalty

__all__ = [
    "AGGREGATION_MODES",
    "AggregationMode",
    "KLEstimator",
    "PolicyLossOutput",
    "aggregate_loss",
    "aggregation_normalizer",
    "grpo_advantages",
    "group_mean_std",
    "informative_groups",
    "kl_penalty",
    "overlong_penalty",
    "ppo_clip_loss",
    "rloo_advantages",
]
