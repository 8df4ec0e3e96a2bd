"""Built-in verifiable tasks (the embedded default)."""

from lightning_rlvr.tasks.arithmetic import ArithmeticTask, Problem, TaskName

__all__ = ["ArithmeticTask", "Problem", "TaskName"]
