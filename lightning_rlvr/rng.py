"""The process's global random states (torch, CUDA, Python, numpy): saved in checkpoints, and kept across code that
reseeds them (vLLM's worker calls ``set_random_seed`` on all four when an engine is built in-process)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch

__all__ = ["preserved_rng_state", "rng_state", "set_rng_state"]


def rng_state() -> dict:
    """Global RNG states (torch, CUDA, Python, numpy) as tensors / lists, loadable with ``weights_only=True``."""
    import numpy as np

    name, keys, position, has_gauss, gauss = np.random.get_state()
    version, python_state, python_gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
            "python": [version, list(python_state), python_gauss],
            "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(gauss)]}


def set_rng_state(state: dict) -> None:
    """Set the global RNG states written by :func:`rng_state`."""
    import numpy as np

    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    version, python_state, python_gauss = state["python"]
    random.setstate((version, tuple(python_state), python_gauss))
    name, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))


@contextlib.contextmanager
def preserved_rng_state() -> Iterator[None]:
    """Run the body, then set every global RNG back to where it was before (whatever the body reseeded)."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)
