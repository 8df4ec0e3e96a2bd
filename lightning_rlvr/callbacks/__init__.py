"""Callbacks: the supervised warm start (entropy interventions come in their own files)."""

from lightning_rlvr.callbacks.warm_start import SupervisedWarmStart

__all__ = ["SupervisedWarmStart"]
