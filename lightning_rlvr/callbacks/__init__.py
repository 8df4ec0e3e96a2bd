"""Callbacks: the supervised warm start and the entropy interventions (one per file, stackable in list order)."""

from lightning_rlvr.callbacks.adaptive_entropy import AdaptiveEntropy
from lightning_rlvr.callbacks.base import Intervention, MicroBatchContext, Needs, StepContext
from lightning_rlvr.callbacks.clip_cov import ClipCov
from lightning_rlvr.callbacks.entropy_bonus import EntropyBonus
from lightning_rlvr.callbacks.entropy_change_probe import EntropyChangeProbe
from lightning_rlvr.callbacks.entropy_performance_analysis import EntropyPerformanceAnalysis
from lightning_rlvr.callbacks.ep_grpo import EPGRPO
from lightning_rlvr.callbacks.gtpo import GTPO
from lightning_rlvr.callbacks.hapo import HAPO
from lightning_rlvr.callbacks.kl_cov import KLCov
from lightning_rlvr.callbacks.opefo import OPEFO
from lightning_rlvr.callbacks.paec import PAEC
from lightning_rlvr.callbacks.perplexity_shaping import PerplexityShaping
from lightning_rlvr.callbacks.polarity_filter import PolarityFilter
from lightning_rlvr.callbacks.position_shaping import PositionShaping
from lightning_rlvr.callbacks.rcea_diagnostics import RCEADiagnostics
from lightning_rlvr.callbacks.stage_detector import StageDetector
from lightning_rlvr.callbacks.stage_gate import ActivationGate, StageGated
from lightning_rlvr.callbacks.steer import STEER
from lightning_rlvr.callbacks.top_entropy_tokens import TopEntropyTokens
from lightning_rlvr.callbacks.warm_start import SupervisedWarmStart

__all__ = [
    "EPGRPO",
    "GTPO",
    "HAPO",
    "OPEFO",
    "PAEC",
    "STEER",
    "ActivationGate",
    "AdaptiveEntropy",
    "ClipCov",
    "EntropyBonus",
    "EntropyChangeProbe",
    "EntropyPerformanceAnalysis",
    "Intervention",
    "KLCov",
    "MicroBatchContext",
    "Needs",
    "PerplexityShaping",
    "PolarityFilter",
    "PositionShaping",
    "RCEADiagnostics",
    "StageDetector",
    "StageGated",
    "StepContext",
    "SupervisedWarmStart",
    "TopEntropyTokens",
]
