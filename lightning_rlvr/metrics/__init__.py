"""Metrics (functional forms and torchmetrics classes)."""

from lightning_rlvr.metrics.pass_at_k import pass_at_k

__all__ = ["pass_at_k"]
