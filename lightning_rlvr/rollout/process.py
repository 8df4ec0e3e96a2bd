"""A rollout engine in its own process: :class:`HFEngine` on a private copy of the policy, fed weights by version
over ``torch.distributed``.

The trainer (rank 0) and the engine process (rank 1) form a two-rank process group of their own (a ``TCPStore`` and a
``ProcessGroupGloo`` built directly, so it coexists with the default group a DDP run creates; ``ProcessGroupNCCL``
when the policy and the engine are on two different GPUs, so the bytes go device to device),
and a control connection (``multiprocessing.connection``, authenticated) carries the commands: *sync* a version,
*generate*, *close*. The weights travel as raw bytes in buckets: every parameter and buffer of the policy (tied
weights once, non-persistent buffers included) has a fixed slot, 64-byte aligned, in one of a few byte buffers of
at most ``bucket_mb`` MiB (a tensor larger than that gets a buffer of its own), and a sync broadcasts each buffer
from the trainer; any dtype (bf16 included) travels as its bytes.

The process starts at the first :meth:`ProcessEngine.sync`: it is sent the policy's *structure* (the module
pickled with every parameter and buffer replaced by an empty tensor of its shape and dtype, so no weight travels
twice), builds it on its own device, and receives the weights. It is a plain ``python`` subprocess, not a
``multiprocessing`` child, so it never re-imports the user's script.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import secrets
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_rlvr.rollout.base import GenerationOutput, RolloutEngine, SamplingConfig
from lightning_rlvr.rollout.hf import HFEngine
from lightning_rlvr.sharding import is_sharded

__all__ = ["ProcessEngine", "WeightSlot", "weight_layout", "weights_backend"]

_ALIGN = 64  # bytes: every slot starts at a multiple of the largest element size, so a slice views as its dtype
_HOST = "127.0.0.1"
_AUTHKEY_VARIABLE = "LIGHTNING_RLVR_ENGINE_AUTHKEY"


@dataclass(frozen=True)
class WeightSlot:
    """Where one parameter or buffer travels: bucket ``bucket``, bytes ``[offset, offset + nbytes)``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    offset: int
    nbytes: int


def _weights(module: nn.Module) -> list[tuple[str, Tensor]]:
    """Every parameter, then every buffer (non-persistent ones too), each tensor once (tied weights under their first
    name): what a generating copy needs to compute what ``module`` computes."""
    return list(module.named_parameters()) + list(module.named_buffers())


def weight_layout(module: nn.Module, bucket_bytes: int) -> tuple[list[WeightSlot], list[int]]:
    """The slots of ``module``'s weights in buckets of at most ``bucket_bytes`` and each bucket's size in bytes.

    Tensors are packed in order; a bucket closes when the next tensor would overflow it, and a tensor larger than
    ``bucket_bytes`` fills a bucket alone.
    """
    slots: list[WeightSlot] = []
    sizes: list[int] = []
    for name, tensor in _weights(module):
        nbytes = tensor.numel() * tensor.element_size()
        start = -(-sizes[-1] // _ALIGN) * _ALIGN if sizes else 0
        if not sizes or (start + nbytes > bucket_bytes and sizes[-1] > 0):
            sizes.append(0)
            start = 0
        slots.append(WeightSlot(name, tuple(tensor.shape), tensor.dtype, len(sizes) - 1, start, nbytes))
        sizes[-1] = start + nbytes
    return slots, sizes


def _as_bytes(tensor: Tensor) -> Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def _empty_weight(shape: tuple[int, ...], dtype: torch.dtype, parameter: bool) -> Tensor:
    tensor = torch.empty(shape, dtype=dtype)
    return nn.Parameter(tensor, requires_grad=False) if parameter else tensor


class _StructurePickler(pickle.Pickler):
    """Pickles a module with its parameters and buffers as empty tensors (their values follow in the first sync);
    any other tensor an attribute holds keeps its value."""

    def __init__(self, file, weights: set[int]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.weights = weights

    def reducer_override(self, obj):
        if isinstance(obj, Tensor) and id(obj) in self.weights:
            return _empty_weight, (tuple(obj.shape), obj.dtype, isinstance(obj, nn.Parameter))
        return NotImplemented


def _structure(policy: nn.Module) -> bytes:
    buffer = io.BytesIO()
    try:
        _StructurePickler(buffer, {id(t) for _, t in _weights(policy)}).dump(policy)
    except Exception as err:
        raise ValueError(f"ProcessEngine sends the policy's structure to its process by pickling it, and "
                         f"{type(policy).__name__} does not pickle: {err!r}") from err
    return buffer.getvalue()


def _weights_group(store, rank: int, timeout: timedelta, backend: str = "gloo"):
    """The two-rank group of the trainer (0) and the engine (1), apart from any default process group."""
    from torch.distributed import PrefixStore

    prefixed = PrefixStore("lightning_rlvr_weights", store)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(prefixed, rank, 2, options)
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(prefixed, rank, 2, timeout)


def weights_backend(requested: str, policy_device: torch.device, engine_device: torch.device) -> str:
    """The weights group's backend: NCCL between two different CUDA devices (``"auto"`` picks it there), else gloo.

    Raises:
        ValueError: ``"nccl"`` where it cannot run (a CPU side, one GPU for both ranks, a torch without NCCL).
    """
    two_gpus = policy_device.type == engine_device.type == "cuda" and policy_device != engine_device
    nccl = two_gpus and torch.distributed.is_available() and torch.distributed.is_nccl_available()
    if requested == "nccl" and not nccl:
        raise ValueError(f"ProcessEngine(backend='nccl') needs the policy and the engine on two different CUDA "
                         f"devices and a torch with NCCL; the policy is on {policy_device}, the engine on "
                         f"{engine_device} (NCCL cannot put both ranks on one device): use backend='gloo' or 'auto'")
    return "nccl" if requested == "nccl" or (requested == "auto" and nccl) else "gloo"


def _broadcast(group, buffer: Tensor) -> None:
    from torch.distributed import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    group.broadcast([buffer], options).wait()


def _send(connection: Connection, message: tuple) -> None:
    # Plain pickle, not the connection's own: torch's multiprocessing reductions would pass tensors as shared-memory
    # handles, which a socket between two unrelated processes does not carry.
    connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _no_delay(connection: Connection) -> Connection:
    """Switch off Nagle's algorithm on the connection's socket: a message over 16 KiB goes out as a header and a body,
    and the body would wait for the peer's delayed ACK of the header (~40 ms, five times a tiny model's rollout)."""
    with socket.socket(fileno=os.dup(connection.fileno())) as duplicate:  # the same socket, closed independently
        duplicate.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection


def _on_cpu(out: GenerationOutput) -> GenerationOutput:
    moved = {name: getattr(out, name) for name in ("prompt_ids", "prompt_mask", "completion_ids", "lengths", "stopped",
                                                   "logprobs")}
    moved = {name: None if t is None else t.cpu() for name, t in moved.items()}
    behaviour = out.behaviour
    if behaviour is not None:
        behaviour = type(behaviour)(*(None if t is None else t.cpu() for t in (behaviour.logprobs, behaviour.entropy,
                                                                               behaviour.sbar)))
    return GenerationOutput(**moved, behaviour=behaviour)


class ProcessEngine(RolloutEngine):
    """:class:`HFEngine` in a process of its own, on its own device, fed the policy's weights by version.

    Generation then overlaps training without sharing the trainer's interpreter (its GIL) or its threads: with
    ``RolloutDataModule(max_policy_lag=1)`` the next rollout decodes in this process while the trainer updates.
    It is also the test double of engines that run apart from the trainer (a vLLM server on other GPUs): everything
    crosses a process boundary, and the weights a rollout was generated with are exactly those of the version synced
    before it (:meth:`sync` returns once the process holds them).

    Every :meth:`sync` broadcasts all weights (module docstring; a policy of ``P`` bytes moves ``P`` bytes through
    the loopback per version); generation is :class:`HFEngine`'s own decoding loop, with its behaviour statistics
    (the generating policy's float32 log-probs) when asked. The samples are drawn from a ``torch.Generator`` in the
    process, seeded for each call from :attr:`generator` when it is set (the background rollouts'), else from
    torch's global generator of the trainer — so a run is as reproducible as the trainer's random stream.

    Args:
        device: where the engine's copy lives and generates (``"cpu"``, ``"cuda:1"``; ``None``: the policy's device).
        threads: torch threads of the engine process (``None``: torch's default); on CPU, the trainer's and the
            engine's threads share the cores.
        bucket_mb: the byte buffers' size limit in MiB (fewer, larger broadcasts against less staging memory).
        backend: the weights group's backend: ``"auto"`` (NCCL when the policy and the engine are on two different
            GPUs, the buffers staged on each side's device; else gloo, staged on the host), ``"gloo"`` or
            ``"nccl"``.
        timeout_s: how long the process may take to start, to complete a weight broadcast, or to answer any request
            (a generation included); past it the process is killed and the call raises ``TimeoutError``.
        use_cache: :class:`HFEngine`'s argument.
        behaviour_stats: :class:`HFEngine`'s argument.
    """

    holds_own_weights = True  # the process's copy changes only at a sync

    def __init__(self, device: str | None = None, threads: int | None = None, bucket_mb: float = 64.0,
                 timeout_s: float = 600.0, use_cache: bool = True, behaviour_stats: bool = True,
                 backend: Literal["auto", "gloo", "nccl"] = "auto") -> None:
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"ProcessEngine: backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
        if threads is not None and threads < 1:
            raise ValueError(f"ProcessEngine: threads must be >= 1 (or None), got {threads}")
        if bucket_mb <= 0 or timeout_s <= 0:
            raise ValueError(f"ProcessEngine: bucket_mb and timeout_s must be > 0, got {bucket_mb}, {timeout_s}")
        self.device, self.threads = device, threads
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout = timedelta(seconds=timeout_s)
        self.use_cache, self.behaviour_stats = use_cache, behaviour_stats
        self.backend = backend
        self._backend = "gloo"  # the one in use, resolved at the start
        self.version: int = -1
        #: seeds each call's sampler in the process when set (else torch's global generator does).
        self.generator: torch.Generator | None = None
        self._process: subprocess.Popen | None = None
        self._connection: Connection | None = None
        self._store = self._group = None
        self._slots: list[WeightSlot] = []
        self._buffers: list[Tensor] = []

    # -- lifecycle ------------------------------------------------------------------------------------------
    def _start(self, policy: nn.Module) -> None:
        from torch.distributed import TCPStore

        structure = _structure(policy)  # before a process runs: a policy that does not pickle is refused here
        policy_device = next(policy.parameters()).device
        device = self.device or str(policy_device)
        self._backend = weights_backend(self.backend, policy_device, torch.device(device))
        self._slots, sizes = weight_layout(policy, self.bucket_bytes)
        self._store = TCPStore(_HOST, 0, world_size=2, is_master=True, timeout=self.timeout, wait_for_workers=False)
        authkey = secrets.token_bytes(16)
        command = [sys.executable, "-c", "from lightning_rlvr.rollout.process import _serve; _serve()",
                   str(self._store.port), device, str(self.threads or 0), str(self.timeout.total_seconds())]
        self._process = subprocess.Popen(command, env={**os.environ, _AUTHKEY_VARIABLE: authkey.hex()})
        try:
            deadline = time.monotonic() + self.timeout.total_seconds()
            while not self._store.check(["control_port"]):
                self._check_alive("starting")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ProcessEngine: the engine process did not start within {self.timeout}")
                time.sleep(0.05)
            self._connection = _no_delay(Client((_HOST, int(self._store.get("control_port"))), authkey=authkey))
            self._send("start", structure, self._slots, sizes, self.use_cache, self.behaviour_stats, self._backend)
            self._receive("ready")  # the process built the policy; both sides now join the weights' group
            self._group = _weights_group(self._store, 0, self.timeout, self._backend)
        except BaseException:
            self.close()
            raise
        staging = policy_device if self._backend == "nccl" else "cpu"
        self._buffers = [torch.empty(size, dtype=torch.uint8, device=staging) for size in sizes]

    def close(self) -> None:
        """Stop the process (the next :meth:`sync` starts a new one)."""
        if self._connection is not None:
            try:
                _send(self._connection, ("close",))
            except OSError:
                pass
            self._connection.close()
            self._connection = None
        if self._process is not None:
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        self._group = self._store = None
        self._buffers = []
        self.version = -1

    def abort(self) -> None:
        """Kill the process without waiting for what it is doing (the fit failed)."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_process", None) is not None and self._process.poll() is None:
            self._process.kill()

    # -- the engine interface ---------------------------------------------------------------------------------
    @torch.no_grad()
    def sync(self, policy: nn.Module, version: int) -> None:
        if is_sharded(policy):
            raise ValueError("ProcessEngine cannot copy a policy sharded across ranks (FSDP2, ZeRO-3)")
        if self._process is None:
            self._start(policy)
        weights = _weights(policy)
        layout = [(slot.name, slot.shape, slot.dtype) for slot in self._slots]
        if [(name, tuple(t.shape), t.dtype) for name, t in weights] != layout:
            raise ValueError("ProcessEngine: the policy's parameters and buffers changed since the engine process "
                             "started (names, shapes or dtypes); close() the engine to start a new one")
        # The bytes are staged here first: once this returns the trainer may change the policy.
        for slot, (_, tensor) in zip(self._slots, weights):
            self._buffers[slot.bucket][slot.offset : slot.offset + slot.nbytes].copy_(_as_bytes(tensor))
        self._send("sync", version)
        for buffer in self._buffers:
            _broadcast(self._group, buffer)
        self._receive("synced")
        self.version = version

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> GenerationOutput:
        if self._process is None:
            raise RuntimeError("ProcessEngine.generate called before sync(policy)")
        generator = self.generator
        seed = int(torch.randint(2**62, (1,), generator=generator,
                                 device=generator.device if generator is not None else "cpu"))
        self._send("generate", prompts, n, sampling, seed)
        return self._receive("output")

    # -- the control connection -------------------------------------------------------------------------------
    def _send(self, *message) -> None:
        try:
            _send(self._connection, message)
        except OSError as err:
            self._check_alive(f"sending {message[0]!r}", settle=True)
            raise RuntimeError(f"ProcessEngine: lost the engine process while sending {message[0]!r}") from err

    def _receive(self, expected: str):
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self._connection.poll(1.0):
            self._check_alive(f"waiting for {expected!r}")
            if time.monotonic() > deadline:  # alive but stuck: nothing else would end the wait
                self.abort()
                raise TimeoutError(f"ProcessEngine: the engine process did not answer {expected!r} within "
                                   f"{self.timeout}; it was killed (timeout_s)")
        try:
            kind, payload = pickle.loads(self._connection.recv_bytes())
        except (EOFError, OSError) as err:
            self._check_alive(f"waiting for {expected!r}", settle=True)
            raise RuntimeError(f"ProcessEngine: the connection to the engine process broke ({err!r})") from err
        if kind == "error":
            raise RuntimeError(f"ProcessEngine: the engine process failed ({expected!r}):\n{payload}")
        return payload

    def _check_alive(self, doing: str, settle: bool = False) -> None:
        """Raise if the process has exited; ``settle``: the connection broke, give a dying process time to exit."""
        if self._process is None:
            return
        if settle:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=10)
        code = self._process.poll()
        if code is not None:
            self._process = None
            raise RuntimeError(f"ProcessEngine: the engine process exited with code {code} while {doing} "
                               f"(its traceback, if any, is on stderr above)")


# -- the engine process ------------------------------------------------------------------------------------------
def _serve() -> None:
    """The engine process's entry point: ``store_port device threads timeout_s`` on the command line."""
    from torch.distributed import TCPStore

    store_port, device, threads, timeout_s = sys.argv[1:5]
    if int(threads):
        torch.set_num_threads(int(threads))
    timeout = timedelta(seconds=float(timeout_s))
    store = TCPStore(_HOST, int(store_port), world_size=2, is_master=False, timeout=timeout)
    with Listener((_HOST, 0), authkey=bytes.fromhex(os.environ.pop(_AUTHKEY_VARIABLE))) as listener:
        store.set("control_port", str(listener.address[1]))
        connection = _no_delay(listener.accept())
    with connection:
        _Server(connection, store, device, timeout).run()


class _Server:
    """Builds the policy from its structure, then answers the trainer's commands until *close* (or a lost trainer)."""

    def __init__(self, connection: Connection, store, device: str, timeout: timedelta) -> None:
        self.connection, self.store, self.device, self.timeout = connection, store, torch.device(device), timeout

    def run(self) -> None:
        try:
            _, structure, slots, sizes, use_cache, behaviour_stats, backend = pickle.loads(self.connection.recv_bytes())
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            with self.device:  # the empty weights are allocated where they will live, not staged on the host
                policy = pickle.loads(structure)
            policy = policy.to(self.device)
            weights = _weights(policy)
            built = [(name, tuple(t.shape), t.dtype) for name, t in weights]
            if built != [(s.name, s.shape, s.dtype) for s in slots]:
                raise RuntimeError(f"the policy rebuilt from its structure has other weights than the trainer's "
                                   f"(tied weights untied?): {built[:4]}... against {slots[:4]}...")
            self.targets = [(slot, tensor) for slot, (_, tensor) in zip(slots, weights)]
            staging = self.device if backend == "nccl" else "cpu"
            self.buffers = [torch.empty(size, dtype=torch.uint8, device=staging) for size in sizes]
            self.engine = HFEngine(use_cache=use_cache, behaviour_stats=behaviour_stats)
            self.engine.sync(policy, -1)
            _send(self.connection, ("ready", None))
            self.group = _weights_group(self.store, 1, self.timeout, backend)
        except Exception:
            _send(self.connection, ("error", traceback.format_exc()))
            return
        while True:
            try:
                command, *arguments = pickle.loads(self.connection.recv_bytes())
            except (EOFError, OSError):
                return  # the trainer is gone
            if command == "close":
                return
            try:
                _send(self.connection, {"sync": self.sync, "generate": self.generate}[command](*arguments))
            except Exception:
                _send(self.connection, ("error", traceback.format_exc()))
                if command == "sync":
                    return  # the weights are half written: the trainer sees the error and the process exit

    @torch.no_grad()
    def sync(self, version: int) -> tuple:
        for buffer in self.buffers:
            _broadcast(self.group, buffer)
        for slot, tensor in self.targets:
            received = self.buffers[slot.bucket][slot.offset : slot.offset + slot.nbytes]
            tensor.copy_(received.view(slot.dtype).view(slot.shape))
        self.engine.version = version
        return "synced", version

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int) -> tuple:
        self.engine.generator = torch.Generator(device=self.device).manual_seed(seed)
        return "output", _on_cpu(self.engine.generate(prompts, n, sampling))
