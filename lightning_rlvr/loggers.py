"""Logging beyond scalars: the completions table, and InMemoryLogger (every metric in a dict, for tests and notebooks).

:func:`completions_table` turns a scored rollout into rows a person reads (prompt, completion cut at its stop token,
reward, verdict, length, mean token entropy); :func:`log_table` sends such a table to each logger that takes tables
(MLflow, as a JSON table artifact through ``MlflowClient.log_table``; InMemoryLogger). Each step's table is its own
artifact, ``completions/step_<step>.json``: MLflow appends to an existing table by reading it back with pandas, which
turns an all-digit completion such as ``"12"`` into the number 12, and rewrites the whole file every time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import Logger
from torch import Tensor

if TYPE_CHECKING:
    from lightning_rlvr.data.batch import RolloutBatch

__all__ = ["InMemoryLogger", "completions_artifact", "completions_table", "endpoint_ratios_artifact", "log_table"]


def completions_artifact(step: int) -> str:
    """The run-relative artifact path of rollout step ``step``'s completions table."""
    return f"completions/step_{step:06d}.json"


def endpoint_ratios_artifact(step: int) -> str:
    """The run-relative artifact path of the per-question endpoint log ratios that
    :class:`~lightning_rlvr.callbacks.RCEADiagnostics` (``endpoint_samples > 0``) logs at rollout step ``step``:
    a table with columns ``question`` (index in the probe set), ``log_ratio`` (``log H_fail(q) / H_succ(q)``),
    ``failed`` and ``successful`` (responses of each outcome), one row per paired question."""
    return f"rcea/endpoint_step_{step:06d}.json"


def completions_table(batch: RolloutBatch, entropy: Tensor, tokenizer: Any, step: int,
                      max_rows: int) -> dict[str, list]:
    """The first ``max_rows`` completions of ``batch`` (whole groups first: rows are in group order) as table columns.

    Columns: ``step``; ``group`` (the prompt's index in the batch); ``prompt`` (the tokens the policy saw, chat
    template and special tokens included, without padding); ``completion`` (the text up to, not including, its stop
    token: what the verifier scored); ``reward`` (trained on, after any shaping); ``verdict`` (``correct``, ``wrong``,
    ``truncated``, ``invalid`` or ``error``: :attr:`~lightning_rlvr.data.batch.RolloutBatch.verdicts`);
    ``response_length`` (completion tokens trained on, the stop token included); ``entropy_mean`` (mean token entropy
    of the policy that generated it); and one ``reward/<name>`` column per named reward component.

    Args:
        batch: the scored rollout.
        entropy: ``(N, T)`` token entropy of the behaviour policy (zero past each response's end).
        tokenizer: decodes the prompts.
        step: the rollout step, repeated in every row.
        max_rows: at most this many rows.
    """
    rows = range(min(max_rows, len(batch)))
    prompt_ids = batch.input_ids[:, : batch.prompt_length]
    prompt_mask = batch.attention_mask[:, : batch.prompt_length] > 0
    lengths = batch.response_mask.sum(-1)
    entropy_means = (entropy * batch.response_mask).sum(-1) / lengths.clamp_min(1)
    table: dict[str, list] = {
        "step": [step] * len(rows),
        "group": [int(batch.group_ids[i]) for i in rows],
        "prompt": [tokenizer.decode(prompt_ids[i][prompt_mask[i]].tolist(), skip_special_tokens=False) for i in rows],
        "completion": [batch.completions[i] for i in rows],
        "reward": [float(batch.rewards[i]) for i in rows],
        "verdict": [batch.verdicts[i] if batch.verdicts else "" for i in rows],
        "response_length": [int(lengths[i]) for i in rows],
        "entropy_mean": [float(entropy_means[i]) for i in rows],
    }
    for name, values in batch.reward_components.items():
        table[f"reward/{name}"] = [float(values[i]) for i in rows]
    return table


def log_table(loggers: Sequence[Logger], table: dict[str, list], artifact_file: str) -> None:
    """Log ``table`` (columns of equal length) as ``artifact_file`` to every MLflow or in-memory logger."""
    for logger in loggers:
        if isinstance(logger, MLFlowLogger):
            logger.experiment.log_table(logger.run_id, data=table, artifact_file=artifact_file)
        elif isinstance(logger, InMemoryLogger):
            logger.log_table(table, artifact_file)


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
        #: ``{artifact_file: {column: values}}``: the tables sent by :func:`log_table`.
        self.tables: dict[str, dict[str, list]] = {}

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

    def log_table(self, table: dict[str, list], artifact_file: str) -> None:
        """Keep ``table`` as ``tables[artifact_file]``."""
        self.tables[artifact_file] = {column: list(values) for column, values in table.items()}
