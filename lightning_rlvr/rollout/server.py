"""vLLM's own server as the rollout engine: ``vllm serve`` on other GPUs or machines, spoken to over HTTP, its weights
replaced by version through vLLM's native weight-transfer API.

Generation is one ``POST /v1/completions`` per call, token ids in and out (``prompt`` a list of id lists, ``n``,
``return_token_ids``, ``logprobs: 0``), every sampling field sent explicitly: a field left out takes the checkpoint's
``generation_config.json`` default on the server, not the trainer's value. Choice ``i`` is sample ``i mod n`` of
prompt ``i // n``; its ``token_ids`` end with the EOS or stop id it stopped on (``finish_reason == "stop"``), and its
log-probs (``logprobs.token_logprobs``) are vLLM's own, of the distribution sampled from when the server runs with
``--logprobs-mode processed_logprobs``.

A weight sync (``sync(policy, version)`` when the version moved) is vLLM's update over HTTP (vLLM >= 0.21), the
tensors travelling over a collective group the trainer (rank 0) shares with the server's workers (ranks ``1..W``)::

    POST /pause?mode=keep → POST /start_weight_update → POST /update_weights (its reply waits for the tensors, which the
    trainer broadcasts meanwhile) → POST /finish_weight_update → POST /resume

Pausing also clears the server's prefix cache (its KV blocks were computed with the old weights). The group is set up
at the first sync: ``GET /get_world_size`` gives ``W``, then ``POST /init_weight_transfer_engine`` and the trainer's
side of the rendezvous run together. The tensors go *packed*: in the announced order, each tensor's bytes appended
to a ``uint8`` buffer that is broadcast once its running size exceeds ``bucket_mb``
(:func:`~lightning_rlvr.rollout.weight_transfer.packed_chunks`), the layout vLLM's receiver unpacks; the packing
parameters go in ``update_info`` up to vLLM 0.27 and in ``init_info`` from 0.28 (read from the server's
``GET /version``). The transport is NCCL through vLLM's own ``StatelessProcessGroup`` and ``PyNcclCommunicator``
(:class:`~lightning_rlvr.rollout.weight_transfer.NCCLWeightTransport`; the trainer needs vLLM installed, the server's
version, and a CUDA device), or any :class:`~lightning_rlvr.rollout.weight_transfer.WeightTransport` (the tests use
gloo against a server stand-in).

Start the server as::

    VLLM_SERVER_DEV_MODE=1 vllm serve /models/Qwen2.5-0.5B-Instruct --port 8000 \\
        --weight-transfer-config '{"backend": "nccl"}' --logprobs-mode processed_logprobs

(``VLLM_SERVER_DEV_MODE`` mounts the weight-transfer routes.)
"""

from __future__ import annotations

import contextlib
import socket
import threading
import urllib.parse
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lightning_rlvr.distributed import world_size
from lightning_rlvr.lora import is_lora, merged_weights
from lightning_rlvr.rollout.base import GenerationOutput, RolloutEngine, SamplingConfig
from lightning_rlvr.rollout.weight_transfer import (
    NCCLWeightTransport,
    WeightTransport,
    packed_chunks,
    packing_info,
    server_release,
)
from lightning_rlvr.sharding import full_weights, is_sharded

__all__ = ["VLLMServerEngine"]

_SERVER_HELP = ("start it with VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config "
                "'{\"backend\": \"nccl\"}' --logprobs-mode processed_logprobs")


#: vLLM's ``VLLM_MAX_COMPLETION_PROMPTS`` default (from 0.28): longer prompt lists go in several requests.
MAX_PROMPTS_PER_REQUEST = 1024


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _address_towards(url: str) -> str:
    """This machine's address on the route to ``url``'s host (where the server's workers reach the trainer)."""
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # a UDP "connect" sends nothing: it only picks the outgoing interface
        return probe.getsockname()[0]


def _rank() -> tuple[int, int]:
    """``(this trainer rank, number of ranks)``."""
    world = world_size()
    return (torch.distributed.get_rank() if world > 1 else 0), world


class VLLMServerEngine(RolloutEngine):
    """A running ``vllm serve`` as the rollout engine (module docstring): generation over its OpenAI-compatible HTTP
    API, weight updates through its native weight-transfer API.

    The server must serve the policy's architecture and tokenizer; its weights are replaced at the first sync.
    Several trainer ranks share one server (each sends its own prompts; rank 0 pushes the weights and the others
    wait for it at a barrier), or have one each (``base_url`` a list, one URL per rank: each rank pushes to its own,
    with no collective). A policy sharded across ranks (FSDP2, ZeRO-3) is gathered for the push; a LoRA policy is
    sent merged (``W + scale·B·A``) under its base model's names. A shared server or a sharded policy makes the sync a
    collective, which must run in the training thread: ``max_policy_lag`` at most 1. The server samples with its own
    random state: a run is not reproducible from the trainer's seed (``GenerationOutput.logprobs`` are the
    server's; behaviour statistics are computed by the trainer).

    Args:
        base_url: the server's address (``http://host:port``), shared by the trainer ranks, or one per rank.
        model: the served model's name (``None``: the server's only model).
        bucket_mb: the size a packed broadcast buffer exceeds before it is sent (vLLM's default is 1024).
        master_address: the trainer's address as the server's workers reach it (``None``: this machine's address on
            the route to the server).
        request_timeout_s: how long a generation request or a weight update may take.
        transport_factory: builds the :class:`~lightning_rlvr.rollout.weight_transfer.WeightTransport` (default
            :class:`~lightning_rlvr.rollout.weight_transfer.NCCLWeightTransport`).
    """

    holds_own_weights = True  # the server's copy changes only at a sync

    def __init__(self, base_url: str | list[str] = "http://127.0.0.1:8000", model: str | None = None,
                 bucket_mb: float = 1024.0, master_address: str | None = None, request_timeout_s: float = 600.0,
                 transport_factory: Callable[[], WeightTransport] | None = None) -> None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls or any(urllib.parse.urlsplit(u).scheme not in ("http", "https") for u in urls):
            raise ValueError(f"VLLMServerEngine: base_url must be http(s)://host:port (or a list of them), got "
                             f"{base_url!r}")
        if bucket_mb <= 0 or request_timeout_s <= 0:
            raise ValueError(f"VLLMServerEngine: bucket_mb and request_timeout_s must be > 0, got {bucket_mb}, "
                             f"{request_timeout_s}")
        self.urls = [u.rstrip("/") for u in urls]
        self.model = model
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.master_address = master_address
        self.timeout = request_timeout_s
        self.transport_factory = transport_factory or NCCLWeightTransport
        self.version = -1  # the policy version the server holds (-1: its checkpoint's own weights)
        #: set by the DataModule for background rollouts; unused: the server samples with its own random state
        self.generator: torch.Generator | None = None
        self.url: str | None = None
        self.served_model: str | None = None
        self.server_version: str | None = None
        self.max_model_len: int | None = None
        self.policy: nn.Module | None = None
        self._session: Any = None
        self._transport: WeightTransport | None = None
        self._training_thread: threading.Thread | None = None  # recorded at setup_fit; else the main thread

    # -- HTTP -------------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        """The JSON reply of ``method path``; an HTTP error raises with the server's own message."""
        import requests

        if self._session is None:
            self._session = requests.Session()
        try:
            reply = self._session.request(method, self.url + path, json=body, timeout=timeout or self.timeout)
        except requests.ConnectionError as err:
            raise RuntimeError(f"VLLMServerEngine: no vLLM server answers at {self.url} ({path}); "
                               f"{_SERVER_HELP}") from err
        if reply.status_code == 404 and path.split("?")[0] != "/v1/completions":
            raise RuntimeError(f"VLLMServerEngine: {self.url} has no {method} {path.split('?')[0]} (404): the "
                               f"weight-transfer routes need a vLLM >= 0.21 server in dev mode; {_SERVER_HELP}")
        if reply.status_code != 200:
            try:
                error = reply.json().get("error", reply.json())
                message = error.get("message", error) if isinstance(error, dict) else error
            except ValueError:
                message = reply.text
            raise RuntimeError(f"VLLMServerEngine: {method} {self.url}{path} failed with HTTP {reply.status_code}: "
                               f"{message}")
        return reply.json() if reply.content else None

    # -- lifecycle --------------------------------------------------------------------------------------------
    def _start(self) -> None:
        rank, world = _rank()
        if len(self.urls) > 1 and len(self.urls) != world:
            raise ValueError(f"VLLMServerEngine: {len(self.urls)} base URLs for {world} trainer ranks (one URL, "
                             f"shared, or one per rank)")
        self.url = self.urls[rank % len(self.urls)]
        self.server_version = str(self._request("GET", "/version")["version"])
        self._check_logprobs_mode()
        models = self._request("GET", "/v1/models")["data"]
        names = [m["id"] for m in models]
        if self.model is None and len(models) != 1:
            raise ValueError(f"VLLMServerEngine: {self.url} serves {names}; name one with model=...")
        if self.model is not None and self.model not in names:
            raise ValueError(f"VLLMServerEngine: {self.url} serves {names}, not {self.model!r}")
        card = models[0] if self.model is None else models[names.index(self.model)]
        self.served_model = card["id"]
        self.max_model_len = card.get("max_model_len")
        # the longest prompt that leaves room for one generated token (generate checks the real limit)
        self.max_prompt_tokens = None if self.max_model_len is None else self.max_model_len - 1

    def _check_logprobs_mode(self) -> None:
        """Refuse a server whose log-probs ignore the sampling temperature (vLLM's default ``raw_logprobs``): the
        importance weights and ``rollout/engine_kl`` compare them with the trainer's at the temperature. The dev-mode
        route ``GET /server_info?config_format=json`` gives the server's configuration."""
        config = self._request("GET", "/server_info?config_format=json").get("vllm_config")
        mode = config.get("model_config", {}).get("logprobs_mode") if isinstance(config, dict) else None
        if mode != "processed_logprobs":
            raise ValueError(f"VLLMServerEngine: the server at {self.url} returns {mode or 'unknown'} log-probs; start "
                             f"it with --logprobs-mode processed_logprobs (the log-probs of the distribution it "
                             f"samples from, after the temperature), which the trainer's are compared with")

    def _connect(self) -> None:
        """Set up the weight-transfer group: the server's ``init_weight_transfer_engine`` and the trainer's side of
        the rendezvous, at the same time (each waits for the other)."""
        if server_release(self.server_version) < (0, 21):
            raise RuntimeError(f"VLLMServerEngine: the server at {self.url} runs vLLM {self.server_version}; weight "
                               f"updates need vLLM >= 0.21 (start_weight_update / finish_weight_update)")
        workers = int(self._request("GET", "/get_world_size")["world_size"])
        transport = self.transport_factory()
        if transport.library_version is not None and transport.library_version != self.server_version:
            warnings.warn(f"VLLMServerEngine: the trainer's vLLM is {transport.library_version}, the server's "
                          f"{self.server_version}: their weight-transfer handshakes may not match", stacklevel=2)
        address = self.master_address or _address_towards(self.url)
        port = _free_port(address)
        init_extra, _ = packing_info(self.server_version, self.bucket_bytes)
        init_info = {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": workers + 1,
                     **init_extra}
        reply = self._in_background("POST", "/init_weight_transfer_engine", {"init_info": init_info})
        transport.connect(address, port, workers + 1)  # a failure leaves the request to time out on its own
        reply.join()
        self._transport = transport

    def _in_background(self, method: str, path: str, body: dict) -> _Reply:
        reply = _Reply(self, method, path, body)
        reply.start()
        return reply

    def close(self) -> None:
        """Forget which version the server holds (the next fit pushes the weights again); the server keeps running
        and the weight-transfer group stays open for that push."""
        self.version = -1

    def setup_fit(self, max_policy_lag: int, world_size: int, sharded_policy: bool) -> None:
        """Record the training thread (a collective sync must run in it), and refuse a lag of 2 or more where the
        sync is a collective: a server shared by several ranks, or a sharded policy. At lag ``k >= 2`` syncs run in
        the background thread, so this would otherwise fail only at step ``k + 1``."""
        self._training_thread = threading.current_thread()
        shared = world_size > 1 and len(self.urls) == 1
        if max_policy_lag >= 2 and (shared or sharded_policy):
            why = "one server shared by the trainer ranks" if shared else "a policy sharded across ranks"
            raise ValueError(f"VLLMServerEngine: max_policy_lag={max_policy_lag} syncs the weights from a background "
                             f"thread, and with {why} a sync is a collective, which must run in the training thread: "
                             f"use max_policy_lag <= 1, or a server per rank with an unsharded policy")

    # -- the engine interface ---------------------------------------------------------------------------------
    @torch.no_grad()
    def sync(self, policy: nn.Module, version: int) -> None:
        """Push ``policy``'s weights into the server if ``version`` is not the one it holds (module docstring).

        Under several trainer ranks sharing one server, every rank calls it: rank 0 pushes, and a barrier keeps the
        others from generating before the server holds the new weights. A sharded policy's full weights are gathered
        on every rank (twice: once for the names and shapes announced first, once to send).
        """
        rank, world = _rank()
        shared = world > 1 and len(self.urls) == 1
        training_thread = self._training_thread or threading.main_thread()
        if (shared or is_sharded(policy)) and threading.current_thread() is not training_thread:
            raise RuntimeError("VLLMServerEngine: this sync is a collective across trainer ranks (a server shared by "
                               "the ranks, or a sharded policy) and was called from a background thread, where it "
                               "could interleave with training's collectives: use max_policy_lag <= 1 (its syncs run "
                               "in the training thread) or a server per rank with an unsharded policy")
        if self.url is None:
            self._start()
        self.policy = policy
        if version == self.version:
            return
        pushes = rank == 0 or not shared
        if pushes and self._transport is None:
            self._connect()
        weights = self._weights(policy)
        metadata = [(name, tensor.shape, tensor.dtype) for bucket in weights() for name, tensor in bucket]
        if pushes:
            self._push(weights, metadata, version)
        else:
            for _ in weights():  # the gather of a sharded policy is a collective: every rank runs it
                pass
        if shared:
            torch.distributed.barrier()  # no rank generates before the server holds the new weights
        self.version = version

    def _push(self, weights: Callable[[], Iterator[list[tuple[str, Tensor]]]],
              metadata: list[tuple[str, torch.Size, torch.dtype]], version: int) -> None:
        self._check_alignment(metadata)
        _, update_extra = packing_info(self.server_version, self.bucket_bytes)
        update_info = {"names": [name for name, _, _ in metadata], "shapes": [list(shape) for _, shape, _ in metadata],
                       "dtype_names": [str(dtype).removeprefix("torch.") for _, _, dtype in metadata], **update_extra}
        self._request("POST", "/pause?mode=keep")  # new requests wait; running ones are kept; caches are cleared
        try:
            self._request("POST", "/start_weight_update", {"is_checkpoint_format": True})
            reply = self._in_background("POST", "/update_weights", {"update_info": update_info})
            self._broadcast(weights(), reply)
            reply.join()
        except BaseException:
            # the server holds part of an update and the group may be mid-collective: both must start afresh, and
            # a server left paused would keep every later request waiting
            self._transport, self.version = None, -1
            self._resume_after_failure()
            raise
        self._request("POST", "/finish_weight_update", {"weight_version": str(version)})
        self._request("POST", "/resume")

    def _resume_after_failure(self) -> None:
        """Best effort after a failed update: resume generation, and from vLLM 0.33 close the weight-transfer
        engine, so that the next sync starts a new one."""
        closes = server_release(self.server_version) >= (0, 33)
        paths = ["/resume"] + (["/shutdown_weight_transfer_engine"] if closes else [])
        for path in paths:
            with contextlib.suppress(Exception):
                self._request("POST", path, timeout=30)

    def _check_alignment(self, metadata: list[tuple[str, torch.Size, torch.dtype]]) -> None:
        """vLLM's receiver views each tensor's bytes in place (no padding between tensors), which needs every tensor
        to start at a multiple of its element size: refuse a dtype mix that breaks this rather than fail mid-update."""
        sizes = [shape.numel() * dtype.itemsize for _, shape, dtype in metadata]
        for chunk in packed_chunks(sizes, self.bucket_bytes):
            offset = 0
            for index in chunk:
                name, _, dtype = metadata[index]
                if offset % dtype.itemsize:
                    raise ValueError(f"VLLMServerEngine: {name} ({dtype}) would start at byte {offset} of a packed "
                                     f"buffer, not a multiple of its element size, which vLLM cannot view; give the "
                                     f"policy one dtype (e.g. precision='bf16-true')")
                offset += sizes[index]

    def _weights(self, policy: nn.Module) -> Callable[[], Iterator[list[tuple[str, Tensor]]]]:
        """The policy's tensors under their checkpoint names, in buckets (a LoRA policy merged)."""
        if is_lora(policy):
            return lambda: merged_weights(policy, self.bucket_bytes)
        return lambda: ([(name.replace("_orig_mod.", ""), t) for name, t in bucket]
                        for bucket in full_weights(policy, self.bucket_bytes))

    def _broadcast(self, buckets: Iterator[list[tuple[str, Tensor]]], reply: _Reply) -> None:
        """Stream the tensors into packed buffers and broadcast each when it exceeds the limit (:func:`packed_chunks`:
        the same rule, applied as the tensors come). A server that answered already (it refused the update) is not
        sent the rest."""
        device = self._transport.device
        pieces: list[Tensor] = []
        size = 0

        def send() -> None:
            if not reply.is_alive():
                reply.join()  # raises the server's refusal
                raise RuntimeError("VLLMServerEngine: the server ended the weight update before receiving every tensor")
            self._transport.broadcast(torch.cat(pieces))

        for bucket in buckets:
            for _, tensor in bucket:
                pieces.append(tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(device))
                size += pieces[-1].numel()
                if size > self.bucket_bytes:
                    send()
                    pieces, size = [], 0
        if pieces:
            send()

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> GenerationOutput:
        if self.url is None or self.policy is None:
            raise RuntimeError("VLLMServerEngine.generate called before sync(policy)")
        longest = max(len(p) for p in prompts)
        if self.max_model_len is not None and longest + sampling.max_new_tokens > self.max_model_len:
            raise ValueError(f"VLLMServerEngine: a prompt of {longest} tokens plus max_new_tokens="
                             f"{sampling.max_new_tokens} exceeds the server's max_model_len={self.max_model_len} "
                             f"(vLLM refuses the whole request)")
        stop_ids = self.stop_ids(self.policy, sampling)
        if sampling.greedy and n > 1:  # vLLM refuses n > 1 when greedy: each copy is a prompt (rows stay grouped)
            prompts, n = [p for p in prompts for _ in range(n)], 1
        body = {
            "model": self.served_model, "n": n,
            "max_tokens": sampling.max_new_tokens, "stop_token_ids": list(stop_ids), "logprobs": 0,
            "return_token_ids": True, "min_tokens": 0, "ignore_eos": False, "skip_special_tokens": False,
            # every sampling field explicitly: one left out takes the checkpoint's generation_config.json default
            "temperature": 0.0 if sampling.greedy else sampling.temperature,
            "top_p": 1.0 if sampling.greedy else sampling.top_p, "top_k": 0 if sampling.greedy else sampling.top_k,
            "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        }
        choices = []
        for start in range(0, len(prompts), MAX_PROMPTS_PER_REQUEST):  # vLLM >= 0.28 takes at most 1024 a request
            chunk = prompts[start : start + MAX_PROMPTS_PER_REQUEST]
            reply = self._request("POST", "/v1/completions", {**body, "prompt": [list(map(int, p)) for p in chunk]})
            choices += [{**choice, "index": choice["index"] + start * n} for choice in reply.get("choices") or []]
        return self._to_output(prompts, choices, n, stop_ids)

    def _to_output(self, prompts: list[list[int]], choices: list[dict], n: int,
                   stop_ids: tuple[int, ...]) -> GenerationOutput:
        if len(choices) != len(prompts) * n:
            raise RuntimeError(f"VLLMServerEngine: the server returned {len(choices)} choices for {len(prompts)} "
                               f"prompts × n={n}")
        choices = sorted(choices, key=lambda c: c["index"])
        if [c["index"] for c in choices] != list(range(len(choices))):
            raise RuntimeError(f"VLLMServerEngine: choice indices {[c['index'] for c in choices]} are not 0..N-1")
        rows, logprobs, stopped = [], [], []
        for choice in choices:
            tokens = choice.get("token_ids")
            if tokens is None:
                raise RuntimeError("VLLMServerEngine: the server returned no token_ids (return_token_ids needs "
                                   "vLLM >= 0.10.2)")
            reason = choice.get("finish_reason")
            if reason not in ("stop", "length"):
                raise RuntimeError(f"VLLMServerEngine: the server finished a completion with reason {reason!r}")
            ended = reason == "stop"
            if ended and (not tokens or tokens[-1] not in stop_ids or isinstance(choice.get("stop_reason"), str)):
                raise RuntimeError(
                    f"VLLMServerEngine: the server stopped a completion on token {tokens[-1:] or 'none'} "
                    f"(stop_reason {choice.get('stop_reason')!r}), not one of the stop ids {list(stop_ids)}: the "
                    f"served checkpoint stops on ids the policy's does not; add them to "
                    f"RolloutDataModule(stop_token_ids=...)")
            values = (choice.get("logprobs") or {}).get("token_logprobs")
            if values is None or len(values) != len(tokens) or any(v is None for v in values):
                raise RuntimeError(f"VLLMServerEngine: the server returned {values if values is None else len(values)} "
                                   f"log-probs for {len(tokens)} tokens (logprobs=0 asks for one per token)")
            rows.append(tokens)
            logprobs.append(values)
            stopped.append(ended)
        config = self.policy.generation_config
        pad_id = config.pad_token_id if config.pad_token_id is not None else stop_ids[0]
        return self.from_rows(prompts, n, rows, logprobs, stopped, pad_id)


class _Reply(threading.Thread):
    """An HTTP request in a thread (its reply waits on the trainer's side of a collective); ``join`` re-raises."""

    def __init__(self, engine: VLLMServerEngine, method: str, path: str, body: dict) -> None:
        super().__init__(daemon=True, name=f"vllm-server{path}")
        self.engine, self.method, self.path, self.body = engine, method, path, body
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.engine._request(self.method, self.path, self.body)
        except BaseException as err:  # noqa: BLE001 - handed to the joining thread
            self.error = err

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error
