"""The study runner and report: config checks, a micro-study end to end against MLflow, resume, and the findings."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from lightning_rlvr.study import StudyConfigError, finished_runs, load_study, validate_runs
from lightning_rlvr.study import report as study_report
from lightning_rlvr.study import summaries as study_summaries
from lightning_rlvr.study.__main__ import main
from lightning_rlvr.study.config import config_overrides, merge_method
from lightning_rlvr.study.report import (
    FAR_ABOVE,
    MethodSummary,
    findings,
    polarity_change,
    pooled_paired_ratio,
    spearman_permutation,
    summarise_run,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "configs" / "study.yaml"


def shipped() -> dict:
    return yaml.safe_load(SHIPPED.read_text())


# -- the study file ---------------------------------------------------------------------------------------------
def test_shipped_study_has_every_method_of_the_issue_and_every_run_config_parses():
    study = load_study(SHIPPED)
    assert set(study.methods) == {"grpo", "dapo", "clip_cov", "clip_cov_reference", "kl_cov", "kl_cov_reference",
                                  "top_entropy_tokens", "adaptive_entropy", "gtpo", "gtpo_group", "ppl_shaping",
                                  "position_shaping", "stage_aware_stacked", "steer", "paec", "opefo",
                                  "opefo_two_minibatches", "hapo", "ep_grpo", "positive_only", "negative_only"}
    assert study.seeds == (0, 1, 2) and study.report.baseline == "grpo"
    validate_runs(study)  # every method through the lightning_rlvr parser


def test_merge_appends_method_callbacks_and_leaves_the_base_alone():
    base = shipped()["base"]
    before = json.dumps(base, sort_keys=True)
    merged = merge_method(base, {"model": {"learning_rate": 1e-3}, "data": {"dynamic_sampling": True},
                                 "trainer": {"callbacks": [{"class_path": "X"}]}})
    assert json.dumps(base, sort_keys=True) == before
    assert [c["class_path"] for c in merged["trainer"]["callbacks"]] == [
        c["class_path"] for c in base["trainer"]["callbacks"]] + ["X"]
    assert merged["model"]["learning_rate"] == 1e-3 and merged["model"]["clip_low"] == base["model"]["clip_low"]
    assert merged["data"]["dynamic_sampling"] is True and merged["data"]["group_size"] == base["data"]["group_size"]


def test_run_config_sets_seed_logger_and_a_hash_that_follows_the_method_settings():
    study = load_study(shipped())
    config = study.run_config("clip_cov", 2)
    assert config["seed_everything"] == 2
    tags = config["trainer"]["logger"]["init_args"]["tags"]
    assert tags == {"study": "entropy_study", "study.method": "clip_cov", "study.seed": "2",
                    "study.config_hash": study.config_hash("clip_cov")}
    edited = shipped()
    edited["methods"]["clip_cov"]["trainer"]["callbacks"][0]["init_args"]["ratio"] = 0.3
    other = load_study(edited)
    assert other.config_hash("clip_cov") != study.config_hash("clip_cov")
    assert other.config_hash("grpo") == study.config_hash("grpo")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda s: s.update(sedes=[0]), "unknown key(s) ['sedes']"),
    (lambda s: s.pop("methods"), "missing required key `methods`"),
    (lambda s: s.update(seeds=[0, 0]), "`seeds` must be a non-empty list of distinct integers"),
    (lambda s: s.update(workers=0), "`workers` must be an integer >= 1"),
    (lambda s: s["base"]["trainer"].update(logger=False), "base.trainer.logger is set by the study"),
    (lambda s: s["methods"]["dapo"].update(seed_everything=3), "methods.dapo: unknown section(s) ['seed_everything']"),
    (lambda s: s["methods"].update({"bad name": {}}), "method name 'bad name'"),
    (lambda s: s["report"].update(baseline="ppo"), "report.baseline names ['ppo']"),
    (lambda s: s["report"].update(late=3), "unknown report key(s) ['late']"),
])
def test_bad_study_files_fail_naming_the_key(edit, message):
    raw = shipped()
    edit(raw)
    with pytest.raises(StudyConfigError) as err:
        load_study(raw)
    assert message in str(err.value)


def test_a_bad_init_arg_fails_before_anything_trains_naming_the_method(tmp_path):
    raw = shipped()
    raw["methods"] = {"grpo": {}, "clip_cov": raw["methods"]["clip_cov"]}
    raw["report"]["entropy_keepers"] = ["clip_cov"]
    raw["methods"]["clip_cov"]["trainer"]["callbacks"][0]["init_args"]["ratoi"] = 0.1
    raw.update(output_dir=str(tmp_path / "out"), tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(StudyConfigError) as err:
        validate_runs(load_study(path))
    assert "method `clip_cov`" in str(err.value) and "ratoi" in str(err.value)
    assert main(["--config", str(path), "--no-progress"]) == 2
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()


# -- a micro-study, end to end -------------------------------------------------------------------------------------
def micro_study(tmp_path: Path, methods: dict) -> Path:
    raw = shipped()
    raw.update(name="micro", seeds=[0], workers=2, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
               output_dir=str(tmp_path / "out"), methods=methods)
    raw["report"].update(late_window=4, entropy_keepers=["clip_cov"])
    trainer = raw["base"]["trainer"]
    trainer.update(max_steps=24, val_check_interval=6)  # 12 rollout steps x 2 minibatches
    warm_start, rcea, probe, stage, analysis = trainer["callbacks"]
    warm_start["init_args"]["steps"] = 150  # enough that some answers are right: advantages, flows, changes
    rcea["init_args"].update(every_n_steps=4, retention_every_n_steps=6, num_resamples=50, probe_size=8)
    probe["init_args"].update(every_n_steps=2, window=3)
    stage["init_args"].update(min_segment=3, patience=1, min_drop=0.0)
    analysis["init_args"].update(every_n_steps=2, slope_window=3)
    raw["base"]["data"]["val_max_prompts"] = 24
    path = tmp_path / "micro.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def table_rows(report: str, table: int = 0) -> dict[str, list[str]]:
    """The rows of the report's ``table``-th method table (0: the main table, 1: finding (e)'s fits), by method."""
    tables = report.split("| method |")[1:]
    lines = []
    for line in tables[table].splitlines()[1:]:  # up to the end of that table
        if not line.startswith("|"):
            break
        if line.startswith("| "):
            lines.append(line)
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}


@pytest.mark.slow
def test_micro_study_report_matches_the_mlflow_runs_and_a_rerun_skips_them(tmp_path, capsys):
    methods = shipped()["methods"]
    broken = {"trainer": {"callbacks": [{"class_path": "lightning_rlvr.callbacks.ClipCov",
                                          "init_args": {"ratio": -1.0}}]}}  # parses, refused at construction
    path = micro_study(tmp_path, {"grpo": {}, "clip_cov": methods["clip_cov"], "broken": broken})
    assert main(["--config", str(path), "--no-progress"]) == 1  # one run failed, the others finished
    err = capsys.readouterr().err
    assert "run broken-seed0 failed" in err and "ratio" in err  # the log tail names the constructor's complaint

    study = load_study(path)
    client = MlflowClient(tracking_uri=study.tracking_uri)
    experiment = client.get_experiment_by_name("micro")
    runs = {r.data.tags["study.method"]: r for r in client.search_runs([experiment.experiment_id])
            if "study.method" in r.data.tags}
    assert runs["grpo"].info.status == runs["clip_cov"].info.status == "FINISHED"
    assert "broken" not in runs  # refused while the CLI built it, before the logger opened an MLflow run

    out = Path(study.output_dir)
    summary = json.loads((out / "summary.json").read_text())
    report = (out / "report.md").read_text()
    rows = table_rows(report)
    assert set(summary["methods"]) == {"grpo", "clip_cov"} and summary["missing_runs"] == ["broken-seed0"]
    fits = table_rows(report, 1)  # finding (e): one fit per method, on its evaluations
    assert set(fits) == {"grpo", "clip_cov"}
    for method in ("grpo", "clip_cov"):
        run_id = runs[method].info.run_id

        def history(key, run_id=run_id):
            return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))

        entropy = history("entropy/token_mean")
        assert [s for s, _ in entropy] == list(range(12))
        expected = {
            "accuracy": history("val/accuracy")[-1][1],
            "pass_at_k": history("val/pass_at_k")[-1][1],
            "final_entropy": statistics.fmean(v for _, v in entropy[-4:]),
            # the endpoint estimator wherever the run probed it (NaN if no probe question had 8 of each outcome)
            "paired_ratio": (history("rcea/endpoint_paired_ratio") or history("rcea/paired_ratio"))[-1][1],
        }
        got = summary["methods"][method]["runs"][0]
        assert got["run_id"] == run_id
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-9, nan_ok=True), key
        assert int(fits[method][-1]) == len(history("val/accuracy"))  # one point per evaluation
        # The Markdown table shows the same numbers (one seed: sd 0).
        assert rows[method][1] == f"{expected['accuracy']:.3f} ± 0.000"
        assert rows[method][6] == f"{expected['final_entropy']:.3f} ± 0.000"
        observed = [v for _, v in history("probe/observed")]
        flow = [v for _, v in history("probe/flow_pred")]
        assert len(observed) == 6 and any(f != 0 for f in flow)  # the runs learned: a real comparison
        agreement = sum(math.copysign(1, f) * (f != 0) == math.copysign(1, o) * (o != 0)  # a zero matches a zero
                        for f, o in zip(flow, observed)) / len(observed)
        assert got["sign_agreement_flow"] == pytest.approx(agreement)
    for name in ("trajectories.png", "entropy_change.png", "paired_ratio.png"):
        assert (out / name).stat().st_size > 10_000
    report_runs = client.search_runs([experiment.experiment_id], filter_string="tags.`study.report` = 'micro'")
    assert len(report_runs) == 1
    assert {a.path for a in client.list_artifacts(report_runs[0].info.run_id)} >= {"report.md", "summary.json",
                                                                                     "trajectories.png"}

    # Rerun: the two finished runs are skipped, only the broken one is tried again; the report is rebuilt in place.
    count = len(client.search_runs([experiment.experiment_id]))
    assert main(["--config", str(path), "--no-progress"]) == 1
    assert "0 run(s) trained, 2 already finished, 1 failed" in capsys.readouterr().out
    assert len(client.search_runs([experiment.experiment_id])) == count  # nothing new reached MLflow
    assert len(client.search_runs([experiment.experiment_id], filter_string="tags.`study.report` = 'micro'")) == 1

    # Editing a method's settings makes its finished run stale; the others stay finished.
    raw = yaml.safe_load(path.read_text())
    raw["methods"]["clip_cov"]["trainer"]["callbacks"][0]["init_args"]["ratio"] = 0.3
    assert set(finished_runs(load_study(raw))) == {("grpo", 0)}


# -- per-run numbers and the findings, against hand computations --------------------------------------------------
def fake_history(entropy_level, accuracy, ratio=(1.3, 1.1, 1.5), probe=((0.1, 0.2, -0.5), (-0.1, 0.3, 0.2))):
    steps = range(200)
    return {
        "entropy/token_mean": [(s, entropy_level + (0.5 if s < 150 else 0.001 * (s - 150))) for s in steps],
        "val/accuracy": [(0, 0.1), (100, 0.5), (199, accuracy)],
        "rcea/paired_ratio": [(99, 0.9), (199, ratio[0])],
        "rcea/paired_ci_low": [(99, 0.8), (199, ratio[1])],
        "rcea/paired_ci_high": [(99, 0.95), (199, ratio[2])],
        "probe/cov_pred": [(s, c) for s, (c, _, _) in enumerate(probe)],
        "probe/flow_pred": [(s, f) for s, (_, f, _) in enumerate(probe)],
        "probe/observed": [(s, o) for s, (_, _, o) in enumerate(probe)],
        "stage/transition_step": [(150, math.nan), (199, 120.0)],
    }


def fake_run(method, seed, entropy_level, accuracy, **kwargs):
    return summarise_run(method, seed, f"{method}{seed}", fake_history(entropy_level, accuracy, **kwargs),
                         late_window=50)


def test_summarise_run_against_hand_computed_numbers():
    run = fake_run("grpo", 0, 0.2, 0.7)
    assert run.final_entropy == pytest.approx(statistics.fmean(0.2 + 0.001 * s for s in range(50)))
    assert run.accuracy == 0.7 and math.isnan(run.pass_at_k) and run.transition_step == 120.0
    assert (run.windows, run.windows_above_one, run.windows_below_one) == (2, 1, 1)
    # predicted -cov = (-0.1, 0.1) vs observed (-0.5, 0.2): both signs match; flow (0.2, 0.3): one of two.
    assert run.sign_agreement_cov == 1.0 and run.sign_agreement_flow == 0.5 and run.majority_rate == 0.5
    # both probed steps (0 and 1) fall in the first 100-step block: (−cov, flow, observed) summed
    assert run.probe_blocks == [pytest.approx((0.0, 0.5, -0.3))]
    by_step = summarise_run("grpo", 0, "x", fake_history(0.2, 0.7), 50, block=1)
    assert by_step.probe_blocks == [pytest.approx(p) for p in by_step.probe]


def test_findings_apply_their_stated_rules():
    study = load_study({**shipped(), "report": {"baseline": "grpo", "entropy_keepers": ["clip_cov"]}})
    grpo = [fake_run("grpo", s, 0.1, 0.6 + 0.01 * s) for s in range(3)]
    keeper_far = [fake_run("clip_cov", s, 0.1 * FAR_ABOVE * 1.5, 0.65) for s in range(3)]
    methods = {"grpo": MethodSummary.of("grpo", grpo), "clip_cov": MethodSummary.of("clip_cov", keeper_far),
               "gtpo": MethodSummary.of("gtpo", [fake_run("gtpo", 0, 0.3, 0.5, ratio=(1.1, 0.9, 1.3))])}
    result = findings(study, methods)
    assert result["a"]["verdict"] == "reproduced"
    assert (result["a"]["windows"], result["a"]["windows_above"], result["a"]["windows_below"]) == (14, 6, 7)
    assert result["b"]["agreement_cov"] == 1.0 and result["b"]["majority_rate"] == 0.5
    assert result["b"]["verdict"] == "partly"  # flow's 0.5 does not beat the majority forecast's 0.5
    # flow predicts "rise" at every step: right on every rise, wrong on every fall -> balanced 0.5
    assert (result["b"]["balanced_cov"], result["b"]["balanced_flow"]) == (1.0, 0.5)
    # one block per run, summed (0.0, 0.5, -0.3): a zero and a rise against a fall
    assert (result["b"]["blocks"], result["b"]["block_agreement_cov"], result["b"]["block_agreement_flow"],
            result["b"]["block_majority_rate"]) == (7, 0.0, 0.0, 1.0)
    assert result["b"]["correlation_cov"] == pytest.approx(1.0)
    # seven identical blocks: no variance, so no block correlation (NaN, shown as "–"), never a spurious number
    assert all(math.isnan(result["b"][f"block_{kind}_{p}"]) for kind in ("pearson", "spearman") for p in ("cov", "flow"))
    assert result["c"]["verdict"] == "reproduced"
    # keeper only slightly above GRPO in every seed: "partly"; below in one seed: "not reproduced"
    methods["clip_cov"] = MethodSummary.of("clip_cov", [fake_run("clip_cov", s, 0.12, 0.6) for s in range(3)])
    assert findings(study, methods)["c"]["verdict"] == "partly"
    methods["clip_cov"] = MethodSummary.of("clip_cov", [fake_run("clip_cov", s, 0.12 if s else 0.05, 0.6)
                                                        for s in range(3)])
    assert findings(study, methods)["c"]["verdict"] == "not reproduced"
    grpo[1] = fake_run("grpo", 1, 0.1, 0.6, ratio=(1.1, 0.95, 1.2))
    methods["grpo"] = MethodSummary.of("grpo", grpo)
    assert findings(study, methods)["a"]["verdict"] == "partly"


def test_balanced_sign_agreement_scores_a_constant_forecast_one_half_and_correlation_matches_numpy():
    rng = np.random.default_rng(0)
    observed = rng.normal(-0.5, 1.0, 400)  # mostly falls
    assert study_summaries._balanced_sign_agreement(np.full(400, -1.0), observed) == 0.5
    assert study_summaries._balanced_sign_agreement(observed, observed) == 1.0
    noisy = observed + rng.normal(0, 1.0, 400)
    rises = observed > 0
    expected = ((noisy[rises] > 0).mean() + (noisy[~rises] <= 0).mean()) / 2
    assert study_summaries._balanced_sign_agreement(noisy, observed) == pytest.approx(expected)
    assert study_summaries._correlation(noisy, observed) == pytest.approx(np.corrcoef(noisy, observed)[0, 1])


def test_spearman_against_the_rank_difference_formula_and_exact_permutations():
    x, y = [0.3, 0.1, 0.5, 0.2, 0.4], [0.6, 0.7, 0.2, 0.9, 0.1]
    rho, p = spearman_permutation(x, y, resamples=20_000)
    rank = lambda v: [sorted(v).index(e) for e in v]
    d2 = sum((a - b) ** 2 for a, b in zip(rank(x), rank(y)))
    assert rho == pytest.approx(1 - 6 * d2 / (5 * (25 - 1)))
    # exact two-sided p over all 120 orderings of y's ranks
    extreme = sum(abs(1 - 6 * sum((a - b) ** 2 for a, b in zip(rank(x), perm)) / 120) >= abs(rho) - 1e-12
                  for perm in itertools.permutations(range(5)))
    assert p == pytest.approx(extreme / 120, abs=0.015)


def test_the_entropy_performance_points_and_opefo_lambda_of_a_run():
    history = fake_history(0.2, 0.7)
    history["opefo/lambda"] = [(0, 0.5), (1, 0.3), (2, math.nan)]
    run = summarise_run("opefo", 0, "x", history, late_window=50)
    entropy = dict(history["entropy/token_mean"])
    # each evaluation against the mean entropy of the 50 steps up to it (step 0: the first step's)
    expected = [(entropy[0], 0.1), (statistics.fmean(entropy[s] for s in range(51, 101)), 0.5),
                (statistics.fmean(entropy[s] for s in range(150, 200)), 0.7)]
    assert run.tradeoff_points == [pytest.approx(p) for p in expected]
    assert run.opefo_lambda == pytest.approx(0.4) and math.isnan(fake_run("grpo", 0, 0.2, 0.7).opefo_lambda)


def curve_run(method, seed, a, b, entropies):
    """A run whose evaluations lie exactly on R = −a·exp(H) + b, one per 100 steps at constant entropy."""
    steps = 100 * len(entropies)
    history = fake_history(0.2, 0.7)
    history["entropy/token_mean"] = [(s, entropies[s // 100]) for s in range(steps)]
    history["val/accuracy"] = [(100 * i + 99, -a * math.exp(h) + b) for i, h in enumerate(entropies)]
    return summarise_run(method, seed, f"{method}{seed}", history, late_window=50)


def test_finding_e_fits_r_equals_minus_a_exp_h_plus_b_and_applies_its_rule():
    study = load_study({**shipped(), "report": {"baseline": "grpo", "entropy_keepers": ["clip_cov"]}})
    grpo = [curve_run("grpo", s, 0.3, 1.1, [0.9 - 0.2 * i - 0.05 * s for i in range(4)]) for s in range(3)]
    rising = [curve_run("clip_cov", 0, -0.2, 0.2, [0.2, 0.4, 0.6])]  # accuracy rises with entropy: a < 0
    methods = {"grpo": MethodSummary.of("grpo", grpo), "clip_cov": MethodSummary.of("clip_cov", rising)}
    result = findings(study, methods)["e"]
    assert result["verdict"] == "reproduced"
    assert (result["fits"]["grpo"]["a"], result["fits"]["grpo"]["b"], result["fits"]["grpo"]["r2"],
            result["fits"]["grpo"]["n"]) == pytest.approx((0.3, 1.1, 1.0, 12))
    assert result["fits"]["clip_cov"]["a"] == pytest.approx(-0.2)
    table = study_report.tradeoff_table(result)
    assert "| grpo | 0.300 | 1.100 | 1.00 | 0.800 | 12 |" in table
    methods["grpo"] = MethodSummary.of("grpo", rising)
    assert findings(study, methods)["e"]["verdict"] == "not reproduced"


def test_finding_d_is_never_reproduced_by_a_large_p_and_reports_rho_without_broken_methods():
    study = load_study({**shipped(), "report": {"baseline": "grpo", "entropy_keepers": ["clip_cov"]}})
    # accuracy falls with entropy over four working methods; a fifth broke down (accuracy < half of grpo's)
    levels = {"grpo": (0.1, 0.60), "clip_cov": (0.2, 0.55), "kl_cov": (0.3, 0.50), "gtpo": (0.4, 0.45),
              "top_entropy_tokens": (0.9, 0.10)}
    methods = {m: MethodSummary.of(m, [fake_run(m, 0, h, acc)]) for m, (h, acc) in levels.items()}
    result = findings(study, methods)["d"]
    assert result["left_out"] == ["top_entropy_tokens"] and result["rho_without_left_out"] == pytest.approx(-1.0)
    assert result["rho"] == pytest.approx(-1.0) and result["verdict"] in ("no relation detected", "not reproduced")
    assert result["verdict"] != "reproduced"
    assert result["rho_ci_low"] <= result["rho"] <= result["rho_ci_high"]
    expected = "no relation detected" if result["p"] >= 0.05 else "not reproduced"
    assert result["verdict"] == expected


# -- where a study's run differs from the method's own config -----------------------------------------------------
def test_config_overrides_fill_in_defaults_and_compare_callbacks_by_class():
    own = {"model": {"clip_high": 0.28, "learning_rate": 3e-4},
           "trainer": {"max_steps": 100, "log_every_n_steps": 5,
                       "callbacks": [{"class_path": "lightning_rlvr.callbacks.ClipCov", "init_args": {"ratio": 0.4}},
                                     {"class_path": "lightning_rlvr.callbacks.HAPO"}]}}
    run = {"model": {"clip_high": 0.2, "clip_low": 0.2, "learning_rate": 3e-4},  # clip_low 0.2 is the default
           "data": {"val_samples": 2},                                            # evaluation only
           "trainer": {"max_steps": 100, "log_every_n_steps": 1,
                       "callbacks": [{"class_path": "lightning_rlvr.callbacks.ClipCov",
                                      "init_args": {"ratio": 0.4, "lower": 1.0, "upper": 4.0}},  # lower 1.0: default
                                     {"class_path": "lightning_rlvr.callbacks.RCEADiagnostics"},
                                     {"class_path": "lightning_rlvr.callbacks.GTPO"}]}}
    assert config_overrides(own, run, shared_callbacks=("RCEADiagnostics",)) == [
        "model.clip_high: 0.28 → 0.2", "ClipCov.upper: 5.0 → 4.0", "without HAPO", "with GTPO"]
    assert config_overrides(own, own) == []


def test_the_shipped_studys_overrides_against_the_configs_it_reads():
    study = load_study(ROOT / "configs/study.yaml")
    assert study.report.method_configs == "configs"
    overrides = study_report.method_overrides(study)
    assert overrides["grpo"] is None  # no configs/grpo.yaml
    for method in ("steer", "gtpo", "top_entropy_tokens", "clip_cov", "kl_cov"):
        own = yaml.safe_load((ROOT / f"configs/{method}.yaml").read_text())
        # the study runs each method's own clip settings; its length is the study's, and the column says so
        assert not any(o.startswith(("model.clip_", "model.dual_clip")) for o in overrides[method]), method
        assert f"trainer.max_steps: {own['trainer']['max_steps']} → 1600" in overrides[method]
    # a variant is compared with the config it varies, and its differences are the variant's
    assert overrides["opefo_two_minibatches"][0] == "vs opefo.yaml:"
    assert "OPEFO.strict_on_policy: true → false" in overrides["opefo_two_minibatches"]
    assert "OPEFO.strict_on_policy: true → false" not in overrides["opefo"]  # the paper's: strictly on-policy
    assert {"ClipCov.ratio: 0.4 → 0.0002", "model.clip_low: 0.2 → 1.0"} <= set(overrides["clip_cov_reference"])
    assert not any(o.startswith("ClipCov.") for o in overrides["clip_cov"])  # the same Clip-Cov arguments
    table = study_report.markdown_table(study, {})
    assert table.splitlines()[0].endswith("| differs from configs/<method>.yaml |")


def test_config_overrides_compare_plain_nested_settings_key_by_key():
    own = {"model": {"tiny_model": {"hidden_size": 32, "layers": 2}}}
    run = {"model": {"tiny_model": {"hidden_size": 64, "layers": 2}}}
    assert config_overrides(own, run) == ["model.tiny_model.hidden_size: 32 → 64"]


def test_the_endpoint_paired_ratio_is_preferred_when_the_run_logged_it():
    history = fake_history(0.2, 0.7)
    rolling = summarise_run("grpo", 0, "x", history, late_window=50)
    assert rolling.paired_estimator == "rolling" and rolling.paired_ratio == 1.3 == rolling.rolling_paired_ratio
    history.update({"rcea/endpoint_paired_ratio": [(99, 1.2), (199, 1.05)], "rcea/endpoint_ci_low": [(199, 0.97)],
                    "rcea/endpoint_ci_high": [(199, 1.14)], "rcea/endpoint_coverage": [(199, 0.25)]})
    run = summarise_run("grpo", 0, "x", history, late_window=50)
    assert (run.paired_estimator, run.paired_ratio, run.paired_ci_low, run.paired_ci_high) == ("endpoint", 1.05,
                                                                                                0.97, 1.14)
    assert run.rolling_paired_ratio == 1.3 and run.endpoint_coverage == 0.25
    assert (run.windows, run.windows_above_one) == (rolling.windows, rolling.windows_above_one)  # rolling windows
    history["rcea/endpoint_paired_ratio"] = [(199, math.nan)]  # a collapsed policy: no question paired at the probe
    unpaired = summarise_run("grpo", 0, "x", history, late_window=50)
    assert unpaired.paired_estimator == "endpoint" and math.isnan(unpaired.paired_ratio)


def test_pooled_paired_ratio_is_the_geometric_mean_of_all_rows_with_a_question_cluster_bootstrap():
    rows = [(0, 0.2), (1, -0.1), (2, 0.4), (0, 0.3), (2, 0.1)]  # questions 0 and 2 paired in two seeds
    pooled = pooled_paired_ratio(rows, num_resamples=200)
    assert pooled["ratio"] == pytest.approx(math.exp((0.2 - 0.1 + 0.4 + 0.3 + 0.1) / 5))
    assert (pooled["questions"], pooled["rows"]) == (3, 5)
    assert pooled["ci_low"] <= pooled["ratio"] <= pooled["ci_high"]
    # Three seeds that paired the same questions with the same ratios carry no more information than one: resampling
    # questions (clusters) gives one seed's interval, where resampling rows would shrink it by about √3.
    gen = torch.Generator().manual_seed(1)
    one_seed = [(q, v) for q, v in enumerate((0.3 * torch.randn(60, generator=gen)).tolist())]
    width = {name: math.log(p["ci_high"]) - math.log(p["ci_low"])
             for name, p in (("one", pooled_paired_ratio(one_seed, num_resamples=4000)),
                             ("three", pooled_paired_ratio(one_seed * 3, num_resamples=4000)),
                             ("rows", pooled_paired_ratio([(i, v) for i, (_, v) in enumerate(one_seed * 3)],
                                                          num_resamples=4000)))}
    assert width["three"] == pytest.approx(width["one"], rel=0.1)
    assert width["rows"] == pytest.approx(width["one"] / math.sqrt(3), rel=0.15)
    assert math.isnan(pooled_paired_ratio([])["ratio"])


def test_polarity_change_compares_per_token_means_split_at_the_transition():
    history = {"analysis/delta_entropy/negative": [(0, -0.004), (10, -0.002), (20, -0.001), (30, math.nan)],
               "analysis/delta_entropy/positive": [(0, -0.001), (10, -0.001), (20, -0.003), (30, -0.001)],
               "analysis/delta_entropy/negative_contribution": [(0, -0.001), (10, -0.0005), (20, -0.0002)],
               "analysis/delta_entropy/positive_contribution": [(0, -0.0008), (10, -0.0008), (20, -0.0024)]}
    change = polarity_change(history, 20.0)
    assert change["rising/failed"] == pytest.approx(-0.003) and change["rising/successful"] == pytest.approx(-0.001)
    assert change["rising/steps"] == 2 and change["plateau/steps"] == 2
    assert change["plateau/failed"] == pytest.approx(-0.001) and change["plateau/successful"] == pytest.approx(-0.002)
    assert change["rising/failed_contribution"] == pytest.approx(-0.00075)
    whole = polarity_change(history, math.nan)  # no plateau detected: the whole run is the rising stage
    assert whole["rising/steps"] == 4 and whole["plateau/steps"] == 0 and math.isnan(whole["plateau/failed"])
    # (f): failed falls more per token in the rising stage of every baseline seed -> reproduced; in one of two -> partly
    study = load_study({**shipped(), "report": {"baseline": "grpo", "entropy_keepers": ["clip_cov"]}})
    runs = [fake_run("grpo", s, 0.2, 0.7) for s in range(2)]
    for run in runs:
        run.polarity_change = change
    methods = {"grpo": MethodSummary.of("grpo", runs)}
    assert findings(study, methods)["f"]["verdict"] == "reproduced"
    runs[1].polarity_change = polarity_change({**history, "analysis/delta_entropy/negative": [(0, 0.0), (10, 0.0)]},
                                              20.0)
    assert findings(study, {"grpo": MethodSummary.of("grpo", runs)})["f"]["verdict"] == "partly"
