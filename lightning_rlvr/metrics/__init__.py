"""Metrics (functional forms and torchmetrics classes)."""

from lightning_rlvr.metrics.pass_at_k import pass_at_k
from lightning_rlvr.metrics.rcea import (
    CovarianceTailConcentration,
    PairedEntropyRatio,
    StratifiedEntropy,
    bootstrap_ci,
    cluster_modes,
    majority_vote_correct,
    mode_retention,
    sign_test_pvalue,
)

__all__ = [
    "CovarianceTailConcentration",
    "PairedEntropyRatio",
    "StratifiedEntropy",
    "bootstrap_ci",
    "cluster_modes",
    "majority_vote_correct",
    "mode_retention",
    "pass_at_k",
    "sign_test_pvalue",
]
