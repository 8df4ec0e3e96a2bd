"""InMemoryLogger: a Lightning logger that keeps every metric in a dict (for tests, benchmarks, notebooks)."""

from __future__ import annotations

from lightning.pytorch.loggers.logger import Logger

__all__ = ["InMemoryLogger"]


class InMemoryLogger(Logger):
    """Records every logged metric as ``history[key][step] = value``.

    ``history`` is a plain dict: reading a metric that was never logged raises ``KeyError`` (a check on a metric that
    is not there must fail, not see an empty history).

    Example::

        >>> logger = InMemoryLogger()
        >>> logger.log_metrics({"entropy/token_mean": 0.5}, step=3)
        >>> logger.history["entropy/token_mean"]
        {3: 0.5}
    """

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, dict[int, float]] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @property
    def experiment(self) -> None:
        return None

    def log_metrics(self, metrics, step=None) -> None:
        for key, value in metrics.items():
            self.history.setdefault(key, {})[step] = float(value)

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass
