"""Callbacks: the supervised warm start and the entropy interventions (one per file, stackable in list order)."""

from lightning_rlvr.callbacks.adaptive_entropy import AdaptiveEntropy
from lightning_rlvr.callbacks.base import Intervention, MicroBatchContext, Needs, StepContext
from lightning_rlvr.callbacks.clip_cov import ClipCov
from lightning_rlvr.callbacks.entropy_bonus import EntropyBonus
from lightning_rlvr.callbacks.gtpo import GTPO
from lightning_rlvr.callbacks.kl_cov import KLCov
from lightning_rlvr.callbacks.top_entropy_tokens import TopEntropyTokens
from lightning_rlvr.callbacks.warm_start import SupervisedWarmStart

__all__ = [
    "GTPO",
    "AdaptiveEntropy",
    "ClipCov",
    "EntropyBonus",
    "Intervention",
    "KLCov",
    "MicroBatchContext",
    "Needs",
    "StepContext",
    "SupervisedWarmStart",
    "TopEntropyTokens",
]
