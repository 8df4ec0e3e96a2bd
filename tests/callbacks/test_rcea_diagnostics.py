"""RCEADiagnostics in a fit: logged windows equal an independent recomputation, retention probe, plots."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import MLFlowLogger

from lightning_rlvr import RLVRModule
from lightning_rlvr.callbacks import EntropyChangeProbe, Intervention, RCEADiagnostics
from lightning_rlvr.callbacks.rcea_diagnostics import question_ids
from lightning_rlvr.metrics.rcea import sign_test_pvalue
from test_module import frozen_rollout, reverse_data, trainer

from tests.conftest import ScriptedEngine

from .test_protocol import fixed


class Capture(Intervention):
    """Keeps every step's behaviour entropy, mask, verdicts and question ids."""

    def __init__(self) -> None:
        self.steps = []

    def on_update_end(self, trainer, pl_module, ctx):
        self.steps.append((ctx.old_entropy.clone(), ctx.mask.clone(), ctx.batch.correct.clone(),
                           question_ids(ctx.batch)))


def by_hand(steps):
    tokens = {False: [], True: []}
    per_question: dict[tuple[int, bool], list[float]] = {}
    for entropy, mask, correct, questions in steps:
        for i in range(len(mask)):
            values = entropy[i][mask[i] > 0].double().tolist()
            tokens[bool(correct[i])].extend(values)
            per_question.setdefault((int(questions[i]), bool(correct[i])), []).extend(values)
    logs = [math.log(np.mean(per_question[(q, False)]) / np.mean(per_question[(q, True)]))
            for q in {q for q, _ in per_question} if (q, False) in per_question and (q, True) in per_question
            and per_question[(q, False)] and per_question[(q, True)]]
    return np.mean(tokens[False]), np.mean(tokens[True]), np.array(logs)


def test_windows_match_an_independent_recomputation(tiny_model_dir, memory_logger, tmp_path):
    capture = Capture()
    rcea = RCEADiagnostics(every_n_steps=3, retention_every_n_steps=3, probe_size=6, probe_samples=4,
                           plot_dir=str(tmp_path / "plots"))
    probe = EntropyChangeProbe()
    batch = frozen_rollout(tiny_model_dir)
    batch.correct = batch.rewards > 0.5  # every question has successes and failures: all are paired
    trainer(6, callbacks=[capture, rcea, probe], logger=memory_logger).fit(
        RLVRModule(model=tiny_model_dir, learning_rate=5e-3), fixed(batch))
    h = memory_logger.history
    assert set(h["rcea/ratio"]) == {2, 5}
    for window, step in ((capture.steps[:3], 2), (capture.steps[3:], 5)):
        failed, successful, logs = by_hand(window)
        assert h["rcea/failed_entropy"][step] == pytest.approx(failed, rel=1e-6)
        assert math.isfinite(successful)  # every question has successes (above)
        assert h["rcea/ratio"][step] == pytest.approx(failed / successful, rel=1e-6)
        assert h["rcea/paired_questions"][step] == len(logs) == 8
        assert h["rcea/paired_ratio"][step] == pytest.approx(math.exp(logs.mean()), rel=1e-6)
        higher = int((logs > 0).sum())
        assert h["rcea/sign_test_p"][step] == pytest.approx(sign_test_pvalue(higher, int((logs != 0).sum())))
    # Retention: the baseline is the policy before the first update; values are shares.
    assert set(h["rcea/retention"]) == {2, 5} and len(rcea.baseline_modes) == 6
    for step in (2, 5):
        value = h["rcea/retention"][step]
        assert math.isnan(value) or 0 <= value <= 1
        assert 0 <= h["rcea/probe_coverage"][step] <= 1
    assert sorted(os.listdir(tmp_path / "plots")) == ["entropy_change_predicted_vs_observed.png",
                                                      "rcea_entropy_by_stratum.png", "rcea_paired_ratio.png"]


def test_the_probe_does_not_change_the_training_run(tiny_model_dir, memory_logger):
    from lightning_rlvr.loggers import InMemoryLogger
    import lightning.pytorch as pl

    curves = []
    for callbacks in ([], [RCEADiagnostics(every_n_steps=2, retention_every_n_steps=2, probe_size=4, plots=False)]):
        pl.seed_everything(3, verbose=False)
        logger = InMemoryLogger()
        trainer(4, callbacks=callbacks, logger=logger).fit(RLVRModule(model=tiny_model_dir, learning_rate=5e-3),
                                                           reverse_data())
        curves.append(logger.history["reward/mean"])
    assert curves[0] == curves[1]


def test_plots_go_to_mlflow_as_artifacts(tiny_model_dir, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLFlowLogger(experiment_name="rcea", tracking_uri=uri, artifact_location=str(tmp_path / "artifacts"))
    rcea = RCEADiagnostics(every_n_steps=2, retention_every_n_steps=0)
    trainer(2, callbacks=[rcea], logger=logger).fit(RLVRModule(model=tiny_model_dir, learning_rate=5e-3),
                                                    reverse_data())
    names = [a.path for a in logger.experiment.list_artifacts(logger.run_id, "plots")]
    assert names == ["plots/rcea_entropy_by_stratum.png", "plots/rcea_paired_ratio.png"]
    assert rcea.written == []  # no folder given: MLflow only


def test_state_round_trip_and_arguments():
    rcea = RCEADiagnostics()
    rcea.baseline_modes, rcea.windows = [["12"], []], [{"step": 19.0, "ratio": 1.2}]
    other = RCEADiagnostics()
    other.load_state_dict(rcea.state_dict())
    assert other.baseline_modes == [["12"], []] and other.windows == rcea.windows
    for kwargs in ({"every_n_steps": 0}, {"confidence": 1.0}, {"probe_size": 0}, {"mode_similarity": 0},
                   {"tail_fractions": (0.0,)}):
        with pytest.raises(ValueError):
            RCEADiagnostics(**kwargs)


def test_question_ids_ignore_padding_and_are_equal_for_equal_prompts():
    from .helpers import rollout_batch

    batch = rollout_batch([0.0, 1.0, 0.0], [[1, 1], [1, 1], [1, 0]])
    batch.input_ids = torch.tensor([[0, 5, 6, 1, 2], [5, 6, 6, 3, 4], [0, 5, 6, 7, 8]])
    batch.attention_mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    batch.prompt_length = 3
    ids = question_ids(batch)
    assert ids[0] == ids[2] and ids[0] != ids[1]


def parity_verdict(completion: str, answer: str) -> float:
    """A verifier whose verdicts are mixed on a random policy's samples: correct when the character codes sum even."""
    return float(sum(map(ord, completion)) % 2 == 0)


def record_probe_batches(monkeypatch) -> list:
    """Every ``sample_batch`` of the fit, with its token entropies under the policy at that moment, computed
    independently from the logits (``torch.distributions``)."""
    from lightning_rlvr.data import RolloutDataModule

    probes = []
    sample_batch = RolloutDataModule.sample_batch

    def recording_sample_batch(self, problems, n):
        batch = sample_batch(self, problems, n)
        policy = self.trainer.lightning_module.policy
        with torch.no_grad():  # the policy as it is at the probe: entropy from its logits, independently
            logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                            position_ids=batch.position_ids).logits[:, batch.prompt_length - 1 : -1]
            entropy = torch.distributions.Categorical(logits=logits.float() / batch.temperature).entropy()
        probes.append((batch, entropy))
        return batch

    monkeypatch.setattr(RolloutDataModule, "sample_batch", recording_sample_batch)
    return probes


def scripted_endpoint_fit(model_dir: str, logger) -> None:
    """Four steps with endpoint probes at steps 1 and 3 (6 probe questions × 12 samples), on scripted completions
    that stop: "1", "11" and "111" score 0, "2" and "12" score 1 (a random policy never stops); a cycle of five over
    12 samples a question gives 4 or 5 successes, so a minimum of 5 pairs only some questions."""
    from lightning_rlvr.verifiers import CallableVerifier

    module = RLVRModule(model=model_dir, learning_rate=1e-3)
    tokenizer = module.tokenizer
    script = [tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
              for text in ("1", "2", "11", "12", "111")]
    rcea = RCEADiagnostics(every_n_steps=2, retention_every_n_steps=2, probe_size=6, probe_samples=2,
                           rarefaction_size=2, endpoint_samples=12, endpoint_min_per_stratum=5, plots=False)
    trainer(4, callbacks=[rcea], logger=logger).fit(
        module, reverse_data(engine=ScriptedEngine(script, pad_id=tokenizer.pad_token_id),
                             verifier=CallableVerifier(parity_verdict, isolation="inline")))


def test_the_endpoint_ratio_is_the_seeds_estimator_on_its_own_probe_samples(tiny_model_dir, memory_logger,
                                                                              monkeypatch):
    """K samples per probe question, their entropies under the policy at that checkpoint, and only the questions
    with at least ``endpoint_min_per_stratum`` responses in each outcome: recomputed here with torch.distributions."""
    probes = record_probe_batches(monkeypatch)
    scripted_endpoint_fit(tiny_model_dir, memory_logger)
    h = memory_logger.history
    assert sorted(h["rcea/endpoint_paired_ratio"]) == [1, 3] and len(probes) == 2
    for (batch, entropy), step in zip(probes, (1, 3)):
        assert len(batch) == 6 * 12
        logs = []
        for q in range(6):
            rows = range(12 * q, 12 * (q + 1))
            strata = {ok: [entropy[i][batch.response_mask[i] > 0].double() for i in rows
                           if bool(batch.correct[i]) == ok and batch.response_mask[i].sum() > 0] for ok in (False, True)}
            if min(len(strata[False]), len(strata[True])) >= 5:
                failed, successful = (torch.cat(strata[ok]).mean().item() for ok in (False, True))
                logs.append(math.log(failed / successful))
        assert 0 < len(logs) < 6, "all or no probe questions paired: the minimum would be untested"
        assert h["rcea/endpoint_paired_questions"][step] == len(logs)
        assert h["rcea/endpoint_coverage"][step] == pytest.approx(len(logs) / 6)
        assert h["rcea/endpoint_paired_ratio"][step] == pytest.approx(math.exp(np.mean(logs)), rel=1e-5)
        assert h["rcea/endpoint_ci_low"][step] <= h["rcea/endpoint_paired_ratio"][step] <= h["rcea/endpoint_ci_high"][step]
    with pytest.raises(ValueError, match="endpoint_samples needs retention_every_n_steps"):
        RCEADiagnostics(retention_every_n_steps=0, endpoint_samples=8)


# -- the rarefied effective-mode ratio ----------------------------------------------------------------------
def scripted_probe(monkeypatch, baseline, current):
    """Replace the probe's samples: per probe question (its index in the held-out list), ``baseline`` at the first
    call (the baseline probe), ``current`` afterwards; each is a list of ``(text, correct)``."""
    from lightning_rlvr.data import RolloutDataModule

    calls = []

    def sample_completions(self, problems, n):
        held = self.source.held_out_problems()
        script = baseline if not calls else current
        calls.append(len(problems))
        out = [script[held.index(p)] for p in problems]
        assert all(len(rows) == n for rows in out)
        return out

    monkeypatch.setattr(RolloutDataModule, "sample_completions", sample_completions)
    return calls


def samples(correct, n=5):
    return [(text, True) for text in correct] + [("wrong", False)] * (n - len(correct))


BASELINE = [samples(["1", "1", "1", "1"]),  # one mode: D = 1 in every draw of 3
            samples(["5", "6", "7", "8"]),  # all distinct: D = 3 in every draw of 3
            samples(["1", "2"]),            # fewer than 3 correct: left out
            samples(["1", "2", "3"]),       # exactly 3: D = 3
            samples([])]
CURRENT = [samples(["1", "2", "3"]),        # D = 3
           samples(["5", "5", "6"]),        # D = exp(-(2/3 log 2/3 + 1/3 log 1/3))
           samples(["1", "2", "3", "4", "5"]),
           samples(["1"]),                  # fewer than 3 correct now: left out
           samples(["9", "9", "9"])]        # none at the baseline: left out


def test_the_effective_mode_ratio_by_hand_can_exceed_one(tiny_model_dir, memory_logger, monkeypatch):
    calls = scripted_probe(monkeypatch, BASELINE, CURRENT)
    rcea = RCEADiagnostics(every_n_steps=2, retention_every_n_steps=2, probe_size=5, probe_samples=5,
                           rarefaction_size=3, rarefaction_draws=7, num_resamples=1000, plots=False)
    trainer(2, callbacks=[rcea], logger=memory_logger).fit(RLVRModule(model=tiny_model_dir, learning_rate=1e-3),
                                                           reverse_data())
    assert calls == [5, 5]  # the baseline and the probe at step 1
    h = memory_logger.history
    two_to_one = math.exp(-(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)))  # 1.8899
    # Questions 0 and 1 have >= 3 correct samples at both probes: (3 + 1.89) / (1 + 3) = 1.22 > 1.
    assert h["rcea/effective_mode_questions"][1] == 2
    assert h["rcea/effective_mode_ratio"][1] == pytest.approx((3 + two_to_one) / (1 + 3))
    # Bootstrap over two questions: a resample is both q0 (ratio 3), both q1 (1.89 / 3) or one of each (the
    # estimate), each pure case with probability 1/4, so the 2.5 % and 97.5 % quantiles are the pure cases.
    assert h["rcea/effective_mode_ratio_ci_low"][1] == pytest.approx(two_to_one / 3)
    assert h["rcea/effective_mode_ratio_ci_high"][1] == pytest.approx(3.0)
    # Answer-coverage retention of the same samples is at most 1: baseline modes 1 + 4 + 2 + 3 + 0 = 10, of which
    # still found 1 ("1") + 2 ("5", "6") + 2 ("1", "2") + 1 ("1") = 6.
    assert h["rcea/retention"][1] == pytest.approx(0.6)
    assert rcea.baseline_effective_modes[:2] == pytest.approx([1.0, 3.0])
    assert math.isnan(rcea.baseline_effective_modes[2]) and math.isnan(rcea.baseline_effective_modes[4])


def test_the_rarefaction_draws_are_frozen(tiny_model_dir, memory_logger, monkeypatch):
    """Questions whose rarefied count depends on the draws: two runs log the same values, and the baseline's state
    survives a checkpoint (an older one without it leaves the questions out instead of failing)."""
    baseline = [samples(["1", "1", "2", "3", "4"]), samples(["1", "2", "2", "3", "3"])]
    current = [samples(["1", "2", "2", "3"]), samples(["7", "7", "8", "9", "9"])]
    logged = []
    for _ in range(2):
        scripted_probe(monkeypatch, baseline, current)
        logger = type(memory_logger)()
        rcea = RCEADiagnostics(every_n_steps=2, retention_every_n_steps=2, probe_size=2, probe_samples=5,
                               rarefaction_size=3, plots=False)
        trainer(2, callbacks=[rcea], logger=logger).fit(RLVRModule(model=tiny_model_dir, learning_rate=1e-3),
                                                        reverse_data())
        logged.append(logger.history["rcea/effective_mode_ratio"][1])
    assert logged[0] == logged[1] and math.isfinite(logged[0])
    restored = RCEADiagnostics()
    restored.load_state_dict(rcea.state_dict())
    assert restored.baseline_effective_modes == rcea.baseline_effective_modes
    older = {k: v for k, v in rcea.state_dict().items() if k != "baseline_effective_modes"}
    restored.load_state_dict(older)
    assert restored.baseline_effective_modes is None


def test_rarefaction_arguments_are_checked():
    for kwargs, match in (({"rarefaction_size": 0}, "rarefaction_size >= 1"),
                          ({"rarefaction_draws": 0}, "rarefaction_draws >= 1"),
                          ({"rarefaction_size": 9, "probe_samples": 8}, "must be <= probe_samples")):
        with pytest.raises(ValueError, match=match):
            RCEADiagnostics(**kwargs)


# -- the per-question endpoint artifact ----------------------------------------------------------------------
def test_the_endpoint_artifact_reproduces_the_logged_ratio(tiny_model_dir, tmp_path, monkeypatch):
    """Rank 0 logs each probe's paired questions to MLflow: their mean log ratio is the logged geometric mean,
    their count the logged count, and each row's ``question`` is the probe index whose own samples give it."""
    import json

    from mlflow.tracking import MlflowClient

    from lightning_rlvr.loggers import endpoint_ratios_artifact

    probes = record_probe_batches(monkeypatch)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLFlowLogger(experiment_name="rcea", tracking_uri=uri, artifact_location=str(tmp_path / "artifacts"))
    scripted_endpoint_fit(tiny_model_dir, logger)
    client = MlflowClient(tracking_uri=uri)
    ratio = {m.step: m.value for m in client.get_metric_history(logger.run_id, "rcea/endpoint_paired_ratio")}
    count = {m.step: m.value for m in client.get_metric_history(logger.run_id, "rcea/endpoint_paired_questions")}
    assert sorted(ratio) == [1, 3] and len(probes) == 2
    for step, (batch, entropy) in zip((1, 3), probes):
        path = client.download_artifacts(logger.run_id, endpoint_ratios_artifact(step), str(tmp_path / f"s{step}"))
        with open(path) as f:
            raw = json.load(f)
        table = {column: [row[i] for row in raw["data"]] for i, column in enumerate(raw["columns"])}
        assert set(table) == {"question", "log_ratio", "failed", "successful"}
        assert 0 < len(table["question"]) == count[step] < 6
        assert ratio[step] == pytest.approx(math.exp(np.mean(table["log_ratio"])), rel=1e-6)
        assert len(set(table["question"])) == len(table["question"]) and set(table["question"]) <= set(range(6))
        for q, log_ratio, failed, successful in zip(*(table[c] for c in ("question", "log_ratio", "failed",
                                                                         "successful"))):
            # Rows 12q .. 12q + 11 of the probe batch are probe question q's samples.
            rows = range(12 * q, 12 * (q + 1))
            strata = {ok: [entropy[i][batch.response_mask[i] > 0].double() for i in rows
                           if bool(batch.correct[i]) == ok and batch.response_mask[i].sum() > 0]
                      for ok in (False, True)}
            assert (failed, successful) == (len(strata[False]), len(strata[True]))
            assert min(failed, successful) >= 5
            hand = math.log(torch.cat(strata[False]).mean().item() / torch.cat(strata[True]).mean().item())
            assert log_ratio == pytest.approx(hand, abs=2e-6)  # float32 entropies; the log ratios here are ~1e-3
        assert endpoint_ratios_artifact(step) == f"rcea/endpoint_step_{step:06d}.json"
