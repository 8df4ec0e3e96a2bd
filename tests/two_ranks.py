"""Running a test's work on two CPU ranks (gloo): the shared scaffolding of every two-process test.

- :func:`two_rank_results`: ``body(rank, *args)`` inside an initialised process group on each of two ranks;
  their return values, in rank order.
- :func:`spawn_two` with :func:`distributed_worker`: the environment a launcher sets (Lightning joins the process
  group itself), on a free port, retried when the port was taken in between.

The ranks are forked from a fork server that imported torch, Lightning, transformers and the package once: a spawned
rank re-imports them (~5 s of the ~6 s a two-rank fit of the tiny model takes on 2 cores). They are not forked from
the test process itself, which is faster still but inherits its state: objects that earlier tests left behind (a
gloo process group whose destructor waits on threads that a fork does not copy) deadlocked a rank once in a full
run. A rank sets one intra-op thread before any work, and fails after :data:`DEADLINE_S` instead of hanging the
suite.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["distributed_worker", "free_port", "spawn_two", "start_two", "two_rank_results"]

START_METHOD = "forkserver"
# Imported once by the fork server (started at the first two-rank test), inherited by every rank it forks.
# transformers' model loading imports DeepSpeed where it is installed (1.4 s), and its model classes load lazily.
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "lightning.pytorch", "transformers",
                                        "transformers.core_model_loading", "transformers.models.llama.modeling_llama",
                                        "lightning_rlvr", "lightning_rlvr.module", "lightning_rlvr.data", "test_module"])
DEADLINE_S = 300  # a two-rank fit here takes seconds; a rank that waits on a collective never finishes


def start_two(worker_fn, args: tuple, deadline_s: float = DEADLINE_S) -> None:
    """``worker_fn(rank, *args)`` on ranks 0 and 1; raise a rank's exception, or fail after the deadline."""
    context = mp.start_processes(worker_fn, args=args, nprocs=2, join=False, start_method=START_METHOD)
    waited = 0.0
    while not context.join(timeout=1):
        waited += 1
        if waited >= deadline_s:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"two ranks of {worker_fn.__name__} did not finish in {deadline_s:.0f} s")


def _gloo_rank(rank: int, body, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/init", rank=rank, world_size=2)
    try:
        torch.save(body(rank, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def two_rank_results(body, out_dir: Path, *args) -> list:
    """``body(rank, *args)`` (a module-level function) on ranks 0 and 1 of a gloo group: what each returned."""
    start_two(_gloo_rank, (body, str(out_dir), args))
    return [torch.load(Path(out_dir) / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def distributed_worker(body):
    """Run ``body(rank, port, ...)`` as rank ``rank`` of 2 on this machine, and leave the process group cleanly.

    The environment is what a launcher sets (Lightning then joins the process group). Leaving it explicitly
    matters: a process that exits with the group alive can abort in its C++ teardown ("terminate called without an
    active exception"), which failed a CI run after the test's own work was done.
    """

    @functools.wraps(body)
    def run(rank: int, port: int, *args) -> None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                          LOCAL_RANK=str(rank), NODE_RANK="0")
        torch.set_num_threads(1)
        try:
            body(rank, port, *args)
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        # Only interpreter and C++ teardown is left, and it can still abort (SIGABRT, seen once in 3 CI runs of the
        # FSDP2 resume test after its files were written): leave without it, successfully.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_two(worker_fn, *args, attempts: int = 3) -> None:
    """:func:`start_two` on a free port, again on another one if the port was taken in between.

    ``free_port`` releases the port it found before rank 0's store binds it; another process may take it meanwhile
    (a time-of-check/time-of-use race), which shows up as "address already in use".
    """
    for attempt in range(attempts):
        try:
            start_two(worker_fn, (free_port(), *args))
            return
        except mp.ProcessRaisedException as err:
            if "address already in use" not in str(err).lower() or attempt == attempts - 1:
                raise
