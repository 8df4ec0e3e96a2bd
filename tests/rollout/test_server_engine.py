"""VLLMServerEngine against the ``vllm serve`` stand-in (tests/fake_vllm_server.py: vLLM's HTTP protocol and checks,
a real float32 copy of the pushed weights, the weight-transfer group over gloo in place of NCCL)."""

from __future__ import annotations

import copy
from shutil import copytree

import pytest
import torch
from fake_vllm_server import FakeVLLMServer, GlooWeightTransport
from tests.two_ranks import distributed_worker, spawn_two
from test_process_engine import sampled_logprobs, valid
from transformers import AutoModelForCausalLM, GenerationConfig

from lightning_rlvr.rollout import SamplingConfig
from lightning_rlvr.rollout.server import VLLMServerEngine
from lightning_rlvr.rollout.weight_transfer import packed_chunks

pytestmark = pytest.mark.filterwarnings("ignore")


def make_engine(server: FakeVLLMServer, **kwargs) -> VLLMServerEngine:
    transport = GlooWeightTransport()
    engine = VLLMServerEngine(server.url, master_address="127.0.0.1", transport_factory=lambda: transport, **kwargs)
    engine.test_transport = transport
    return engine


@pytest.fixture
def chat_policy(tiny_chat_dir):
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_chat_dir)
    with torch.no_grad():  # other weights than the served checkpoint's: what the server samples shows the push
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
        policy.model.norm.weight.mul_(30)  # peaked next-token distributions (a random init's are near uniform)
    return policy


PROMPTS = [[5, 17, 40, 9], [12, 3], [7, 7, 7, 30, 2]]


def test_packed_chunks_close_once_the_running_size_exceeds_the_buffer():
    # by hand: 4+4 = 8 > 7 closes [0, 1]; 4+10 > 7 closes [2, 3]; the 1 byte left is the last chunk
    assert packed_chunks([4, 4, 4, 10, 1], 7) == [[0, 1], [2, 3], [4]]
    assert packed_chunks([3, 4], 7) == [[0, 1]]          # exactly 7 does not exceed 7
    assert packed_chunks([20], 7) == [[0]]
    assert packed_chunks([], 7) == []


@pytest.mark.parametrize(("version", "workers"), [("0.22.0", 1), ("0.28.1", 2)])  # packed* in update_info / init_info
def test_a_sync_puts_the_policys_exact_weights_into_every_worker(tiny_chat_dir, chat_policy, version, workers):
    with FakeVLLMServer(tiny_chat_dir, workers=workers, version=version) as server:
        # 8 KiB buffers: the tiny model's weights travel in many broadcasts, its embedding alone exceeding one
        engine = make_engine(server, bucket_mb=8 / 1024)
        engine.sync(chat_policy, 3)
        for name, parameter in chat_policy.named_parameters():
            assert torch.equal(server.llm.weights[name], parameter.detach()), name
        for worker in server.received:  # simulated tensor parallelism: every worker got every tensor, bit for bit
            assert [name for name, _ in worker] == [name for name, _ in chat_policy.named_parameters()]
            for (_, received), (_, parameter) in zip(worker, chat_policy.named_parameters()):
                assert torch.equal(received, parameter.detach())
        sizes = [p.numel() * p.element_size() for p in chat_policy.parameters()]
        assert engine.test_transport.sent == [sum(sizes[i] for i in chunk) for chunk in packed_chunks(sizes, 8192)]
        assert len(engine.test_transport.sent) > 3
        assert server.weight_version == "3"


def test_the_update_follows_vllms_four_phases_and_only_when_the_version_moved(tiny_chat_dir, chat_policy):
    with FakeVLLMServer(tiny_chat_dir) as server:
        engine = make_engine(server)
        engine.sync(chat_policy, 0)
        engine.sync(chat_policy, 0)  # same version: nothing sent
        with torch.no_grad():
            chat_policy.lm_head.weight.add_(0.1)
        engine.sync(chat_policy, 1)
        routes = [path for method, path in server.calls
                  if path not in ("/v1/models", "/version", "/server_info?config_format=json")]
        update = ["/pause?mode=keep", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"]
        assert routes == ["/get_world_size", "/init_weight_transfer_engine", *update, *update]
        assert [c[0] for c in server.llm.calls].count("reset_prefix_cache") == 2  # pausing cleared the cache
        assert torch.equal(server.llm.weights["model.embed_tokens.weight"], chat_policy.lm_head.weight.detach())


def frequent_token(engine) -> int:
    """The token the policy most likely writes first after ``PROMPTS[0]`` (a stop id that rows often reach)."""
    out = engine.generate(PROMPTS[:1], 1, SamplingConfig(max_new_tokens=1, greedy=True, stop_token_ids=(512, 514)))
    return int(out.completion_ids[0, 0])


def test_generation_returns_what_the_server_sampled_grouped_by_prompt(tiny_chat_dir, chat_policy):
    with FakeVLLMServer(tiny_chat_dir) as server:
        engine = make_engine(server)
        engine.sync(chat_policy, 0)
        stop = frequent_token(engine)  # a user stop id beside the checkpoint's two
        sampling = SamplingConfig(max_new_tokens=12, temperature=0.8, stop_token_ids=(512, 514, stop))
        torch.manual_seed(1)
        out = engine.generate(PROMPTS, 4, sampling)
        served = [c for o in server.llm.last_outputs for c in o.outputs]
    assert out.completion_ids.shape[0] == 12
    for row, completion in enumerate(served):  # row i: sample i mod 4 of prompt i // 4
        length = int(out.lengths[row])
        assert out.completion_ids[row, :length].tolist() == list(completion.token_ids)
        assert bool(out.stopped[row]) == (completion.finish_reason == "stop")
        assert out.prompt_ids[row][out.prompt_mask[row] > 0].tolist() == PROMPTS[row // 4]
    assert out.stopped.any()  # some rows end on a stop id, which they keep as their last token
    for row in torch.nonzero(out.stopped).flatten().tolist():
        assert int(out.completion_ids[row, int(out.lengths[row]) - 1]) in (512, 514, stop)
    # the log-probs are the pushed weights' own at the sampling temperature
    reference = sampled_logprobs(chat_policy, out, 0.8)
    torch.testing.assert_close(out.logprobs[valid(out)], reference[valid(out)], atol=1e-4, rtol=0)


def test_every_sampling_field_is_sent_so_the_checkpoints_defaults_never_apply(tmp_path, tiny_chat_dir, chat_policy):
    checkpoint = copytree(tiny_chat_dir, tmp_path / "ckpt")
    config = GenerationConfig.from_pretrained(checkpoint)
    config.update(do_sample=True, temperature=0.3, top_p=0.5, top_k=3)
    config.save_pretrained(checkpoint)
    with FakeVLLMServer(str(checkpoint)) as server:
        engine = make_engine(server)
        engine.sync(chat_policy, 0)
        engine.generate(PROMPTS, 2, SamplingConfig(max_new_tokens=4, temperature=1.0, stop_token_ids=(512, 514)))
        params = server.llm.params
        assert (params.temperature, params.top_p, params.top_k, params.n) == (1.0, 1.0, 0, 2)
        assert sorted(params.stop_token_ids) == [512, 514]
        # greedy with n > 1, which vLLM refuses: one prompt per copy, n = 1, rows still grouped by prompt
        out = engine.generate(PROMPTS[:2], 3, SamplingConfig(max_new_tokens=4, greedy=True, stop_token_ids=(512, 514)))
        assert server.requests[-1]["n"] == 1 and server.requests[-1]["temperature"] == 0.0
        assert len(server.requests[-1]["prompt"]) == 6
        for prompt in range(2):
            rows = out.completion_ids[3 * prompt:3 * prompt + 3]
            assert (rows == rows[0]).all()


def test_a_lora_policy_reaches_the_server_merged(tiny_chat_dir):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_dir)
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.2)
    merged = copy.deepcopy(policy).merge_and_unload()  # peft's own merge, the reference
    with FakeVLLMServer(tiny_chat_dir) as server:
        engine = make_engine(server, bucket_mb=0.01)
        engine.sync(policy, 0)
        for name, parameter in merged.named_parameters():
            torch.testing.assert_close(server.llm.weights[name], parameter.detach(), atol=1e-6, rtol=0)
        assert not any("lora" in name for name, _ in server.received[0])


def test_bad_setups_and_replies_are_named(tmp_path, tiny_chat_dir, chat_policy, tiny_model_dir):
    with pytest.raises(ValueError, match="base_url"):
        VLLMServerEngine("localhost:8000")
    with pytest.raises(RuntimeError, match="no vLLM server answers at http://127.0.0.1:9"):
        VLLMServerEngine("http://127.0.0.1:9").sync(chat_policy, 0)
    with FakeVLLMServer(tiny_chat_dir, dev_mode=False) as server:
        with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1"):
            make_engine(server).sync(chat_policy, 0)
    with FakeVLLMServer(tiny_chat_dir, max_model_len=32) as server:
        engine = make_engine(server, model=server.name)
        engine.sync(chat_policy, 0)
        with pytest.raises(ValueError, match="max_model_len=32"):
            engine.generate([[5] * 30], 2, SamplingConfig(max_new_tokens=4, stop_token_ids=(512, 514)))
        with pytest.raises(ValueError, match="serves"):
            make_engine(server, model="other").sync(chat_policy, 0)
        stop = frequent_token(engine)
    # a served checkpoint whose generation config stops on an id the policy's stop ids leave out
    checkpoint = copytree(tiny_chat_dir, tmp_path / "ckpt")
    config = GenerationConfig.from_pretrained(checkpoint)
    config.eos_token_id = [514, 512, stop]
    config.save_pretrained(checkpoint)
    with FakeVLLMServer(str(checkpoint)) as server:
        engine = make_engine(server)
        engine.sync(chat_policy, 0)
        with pytest.raises(RuntimeError, match=f"stopped a completion on token \\[{stop}\\]"):
            engine.generate(PROMPTS[:1], 1, SamplingConfig(max_new_tokens=4, greedy=True, stop_token_ids=(512, 514)))
    # a policy of another architecture: the server cannot load its names, the update fails with its message
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with FakeVLLMServer(tiny_chat_dir) as server:
        engine = make_engine(server)
        with pytest.raises(RuntimeError, match="load_weights failed"):
            engine.sync(other, 0)
        assert engine.version == -1


@pytest.mark.parametrize("lag", [1, 2])
def test_a_fit_at_a_lag_trains_on_the_servers_rollouts_of_the_generating_policy(tiny_model_dir, memory_logger, lag):
    from test_async_rollouts import GeneratingPolicyCheck, lagged_fit

    torch.manual_seed(0)
    check = GeneratingPolicyCheck()
    with FakeVLLMServer(tiny_model_dir) as server:
        engine = make_engine(server)
        lagged_fit(6, [check], memory_logger, engine, lag, model=tiny_model_dir)
        pushed = [path for _, path in server.calls].count("/update_weights")
    starts = check.start_versions
    for step, seen in enumerate(check.seen):
        assert seen["version"] == starts[max(step - lag, 0)], (step, seen, starts)
        # the server's log-probs are those of the weights that generated the batch (pushed by version)
        assert seen["engine_error"] < 1e-4, (step, seen)
    assert [memory_logger.history["rollout/policy_lag"][s] for s in range(6)] == [float(min(s, lag)) for s in range(6)]
    # each step queues a generation with the weights it starts from, and none past the fit's last step: every
    # version that generates a trained rollout is pushed, once (the last `lag` steps' versions generate nothing)
    assert pushed == len({starts[max(step - lag, 0)] for step in range(6)}) == 6 - lag


def test_the_packing_fields_go_where_the_servers_vllm_version_parses_them():
    from lightning_rlvr.rollout.weight_transfer import packing_info

    packing = {"packed": True, "packed_buffer_size_bytes": 64, "packed_num_buffers": 2}
    # vLLM 0.28.0 (PR #50902) moved them from NCCLWeightTransferUpdateInfo into NCCLWeightTransferInitInfo
    assert packing_info("0.27.3", 64) == ({}, packing)
    assert packing_info("0.21.0", 64) == ({}, packing)
    assert packing_info("0.28.0", 64) == (packing, {})
    assert packing_info("0.34.1.dev12+g62d4bc3c7", 64) == (packing, {})
    assert packing_info("1.0.0rc1", 64) == (packing, {})


def test_a_dtype_mix_vllm_cannot_view_in_place_is_refused_before_the_update(tiny_chat_dir, monkeypatch):
    mixed = torch.nn.Module()
    mixed.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))  # 6 bytes
    mixed.weight = torch.nn.Parameter(torch.ones(4))                        # float32 at byte 6 of the buffer
    with FakeVLLMServer(tiny_chat_dir) as server:
        engine = make_engine(server)
        with pytest.raises(ValueError, match="weight .torch.float32. would start at byte 6"):
            engine.sync(mixed, 0)
        assert ("POST", "/pause?mode=keep") not in server.calls
        # what the server would have done with it: vLLM's in-place view fails, and the update with it
        monkeypatch.setattr(VLLMServerEngine, "_check_alignment", lambda self, metadata: None)
        with pytest.raises(RuntimeError, match="HTTP 500.*must be divisible by 4"):
            engine.sync(mixed, 0)


def test_ranks_share_a_server_or_have_one_each_and_the_server_needs_a_recent_vllm(tiny_chat_dir, chat_policy,
                                                                                    monkeypatch):
    import threading

    import lightning_rlvr.rollout.server as server_module

    monkeypatch.setattr(server_module, "_rank", lambda: (1, 2))
    with pytest.raises(ValueError, match="3 base URLs for 2 trainer ranks"):
        VLLMServerEngine(["http://a:1", "http://b:1", "http://c:1"]).sync(chat_policy, 0)
    errors = []  # a shared server makes the sync a collective, refused in a background thread (lag > 1)
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(
        RuntimeError, VLLMServerEngine("http://127.0.0.1:1").sync, chat_policy, 0)))
    thread.start()
    thread.join()
    assert "called from a background thread" in str(errors[0].value)
    with FakeVLLMServer(tiny_chat_dir) as server:
        engine = make_engine(server)
        engine.urls = ["http://127.0.0.1:1", server.url]  # rank 1 talks to the second server only, and pushes
        engine.sync(chat_policy, 0)
        assert engine.url == server.url and ("POST", "/update_weights") in server.calls
    monkeypatch.undo()
    with FakeVLLMServer(tiny_chat_dir, version="0.20.0") as server:
        with pytest.raises(RuntimeError, match="runs vLLM 0.20.0; weight updates need vLLM >= 0.21"):
            make_engine(server).sync(chat_policy, 0)
    with FakeVLLMServer(tiny_chat_dir) as server:
        engine = make_engine(server)
        engine.transport_factory().library_version = "0.26.0"
        with pytest.warns(UserWarning, match="the trainer's vLLM is 0.26.0, the server's 0.27.0"):
            engine.sync(chat_policy, 0)


@distributed_worker
def shared_server_worker(rank: int, port: int, model_dir: str, urls: list[str], out_dir: str) -> None:
    """A DDP fit against the first server, then FSDP2 fits against the second (lag 0) and the third (lag 1 with
    dynamic sampling), in one spawn (each costs ~5 s)."""
    from test_distributed_fit import strategy_for
    from test_module import reverse_data, trainer

    from lightning_rlvr import RLVRModule
    from lightning_rlvr.callbacks import EntropyBonus
    from lightning_rlvr.loggers import InMemoryLogger
    from lightning_rlvr.sharding import is_sharded

    for run, strategy, url, lag in (("ddp", "ddp", urls[0], 0), ("fsdp", "fsdp", urls[1], 0),
                                     ("fsdp-lag1", "fsdp", urls[2], 1)):
        torch.manual_seed(rank)
        logger = InMemoryLogger()
        engine = VLLMServerEngine(url, master_address="127.0.0.1", transport_factory=GlooWeightTransport)
        module = RLVRModule(model=model_dir, learning_rate=1e-2, engine_is_cap=2.0 if lag else None)
        # the entropy bonus moves the weights at every step, whatever the rewards: a stale rollout would show
        data = reverse_data(engine=engine, prompts_per_step=4, max_policy_lag=lag, dynamic_sampling=bool(lag),
                            max_generation_rounds=2)
        trainer(4, devices=2, strategy=strategy_for(strategy, 2), use_distributed_sampler=False, logger=logger,
                callbacks=[EntropyBonus(coef=1.0)]).fit(module, data)
        torch.save({"history": logger.history, "sharded": is_sharded(module.policy)}, f"{out_dir}/{run}-rank{rank}.pt")


@pytest.mark.slow
def test_ranks_share_one_server_and_none_generates_before_the_push(tiny_model_dir, tmp_path):
    """Two ranks, one server: rank 0 pushes the weights (under FSDP2 both gather them), and rank 1 waits for the push
    (the server takes 0.5 s to pause: a rank that did not wait would be served by the old weights, and its
    ``rollout/engine_kl`` would show it: 0.01-0.05 under DDP without the barrier; under FSDP2 the second gather,
    which rank 0 runs while pushing, already holds rank 1 back)."""
    with FakeVLLMServer(tiny_model_dir, pause_delay_s=0.5) as ddp, \
            FakeVLLMServer(tiny_model_dir, pause_delay_s=0.5) as fsdp, FakeVLLMServer(tiny_model_dir) as lagged:
        spawn_two(shared_server_worker, tiny_model_dir, [ddp.url, fsdp.url, lagged.url], str(tmp_path))
        calls = {"ddp": [path for _, path in ddp.calls], "fsdp": [path for _, path in fsdp.calls]}
        lagged_pushes = [path for _, path in lagged.calls].count("/update_weights")
    # FSDP2 at lag 1 with dynamic sampling: the gathers run in the training thread, the rounds in the background
    # without a lockstep (a collective there would interleave with training's)
    for r in range(2):
        history = torch.load(tmp_path / f"fsdp-lag1-rank{r}.pt", weights_only=False)["history"]
        assert [history["rollout/policy_lag"][s] for s in range(4)] == [0.0, 1.0, 1.0, 1.0]
        assert all(history["rollout/generation_rounds"][s] >= 1 for s in range(4))
    assert lagged_pushes == 3  # versions 0-2 generate steps 0-3; none generates past the fit's last step
    for strategy in ("ddp", "fsdp"):
        ranks = [torch.load(tmp_path / f"{strategy}-rank{r}.pt", weights_only=False) for r in range(2)]  # ours
        assert all(rank["sharded"] == (strategy == "fsdp") for rank in ranks)
        # one trainer (rank 0) in the group, a push per step's version
        assert (calls[strategy].count("/init_weight_transfer_engine"), calls[strategy].count("/update_weights")) \
            == (1, 4), strategy
        for rank in ranks:
            kl = rank["history"]["rollout/engine_kl"]
            assert len(kl) == 4 and all(abs(value) < 1e-5 for value in kl.values()), (strategy, kl)


def test_a_server_whose_logprobs_ignore_the_temperature_is_refused(tiny_chat_dir, chat_policy):
    """vLLM's default ``--logprobs-mode raw_logprobs`` scores before the temperature: every importance weight at
    T != 1 would be off. The engine reads the mode from the dev route ``/server_info?config_format=json``."""
    with FakeVLLMServer(tiny_chat_dir, logprobs_mode="raw_logprobs") as server:
        with pytest.raises(ValueError, match="raw_logprobs log-probs; start it with --logprobs-mode processed_logprobs"):
            make_engine(server).sync(chat_policy, 0)
        assert ("GET", "/server_info?config_format=json") in server.calls
        assert not any(path.startswith("/pause") for _, path in server.calls)


def test_a_failed_update_resumes_the_server_so_later_requests_do_not_wait_forever(tiny_chat_dir, chat_policy,
                                                                                  monkeypatch):
    mixed = copy.deepcopy(chat_policy)
    mixed.model.embed_tokens.weight = torch.nn.Parameter(mixed.model.embed_tokens.weight.half())
    mixed.weight = torch.nn.Parameter(torch.ones(4))  # a float32 tensor that vLLM's receiver cannot view in place
    monkeypatch.setattr(VLLMServerEngine, "_check_alignment", lambda self, metadata: None)
    for version, closes in (("0.27.0", False), ("0.33.0", True)):
        with FakeVLLMServer(tiny_chat_dir, version=version) as server:
            engine = make_engine(server)
            with pytest.raises(RuntimeError, match="HTTP 500"):
                engine.sync(mixed, 0)
            paths = [path for _, path in server.calls]
            assert paths[paths.index("/pause?mode=keep"):][-(2 if closes else 1):] == \
                ["/resume"] + (["/shutdown_weight_transfer_engine"] if closes else [])
            assert server._running.is_set()  # not paused: a request is served
            out = engine.generate([[1, 2, 3]], 1, SamplingConfig(max_new_tokens=2))
            assert out.completion_ids.shape[0] == 1


def test_a_disabled_nccl_communicator_is_refused_at_once(monkeypatch):
    """vLLM's PyNcclCommunicator disables itself (world size 1, VLLM_DISABLE_PYNCCL, no libnccl); its broadcasts
    then do nothing, and the server would wait minutes for weights that never come."""
    import sys
    import types

    from lightning_rlvr.rollout.weight_transfer import NCCLWeightTransport

    created = []

    class Communicator:
        def __init__(self, group, device):
            self.disabled = True
            created.append(device)

    pynccl = types.ModuleType("vllm.distributed.device_communicators.pynccl")
    pynccl.PyNcclCommunicator = Communicator
    utils = types.ModuleType("vllm.distributed.utils")
    utils.StatelessProcessGroup = types.SimpleNamespace(create=lambda **kwargs: object())
    monkeypatch.setitem(sys.modules, "vllm.distributed.device_communicators.pynccl", pynccl)
    monkeypatch.setitem(sys.modules, "vllm.distributed.utils", utils)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    transport = NCCLWeightTransport()
    with pytest.raises(RuntimeError, match="disabled itself"):
        transport.connect("127.0.0.1", 1, 2)
    assert created == [torch.device("cuda", 1)] and transport.device == torch.device("cuda", 1)


def test_the_sampling_temperature_is_at_most_two_as_vllm_requires():
    assert SamplingConfig(temperature=2.0).temperature == 2.0
    for temperature in (0.0, 2.5):
        with pytest.raises(ValueError, match=r"temperature must be in \(0, 2\]"):
            SamplingConfig(temperature=temperature)


def test_more_prompts_than_a_request_takes_go_in_several_requests(tiny_chat_dir, chat_policy, monkeypatch):
    """vLLM from 0.28 takes at most VLLM_MAX_COMPLETION_PROMPTS (1024) prompts per request; greedy n > 1 multiplies
    them. Here the limit is 4 on both sides: 5 prompts x 2 greedy copies go in requests of 4, 4 and 2, and the rows
    come back in order, as one request gives them."""
    import fake_vllm_server

    import lightning_rlvr.rollout.server as server_module

    prompts = [[1, 2, 3 + i] for i in range(5)]
    greedy = SamplingConfig(max_new_tokens=3, greedy=True)
    with FakeVLLMServer(tiny_chat_dir) as server:
        engine = make_engine(server)
        engine.sync(chat_policy, 0)
        whole = engine.generate(prompts, 2, greedy)
        monkeypatch.setattr(fake_vllm_server, "MAX_PROMPTS", 4)
        monkeypatch.setattr(server_module, "MAX_PROMPTS_PER_REQUEST", 4)
        chunked = engine.generate(prompts, 2, greedy)
        sizes = [len(request["prompt"]) for request in server.requests[-3:]]
    assert sizes == [4, 4, 2]
    assert torch.equal(chunked.completion_ids, whole.completion_ids)
    assert torch.equal(chunked.prompt_ids, whole.prompt_ids)
