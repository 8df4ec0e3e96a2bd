"""How the trainer hands its weights to a vLLM server: the packed buffer layout vLLM's receiver unpacks, the
version-dependent placement of its fields, and the transports the tensors travel over (NCCL through vLLM's own
classes; the tests use gloo). :class:`~lightning_rlvr.rollout.server.VLLMServerEngine` drives them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

__all__ = ["NCCLWeightTransport", "WeightTransport", "packed_chunks", "packing_info", "server_release"]


def packed_chunks(nbytes: list[int], buffer_bytes: int) -> list[list[int]]:
    """The indices of the tensors each packed broadcast carries, as vLLM's receiver groups them.

    Tensors are taken in order and appended to the current chunk; the chunk is sent as soon as its running size
    *exceeds* ``buffer_bytes`` (the tensor that crosses the limit travels in it), and what is left forms a last chunk.

    Example::

        >>> packed_chunks([4, 4, 4, 10, 1], buffer_bytes=7)
        [[0, 1], [2, 3], [4]]
    """
    chunks: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, count in enumerate(nbytes):
        current.append(index)
        size += count
        if size > buffer_bytes:
            chunks.append(current)
            current, size = [], 0
    if current:
        chunks.append(current)
    return chunks


class WeightTransport(ABC):
    """The data plane of a weight sync: a collective group in which the trainer is rank 0 and broadcasts ``uint8``
    buffers to the server's workers (ranks ``1..world_size-1``).

    Attributes:
        library_version: the version of the vLLM whose classes the transport uses (``None``: none), checked against
            the server's.
    """

    library_version: str | None = None

    @abstractmethod
    def connect(self, master_address: str, master_port: int, world_size: int) -> None:
        """Join the group as rank 0 (blocks until every worker has joined; the store is served from here)."""

    @abstractmethod
    def broadcast(self, buffer: Tensor) -> None:
        """Send ``buffer`` (``uint8``, 1-D) from rank 0 to every worker; returns once it is sent."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the buffers are staged."""

    def close(self) -> None:
        """Leave the group."""


class NCCLWeightTransport(WeightTransport):
    """vLLM's NCCL transport on the trainer's side: ``StatelessProcessGroup`` + ``PyNcclCommunicator``, the classes
    vLLM's own workers receive with (rank 0 serves the group's store at ``master_address:master_port``), on the
    current CUDA device. Broadcasts are enqueued on the current stream; the server's ``/update_weights`` reply
    says they arrived.
    """

    def __init__(self) -> None:
        self.communicator: Any = None
        self._device: torch.device | None = None
        try:
            import vllm

            self.library_version = vllm.__version__
        except ImportError:
            self.library_version = None

    @property
    def device(self) -> torch.device:
        """The device the communicator was bound to at :meth:`connect`; before, the calling thread's current one."""
        return self._device if self._device is not None else torch.device("cuda", torch.cuda.current_device())

    def connect(self, master_address: str, master_port: int, world_size: int) -> None:
        try:
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup
        except ImportError as err:
            raise ImportError("VLLMServerEngine's NCCL weight transport needs vLLM on the trainer (the server's "
                              "version) and a CUDA device: pip install 'lightning_rlvr[vllm]'") from err
        group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=0, world_size=world_size)
        # Fixed now: the current device is per thread, and a later push may come from the background thread.
        self._device = torch.device("cuda", torch.cuda.current_device())
        self.communicator = PyNcclCommunicator(group, device=self._device)
        if getattr(self.communicator, "disabled", False):  # its broadcasts would do nothing while the server waits
            raise RuntimeError("VLLMServerEngine: vLLM's PyNcclCommunicator disabled itself (world size 1, "
                               "VLLM_DISABLE_PYNCCL set, or libnccl not found): no weights would reach the server")

    def broadcast(self, buffer: Tensor) -> None:
        self.communicator.broadcast(buffer, src=0, stream=torch.cuda.current_stream(self.device))

    def close(self) -> None:
        self.communicator = None


def server_release(text: str) -> tuple[int, ...]:
    """``"0.28.1.dev3+g1234"`` → ``(0, 28, 1)``."""
    parts = []
    for part in text.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def packing_info(server_version: str, buffer_bytes: int) -> tuple[dict, dict]:
    """``(init_info extras, update_info extras)`` announcing a packed update to a vLLM server of ``server_version``:
    in ``update_info`` up to 0.27, in ``init_info`` from 0.28 (vLLM parses both with ``cls(**info)``, so a key in
    the wrong one fails the update)."""
    packing = {"packed": True, "packed_buffer_size_bytes": buffer_bytes, "packed_num_buffers": 2}
    return (packing, {}) if server_release(server_version) >= (0, 28) else ({}, packing)
