"""max_policy_lag=1: the next rollout is generated in the background by a policy one step old, and corrected."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from tests.two_ranks import distributed_worker, spawn_two
from test_module import reverse_data, trainer

from lightning_rlvr import RLVRModule
from lightning_rlvr.callbacks import OPEFO, Intervention, SupervisedWarmStart
from lightning_rlvr.loggers import InMemoryLogger
from lightning_rlvr.rollout import HFEngine, ProcessEngine

pytestmark = pytest.mark.filterwarnings("ignore")

CAP = 1.1  # small, so that some tokens of a one-step-old rollout are capped


class GeneratingPolicyCheck(Intervention):
    """Snapshots the weights at every step start; for every rollout, the versions and the log-probs of its tokens
    under the snapshot that generated it (``torch.distributions``, a fresh model) and under this step's policy."""

    def __init__(self) -> None:
        self.snapshots: dict[int, dict] = {}
        self.seen: list[dict] = []
        self.start_versions: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        version = pl_module.policy_version
        self.start_versions.append(version)
        self.snapshots[version] = copy.deepcopy(pl_module.policy.state_dict())

    @torch.no_grad()
    def _logprobs(self, pl_module, state, batch):
        model = copy.deepcopy(pl_module.policy)
        model.load_state_dict(state)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits.float()
        width = batch.response_mask.shape[1]
        tokens = batch.input_ids[:, -width:]
        dist = torch.distributions.Categorical(logits=logits[:, -(width + 1) : -1] / batch.temperature)
        return dist.log_prob(tokens)

    def on_rollout(self, trainer, pl_module, batch):
        mask = batch.response_mask > 0
        generating = self._logprobs(pl_module, self.snapshots[batch.policy_version], batch)
        current = self._logprobs(pl_module, self.snapshots[pl_module.policy_version], batch)
        self.seen.append({"version": batch.policy_version, "current": pl_module.policy_version,
                          "engine_error": (batch.engine_logprobs - generating)[mask].abs().max().item(),
                          "capped": (torch.exp(current - batch.engine_logprobs)[mask] > CAP).float().mean().item()})
        return None


def lagged_fit(steps, callbacks, memory_logger=None, engine=None, lag=1, model="builtin:tiny", **data_kwargs):
    engine = engine if engine is not None else HFEngine(weights="copy")
    data = reverse_data(engine=engine, max_policy_lag=lag, **data_kwargs)
    module = RLVRModule(model=model, learning_rate=1e-2, engine_is_cap=CAP, minibatch_size=None)
    fit = trainer(steps, callbacks=[SupervisedWarmStart(steps=100), *callbacks],
                  logger=memory_logger if memory_logger is not None else False)
    fit.fit(module, data)
    return fit, module, data


@pytest.mark.parametrize(("make_engine", "lag"), [(lambda: HFEngine(weights="copy"), 1),
                                                  (lambda: ProcessEngine(threads=1), 1),
                                                  (lambda: HFEngine(weights="copy"), 2),
                                                  (lambda: ProcessEngine(threads=1), 3)],
                         ids=["thread-lag1", "process-lag1", "thread-lag2", "process-lag3"])
def test_every_batch_comes_from_a_policy_at_most_lag_steps_old_and_is_corrected(memory_logger, make_engine, lag):
    torch.manual_seed(0)
    check = GeneratingPolicyCheck()
    engine = make_engine()
    lagged_fit(8, [check], memory_logger, engine, lag, dynamic_sampling=True, max_generation_rounds=2)
    assert getattr(engine, "_process", None) is None  # the fit's end stopped a process engine
    starts = check.start_versions
    for step, seen in enumerate(check.seen):
        allowed = starts[max(step - lag, 0) : step + 1]
        assert seen["version"] in allowed, (step, seen, starts)
        # The rollout's own log-probs are the generating policy's (its tokens scored by that snapshot)...
        assert seen["engine_error"] < 1e-4, (step, seen)
    assert max(memory_logger.history["rollout/generation_rounds"].values()) > 1  # refills ran in the background too
    lags = memory_logger.history["rollout/policy_lag"]
    # step 0 generates in the foreground; at its end the next `lag` steps are queued with its weights, and from then
    # on each step queues the one `lag` steps ahead: step s trains on the policy of step max(s - lag, 0)
    assert [lags[s] for s in range(8)] == [float(min(s, lag)) for s in range(8)]
    assert all(check.seen[s]["version"] == starts[max(s - lag, 0)] for s in range(8))
    # ...and the TIS share of capped tokens is the hand count of exp(log π_current − log π_generating) > C.
    clipped = memory_logger.history["policy/tis_clipfrac"]
    assert [clipped[s] for s in range(8)] == pytest.approx([seen["capped"] for seen in check.seen], abs=1e-6)
    assert max(clipped[s] for s in range(1, 8)) > 0  # the correction acted
    waits = memory_logger.history["perf/generate_wait_s"]
    assert all(waits[s] >= 0 for s in range(8)) and all(memory_logger.history["perf/train_s"][s] > 0 for s in range(8))


def test_a_bf16_policy_runs_at_lag_one_on_the_engines_own_logprobs():
    torch.manual_seed(0)
    check = GeneratingPolicyCheck()
    data = reverse_data(engine=HFEngine(weights="copy"), max_policy_lag=1)
    module = RLVRModule(model="builtin:tiny", dtype="bfloat16", learning_rate=1e-2, engine_is_cap=CAP)
    trainer(4, callbacks=[SupervisedWarmStart(steps=20), check]).fit(module, data)
    assert next(module.policy.parameters()).dtype == torch.bfloat16
    for step, seen in enumerate(check.seen):
        assert seen["version"] == check.start_versions[max(step - 1, 0)]
        # the engine scored its rollout with the generating bf16 weights, as the snapshot's forward does
        assert seen["engine_error"] < 1e-3, (step, seen)


@pytest.mark.parametrize("lag", [1, 2])
def test_a_resumed_run_trains_on_no_batch_older_than_the_lag(tmp_path, lag):
    torch.manual_seed(0)
    fit, _, _ = lagged_fit(4, [], lag=lag)
    fit.save_checkpoint(tmp_path / "step4.ckpt")
    check = GeneratingPolicyCheck()
    data = reverse_data(engine=HFEngine(weights="copy"), max_policy_lag=lag)
    module = RLVRModule(model="builtin:tiny", learning_rate=1e-2, engine_is_cap=CAP)
    resumed = trainer(8, callbacks=[SupervisedWarmStart(steps=100), check])
    resumed.fit(module, data, ckpt_path=tmp_path / "step4.ckpt")
    assert len(check.seen) == 4
    # what was generated ahead died with the first process: the resumed run's first rollout is its own policy's,
    # and the queue starts again from there
    for step, seen in enumerate(check.seen):
        assert seen["version"] == check.start_versions[max(step - lag, 0)]


def test_lag_zero_with_a_copy_engine_trains_exactly_as_the_live_engine():
    states = []
    for engine in (HFEngine(), HFEngine(weights="copy")):
        torch.manual_seed(0)
        module = RLVRModule(model="builtin:tiny", learning_rate=1e-2)
        trainer(4, callbacks=[SupervisedWarmStart(steps=50)]).fit(module, reverse_data(engine=engine))
        states.append(module.policy.state_dict())
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key


@distributed_worker
def lagged_ddp_worker(rank: int, port: int, out_dir: str) -> None:
    torch.manual_seed(0)
    check = GeneratingPolicyCheck()
    logger = InMemoryLogger()
    data = reverse_data(engine=HFEngine(weights="copy"), max_policy_lag=1, prompts_per_step=4)
    module = RLVRModule(model="builtin:tiny", learning_rate=1e-2, engine_is_cap=CAP)
    trainer(5, devices=2, strategy="ddp", use_distributed_sampler=False, logger=logger, callbacks=[check]).fit(
        module, data)
    torch.save({"seen": check.seen, "starts": check.start_versions, "history": logger.history,
                "weights": {k: v.detach().clone() for k, v in module.policy.state_dict().items()}},
               os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_under_ddp_every_rank_trains_on_its_own_previous_step_rollouts(tmp_path):
    spawn_two(lagged_ddp_worker, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]  # our own files
    for rank in ranks:
        starts = rank["starts"]
        assert [seen["version"] for seen in rank["seen"]] == [starts[0]] + starts[:-1]
        assert all(seen["engine_error"] < 1e-4 for seen in rank["seen"])  # the generating snapshot's log-probs
        assert [rank["history"]["rollout/policy_lag"][s] for s in range(5)] == [0.0] + [1.0] * 4
    for key, value in ranks[0]["weights"].items():  # DDP kept the replicas equal through the lagged steps
        assert torch.equal(value, ranks[1]["weights"][key]), key


def test_what_a_lag_needs_is_checked_before_training():
    with pytest.raises(ValueError, match="max_policy_lag must be an int >= 0"):
        reverse_data(max_policy_lag=-1)
    with pytest.raises(ValueError, match="weights must be 'live' or 'copy'"):
        HFEngine(weights="shared")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="its own copy of the weights"):
            trainer(1).fit(RLVRModule(model="builtin:tiny", engine_is_cap=2.0), reverse_data(max_policy_lag=1))
        with pytest.raises(ValueError, match="engine_is_cap"):
            trainer(1).fit(RLVRModule(model="builtin:tiny"),
                           reverse_data(engine=HFEngine(weights="copy"), max_policy_lag=1))
        with pytest.raises(ValueError, match="OPEFO"):
            trainer(1, callbacks=[OPEFO()]).fit(RLVRModule(model="builtin:tiny", engine_is_cap=2.0),
                                                reverse_data(engine=HFEngine(weights="copy"), max_policy_lag=1))
