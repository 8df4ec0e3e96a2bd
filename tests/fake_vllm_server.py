"""A stand-in for ``vllm serve`` (vLLM's OpenAI-compatible server with its dev-mode weight-transfer routes), on
loopback, that speaks vLLM's HTTP protocol and enforces what the server enforces; ``VLLMServerEngine`` is tested
against it (vLLM needs CUDA; ``scripts/gpu_smoke_vllm_server.py`` runs the real server).

It is a FastAPI app, as vLLM's server is, around the offline stand-in :class:`fake_vllm.FakeLLM` (a real float32
copy of the checkpoint, vLLM's stop rules and sampling order). What it enforces, read from vLLM's server
(``entrypoints/openai/completion/protocol.py`` and ``serving.py``, ``sampling_params.py``, ``renderers/params.py``,
``entrypoints/serve/dev/rlhf/api_router.py``, ``distributed/weight_transfer/``; see ``../shared`` notes):

- ``POST /v1/completions``: the request model accepts unknown fields (``extra="allow"``); a malformed field is a
  400 in vLLM's error envelope ``{"error": {"message", "type", "param", "code"}}``; a sampling field left out takes
  the checkpoint's ``generation_config.json`` value, then OpenAI's default (so a client must send them all);
  greedy (temperature < 1e-5) with ``n > 1``, a temperature outside [0, 2], ``top_p`` outside (0, 1], ``top_k <
  -1``, ``logprobs`` above ``max_logprobs`` (20), a token id outside the vocabulary and a prompt longer than
  ``max_model_len - max_tokens`` are each a 400; a ``model`` it does not serve is a 404. Choices come prompt-major
  (``index = prompt * n + sample``); ``token_ids`` end with the EOS or stop id (``stop_reason`` ``None`` for the
  tokenizer's EOS, the id for another), one log-prob per token (floored at -9999), ``usage`` summed;
- the weight routes exist only in dev mode (else 404), ``start_weight_update`` / ``finish_weight_update`` only from
  vLLM 0.21; a missing ``init_info`` / ``update_info`` key is a 400, and their fields are parsed as vLLM's worker
  parses its dataclasses (``cls(**info)``: a missing or unknown key fails, a 500 from the worker), in the form of the
  server's ``version`` (``packed*`` in ``update_info`` up to 0.27, in ``init_info`` from 0.28);
  ``start_weight_update`` needs a JSON body before 0.25; ``update_weights`` fails (500) without a started update,
  and answers only once every announced tensor has been received by every worker — over gloo here (NCCL in vLLM),
  with vLLM's rank layout (trainer 0, workers ``rank_offset + i``) and its packed layout (tensors in order, no
  padding, a buffer received once its running size exceeds ``packed_buffer_size_bytes``, each tensor viewed in
  place in it, so a misaligned dtype fails as in vLLM) — and loaded under its checkpoint name (an unknown name fails
  the update); pausing clears the prefix cache; generation waits while the server is paused.

Simulated tensor parallelism (``workers=2``): every worker receives every buffer, and the test can check they agree.
Every call is recorded in ``calls`` as ``(method, path)``.
"""

from __future__ import annotations

import math
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import uvicorn
from fake_vllm import FakeLLM, SamplingParams
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, NonNegativeInt

from lightning_rlvr.rng import preserved_rng_state
from lightning_rlvr.rollout.weight_transfer import WeightTransport

OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                   "presence_penalty": 0.0, "frequency_penalty": 0.0}
MAX_PROMPTS = 1024  # VLLM_MAX_COMPLETION_PROMPTS
COMMON_INIT = {"master_address", "master_port", "rank_offset", "world_size"}
COMMON_UPDATE = {"names", "dtype_names", "shapes"}
PACKING = {"packed", "packed_buffer_size_bytes", "packed_num_buffers"}


class CompletionRequest(BaseModel):
    """The fields of vLLM's ``CompletionRequest`` the stand-in reads (others are accepted and ignored, as vLLM does)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())
    model: str | None = None
    prompt: list[list[NonNegativeInt]] | list[NonNegativeInt] | str | list[str] | None = None
    n: int = 1
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = []
    logprobs: int | None = None
    return_token_ids: bool | None = None
    ignore_eos: bool = False
    min_tokens: int = 0


class ServerError(Exception):
    """An error reply in vLLM's envelope."""

    def __init__(self, code: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.kind, self.param = code, message, kind, param


def _envelope(code: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=code)


class FakeVLLMServer:
    """``vllm serve model_dir`` on ``127.0.0.1`` (a random port) while the ``with`` block runs (module docstring).

    Args:
        model_dir: the checkpoint served (its weights, tokenizer EOS and generation config).
        served_model_name: the model's name (default: ``model_dir``, as vLLM names it).
        max_model_len: the context limit (default: the model's ``max_position_embeddings``).
        dev_mode: ``VLLM_SERVER_DEV_MODE=1`` (the weight-transfer and cache routes exist).
        workers: the server's workers (tensor parallelism): ``GET /get_world_size``.
        logprobs_mode: ``--logprobs-mode``.
        version: the vLLM version it answers as (``GET /version``), which sets its weight-transfer protocol.
        pause_delay_s: how long ``/pause`` takes before the server is paused (a timing knob: requests arriving meanwhile
            are served with the old weights, as they would be by a server still finishing its running batch).
        timeout_s: how long a worker waits in the weight-transfer group.
    """

    def __init__(self, model_dir: str, served_model_name: str | None = None, max_model_len: int | None = None,
                 dev_mode: bool = True, workers: int = 1, logprobs_mode: str = "processed_logprobs",
                 version: str = "0.27.0", timeout_s: float = 60.0, pause_delay_s: float = 0.0) -> None:
        from transformers import GenerationConfig

        with preserved_rng_state():  # FakeLLM reseeds the process's RNGs as vLLM's worker does in its own process
            self.llm = FakeLLM(model_dir, max_model_len=max_model_len, logprobs_mode=logprobs_mode)
        self.tokenizer_size = self.llm.model.config.vocab_size
        self.defaults = {key: value for key, value in GenerationConfig.from_pretrained(model_dir).to_dict().items()
                         if key in OPENAI_DEFAULTS and value is not None}
        self.name = served_model_name or model_dir
        self.logprobs_mode = logprobs_mode
        self.dev_mode, self.workers, self.pause_delay_s = dev_mode, workers, pause_delay_s
        self.version, self.timeout = version, timedelta(seconds=timeout_s)
        self.release = release = tuple(int(part) for part in version.split(".")[:2])
        self.packing_in = "update_info" if release < (0, 28) else "init_info"
        self.has_start_finish, self.start_needs_body = release >= (0, 21), release < (0, 25)
        self.calls: list[tuple[str, str]] = []
        self.requests: list[dict] = []  # the completion requests' bodies
        self.received: list[list[tuple[str, torch.Tensor]]] = []  # per worker, the last update's tensors
        self.weight_version: str | None = None
        self._groups: list[Any] = []
        self._updating = False
        self._running = threading.Event()
        self._running.set()
        self.app = self._build_app()
        self.url = ""

    def server_info(self, config_format: str = "text") -> dict:
        """vLLM's dev-mode ``/server_info``: its configuration as text, or as the JSON dump of ``VllmConfig``."""
        config = {"model_config": {"logprobs_mode": self.logprobs_mode, "max_model_len": self.llm.max_model_len}}
        return {"vllm_config": config if config_format == "json" else str(config)}

    # -- serving ------------------------------------------------------------------------------------------
    def __enter__(self) -> FakeVLLMServer:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the vLLM server stand-in did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self._running.set()
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.exception_handler(RequestValidationError)
        async def validation(_request, err: RequestValidationError):  # vLLM turns FastAPI's 422 into a 400
            return _envelope(400, f"{len(err.errors())} validation error:\n{err.errors()}", "Bad Request")

        @app.exception_handler(ServerError)
        async def server_error(_request, err: ServerError):
            return _envelope(err.code, err.message, err.kind, err.param)

        @app.middleware("http")
        async def record(request: Request, call_next):
            self.calls.append((request.method, request.url.path + (f"?{request.url.query}" if request.url.query
                                                                    else "")))
            dev_route = request.url.path not in ("/v1/completions", "/v1/models", "/version", "/health")
            if dev_route and not self.dev_mode:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return await call_next(request)

        app.get("/health")(lambda: JSONResponse(None))
        app.get("/version")(lambda: {"version": self.version})
        app.get("/v1/models")(lambda: {"object": "list", "data": [
            {"id": self.name, "object": "model", "owned_by": "vllm", "root": self.name, "parent": None,
             "max_model_len": self.llm.max_model_len}]})
        app.post("/v1/completions")(self.completions)
        app.get("/get_world_size")(lambda: {"world_size": self.workers})
        app.get("/server_info")(self.server_info)
        app.post("/init_weight_transfer_engine")(self.init_weight_transfer)
        app.post("/pause")(self.pause)
        app.post("/resume")(self.resume)
        app.get("/is_paused")(lambda: {"is_paused": not self._running.is_set()})
        if self.has_start_finish:
            app.post("/start_weight_update")(self.start_weight_update)
            app.post("/finish_weight_update")(self.finish_weight_update)
        app.post("/update_weights")(self.update_weights)
        if self.release >= (0, 33):
            app.post("/shutdown_weight_transfer_engine")(self.shutdown_weight_transfer)
        app.post("/reset_prefix_cache")(self.reset_prefix_cache)
        return app

    # -- generation -----------------------------------------------------------------------------------------
    def completions(self, request: CompletionRequest) -> dict:
        self.requests.append(request.model_dump())
        if request.model is not None and request.model != self.name:
            raise ServerError(404, f"The model `{request.model}` does not exist.", "NotFoundError", "model")
        prompts = request.prompt
        if not prompts:
            raise ServerError(400, "Either prompt or prompt_embeds must be provided and non-empty.")
        if isinstance(prompts, str) or isinstance(prompts[0], str):
            raise NotImplementedError("the stand-in takes token-id prompts only")
        if isinstance(prompts[0], int):
            prompts = [prompts]
        if len(prompts) > MAX_PROMPTS:
            raise ServerError(400, f"prompt list length {len(prompts)} exceeds the maximum allowed count of "
                                   f"{MAX_PROMPTS}")
        values = {key: getattr(request, key) if getattr(request, key) is not None else self.defaults.get(key, default)
                  for key, default in OPENAI_DEFAULTS.items()}
        if (values["min_p"], values["repetition_penalty"], values["presence_penalty"],
                values["frequency_penalty"]) != (0.0, 1.0, 0.0, 0.0) or request.min_tokens or request.seed is not None:
            raise NotImplementedError("the stand-in samples without min_p, penalties, min_tokens or a seed")
        max_tokens = request.max_tokens if request.max_tokens is not None else 16
        self._check_sampling(values, request.n, max_tokens, request.logprobs)
        for prompt in prompts:
            if max(prompt) >= self.tokenizer_size:
                raise ServerError(400, f"Token id {max(prompt)} is out of vocabulary")
            if len(prompt) > self.llm.max_model_len - max_tokens:
                raise ServerError(400, f"You passed {len(prompt)} input tokens and requested {max_tokens} output "
                                       f"tokens. However, the model's context length is only "
                                       f"{self.llm.max_model_len} tokens", param="input_tokens")
        self._running.wait()  # a paused server keeps new requests waiting (mode=keep)
        params = SamplingParams(n=request.n, temperature=values["temperature"], top_p=values["top_p"],
                                top_k=values["top_k"], max_tokens=max_tokens, logprobs=request.logprobs,
                                stop_token_ids=request.stop_token_ids or [], ignore_eos=request.ignore_eos)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        choices = []
        for prompt, output in zip(prompts, outputs):
            for completion in output.outputs:
                tokens = list(completion.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    values_ = [max(step[token].logprob, -9999.0) for step, token in zip(completion.logprobs, tokens)]
                    logprobs = {"text_offset": [0] * len(tokens), "token_logprobs": values_,
                                "tokens": [str(t) for t in tokens],
                                "top_logprobs": [{str(t): v} for t, v in zip(tokens, values_)]}
                choices.append({"index": len(choices), "text": "", "logprobs": logprobs,
                                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                                "token_ids": tokens if request.return_token_ids else None,
                                "prompt_token_ids": list(prompt) if request.return_token_ids else None})
        completion_tokens = sum(len(o.token_ids) for out in outputs for o in out.outputs)
        prompt_tokens = sum(len(p) for p in prompts)
        return {"id": "cmpl-stand-in", "object": "text_completion", "created": int(time.time()), "model": self.name,
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                              "total_tokens": prompt_tokens + completion_tokens}}

    def _check_sampling(self, values: dict, n: int, max_tokens: int, logprobs: int | None) -> None:
        """``SamplingParams._verify_args``'s checks of the fields the engine sends."""
        temperature = values["temperature"]
        if not (0.0 <= temperature <= 2.0 and math.isfinite(temperature)):
            raise ServerError(400, f"temperature must be in [0, 2], got {temperature}.", param="temperature")
        if not 0.0 < values["top_p"] <= 1.0:
            raise ServerError(400, f"top_p must be in (0, 1], got {values['top_p']}.", param="top_p")
        if values["top_k"] < -1:
            raise ServerError(400, f"top_k must be 0 (disable), or at least 1, got {values['top_k']}.", param="top_k")
        if not 1 <= n <= 16384:
            raise ServerError(400, f"n must be at least 1, got {n}.", param="n")
        if max_tokens < 1 or max_tokens > self.llm.max_model_len:
            raise ServerError(400, f"max_tokens must be in [1, {self.llm.max_model_len}], got {max_tokens}.",
                              param="max_tokens")
        if logprobs is not None and (logprobs < -1 or logprobs > 20):
            raise ServerError(400, f"Requested sample logprobs of {logprobs}, which is greater than max allowed: 20",
                              param="logprobs")
        if temperature < 1e-5 and n > 1:
            raise ServerError(400, f"n must be 1 when using greedy sampling, got {n}.", param="n")

    # -- weight transfer --------------------------------------------------------------------------------------
    async def init_weight_transfer(self, request: Request) -> dict:
        body = await request.json()
        if "init_info" not in body:
            raise ServerError(400, "Missing 'init_info' in request body", "Bad Request")
        info = self._parse("init_info", body["init_info"], COMMON_INIT | (PACKING if self.packing_in == "init_info"
                                                                          else set()))
        if info["world_size"] != info["rank_offset"] + self.workers:
            raise ServerError(400, f"world_size {info['world_size']} != rank_offset {info['rank_offset']} + "
                                   f"{self.workers} workers")
        self.init_info = info
        # each worker joins the trainer's group (the trainer serves the store); the reply waits for all of them
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        def join(rank: int) -> Any:
            store = TCPStore(info["master_address"], info["master_port"], info["world_size"], is_master=False,
                             timeout=self.timeout)
            return ProcessGroupGloo(PrefixStore("vllm_weight_transfer", store), rank, info["world_size"],
                                    self.timeout)

        self._groups = await _in_threads(join, [info["rank_offset"] + i for i in range(self.workers)])
        return {"message": "Weight transfer initialized"}

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> dict:
        if mode not in ("abort", "wait", "keep"):
            raise ServerError(400, f"Invalid pause mode: {mode}")
        time.sleep(self.pause_delay_s)
        self._running.clear()
        if clear_cache:  # once paused, vLLM's engine core resets its prefix (and other) caches
            self.llm.reset_prefix_cache()
        return {"status": "paused"}

    def shutdown_weight_transfer(self) -> dict:
        """0.33+: close the weight-transfer engine; the next ``/init_weight_transfer_engine`` opens a new one."""
        self._groups, self._updating = [], False
        return {"status": "ok"}

    def resume(self) -> dict:
        self._running.set()
        return {"status": "resumed"}

    async def start_weight_update(self, request: Request) -> dict:
        body = {}
        if self.start_needs_body:  # 0.21 - 0.24 read a JSON body; later versions take none
            try:
                body = await request.json()
            except ValueError as err:
                raise ServerError(400, "Invalid JSON format", "Bad Request") from err
        if not self._groups:
            raise _worker_error("Weight transfer not initialized: call /init_weight_transfer_engine first")
        if self._updating:
            raise _worker_error("A weight update is already active. Call finish_weight_update first.")
        if not body.get("is_checkpoint_format", True):
            raise NotImplementedError("the stand-in loads checkpoint-format weights only")
        self._updating = True
        return {"message": "Weight update started"}

    async def update_weights(self, request: Request) -> dict:
        body = await request.json()
        if "update_info" not in body:
            raise ServerError(400, "Missing 'update_info' in request body", "Bad Request")
        if not self._updating:
            raise _worker_error("start_weight_update must be called before update_weights.")
        info = self._parse("update_info", body["update_info"], COMMON_UPDATE |
                           (PACKING if self.packing_in == "update_info" else set()))
        packing = info if self.packing_in == "update_info" else self.init_info
        if not (len(info["names"]) == len(info["dtype_names"]) == len(info["shapes"])):
            raise _worker_error("Invalid update_info: names, dtype_names and shapes must have the same length")
        if not all(isinstance(getattr(torch, d, None), torch.dtype) for d in info["dtype_names"]):
            raise _worker_error(f"Invalid update_info: dtype names {sorted(set(info['dtype_names']))}")
        metadata = [(name, getattr(torch, dtype), tuple(shape))
                    for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"])]
        if not packing.get("packed", False):
            raise NotImplementedError("the stand-in receives packed updates only")
        limit = packing["packed_buffer_size_bytes"]
        try:
            self.received = await _in_threads(lambda group: _receive_packed(group, metadata, limit), self._groups)
            self.llm._load_weights(self.received[0])
        except (KeyError, ValueError, RuntimeError) as err:
            self._updating = False  # vLLM (0.25+) ends a failed update: a new one must start again
            raise _worker_error(f"load_weights failed: {err!r}") from err
        return {"message": "Weights updated"}

    async def finish_weight_update(self, request: Request) -> dict:
        body = await request.json() if await request.body() else {}
        if not self._updating:
            raise _worker_error("No weight update in progress: call start_weight_update first.")
        self._updating = False
        self.weight_version = body.get("weight_version")
        return {"message": "Weight update finished"}

    def reset_prefix_cache(self) -> JSONResponse:
        self.llm.reset_prefix_cache()
        return JSONResponse(None)

    @staticmethod
    def _parse(what: str, info: Any, fields: set[str]) -> dict:
        """``cls(**info)`` of vLLM's dataclass in the worker: no unknown key, every field present (vLLM has defaults
        for the packing fields, whose default is an unpacked update, which the stand-in does not receive)."""
        if not isinstance(info, dict):
            raise _worker_error(f"Invalid {what}: {info!r}")
        if set(info) - fields:
            raise _worker_error(f"Invalid {what}: __init__() got an unexpected keyword argument "
                                f"{sorted(set(info) - fields)}")
        required = fields - {"packed_num_buffers"}
        if required - set(info):
            raise _worker_error(f"Invalid {what}: missing {sorted(required - set(info))}")
        return info


def _worker_error(message: str) -> ServerError:
    """An error raised in vLLM's worker process: the server answers 500 through ``collective_rpc``."""
    return ServerError(500, f"Call to collective_rpc method failed: {message}", "InternalServerError")


async def _in_threads(function, arguments: list) -> list:
    """``function`` on each argument, each in its own thread, awaited together (each is one blocking collective)."""
    import asyncio

    return list(await asyncio.gather(*(asyncio.to_thread(function, argument) for argument in arguments)))


def _receive_packed(group, metadata: list[tuple[str, torch.dtype, tuple[int, ...]]],
                    limit: int) -> list[tuple[str, torch.Tensor]]:
    """One worker's side of a packed update: tensors in announced order, a ``uint8`` buffer received whenever the
    running byte count of the tensors not yet received passes ``limit``, then the rest in one last buffer."""
    from torch.distributed import BroadcastOptions

    def receive(batch: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[tuple[str, torch.Tensor]]:
        sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for _, dtype, shape in batch]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        options = BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        group.broadcast([buffer], options).wait()
        # viewed in place, as vLLM does: a tensor at an offset that is not a multiple of its element size fails
        return [(name, piece.contiguous().view(dtype).view(shape))
                for (name, dtype, shape), piece in zip(batch, buffer.split(sizes))]

    received, waiting, waiting_bytes = [], [], 0
    for name, dtype, shape in metadata:
        waiting.append((name, dtype, shape))
        waiting_bytes += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if waiting_bytes > limit:
            received += receive(waiting)
            waiting, waiting_bytes = [], 0
    if waiting:
        received += receive(waiting)
    return received


class GlooWeightTransport(WeightTransport):
    """The trainer's side of the stand-in's weight-transfer group, over gloo (vLLM's is NCCL): rank 0, serving the
    store the workers join."""

    def __init__(self) -> None:
        self.group = None
        self.sent: list[int] = []  # the size of each broadcast buffer

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def connect(self, master_address: str, master_port: int, world_size: int) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        timeout = timedelta(seconds=60)
        self.store = TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        self.group = ProcessGroupGloo(PrefixStore("vllm_weight_transfer", self.store), 0, world_size, timeout)

    def broadcast(self, buffer: torch.Tensor) -> None:
        from torch.distributed import BroadcastOptions

        assert buffer.dtype == torch.uint8 and buffer.dim() == 1
        options = BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self.group.broadcast([buffer], options).wait()
        self.sent.append(buffer.numel())

