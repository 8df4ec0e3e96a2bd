"""The speed benchmarks start, run a minute-sized version of themselves and write their table (not their numbers:
speed is measured by running them, not in tests). TRL is not installed for the tests, so bench_step runs without
it here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # multi-process or subprocess runs (deselect with -m "not slow")

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str, tmp_path: Path) -> dict:
    out = tmp_path / "table.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "|---|" in done.stdout  # the Markdown table
    return json.loads(out.read_text())


def test_every_benchmark_explains_itself():
    from test_scripts import help_texts

    scripts = ["bench_step.py", "bench_logprobs.py", "bench_interventions.py", "bench_lora.py"]
    texts = help_texts([ROOT / "benchmarks" / script for script in scripts])
    assert len(texts) == len(scripts) and all("usage:" in text for text in texts.values()), texts


def test_bench_step_times_lightning_rlvr_against_the_bare_loop(tmp_path):
    # lag 1 through an engine process (its thread twin, lightning_rlvr_lag1, shares every other line of the script)
    table = run("bench_step.py", "--trainers", "lightning_rlvr", "lightning_rlvr_lag1_process", "bare", "--models", "tiny",
                "--new-tokens", "4", "--steps", "3", "--warmup", "1", "--rounds", "1", tmp_path=tmp_path)
    rows = {row["trainer"]: row for row in table["rows"]}
    assert set(rows) == {"lightning_rlvr", "lightning_rlvr_lag1_process", "bare"}
    assert all(row["steps_per_s"] > 0 for row in rows.values())
    assert rows["bare"]["vs_bare"] == pytest.approx(1.0) and rows["lightning_rlvr"]["vs_lag0"] == pytest.approx(1.0)
    assert rows["bare"]["vs_lag0"] is None


def test_bench_logprobs_compares_memory_and_time_with_the_naive_path(tmp_path):
    table = run("bench_logprobs.py", "--vocab", "2000", "--rows", "64", "--hidden-size", "16", "--methods", "naive",
                "fused", tmp_path=tmp_path)  # two processes per row (memory, time): chunked would add four
    methods = {(row["start"], row["grad"], row["method"]) for row in table["rows"]}
    assert ("hidden", True, "fused") in methods and ("logits", False, "naive") in methods
    assert ("logits", False, "fused") not in methods  # the fused path starts from hidden states
    assert all(row["seconds"] > 0 for row in table["rows"])


def test_bench_interventions_reports_each_row_against_grpo(tmp_path):
    table = run("bench_interventions.py", "--rows", "grpo", "ep_grpo", "--steps", "3", "--warmup", "1",
                "--rounds", "1", tmp_path=tmp_path)
    rows = {row["row"]: row for row in table["rows"]}
    assert rows["grpo"]["step_time_vs_grpo"] == pytest.approx(1.0)
    assert "ref_logprobs" in rows["ep_grpo"]["passes"]


def test_bench_lora_measures_memory_time_and_checkpoints_against_full_fine_tuning(tmp_path):
    pytest.importorskip("peft")
    table = run("bench_lora.py", "--model", "tiny", "--rows", "full_kl", "lora_kl", "--steps", "3", "--warmup", "1",
                tmp_path=tmp_path)
    full, lora = table["rows"]["full_kl"], table["rows"]["lora_kl"]
    assert full["reference_model"] and not lora["reference_model"]  # LoRA: the adapter off is the reference
    assert lora["parameter_bytes"] < full["parameter_bytes"] and lora["optimizer_bytes"] < full["optimizer_bytes"]
    assert lora["checkpoint_bytes"] < full["checkpoint_bytes"] and lora["steps_per_s"] > 0
