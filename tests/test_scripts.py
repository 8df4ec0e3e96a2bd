"""The scripts start and explain themselves; the GPU ones dry-run on the stand-ins (their real checks need a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


GPU_SCRIPTS = ["gpu_check_strategies.py", "gpu_smoke_vllm.py", "gpu_smoke_vllm_server.py"]


def help_texts(paths: list[Path]) -> dict[str, str]:
    """Each script's ``--help`` output, all run in one interpreter (each alone would import torch again)."""
    runner = (
        "import contextlib, io, json, os, runpy, sys\n"
        "texts = {}\n"
        "for path in sys.argv[1:]:\n"
        "    sys.path.insert(0, os.path.dirname(path))  # as running the script puts its directory first\n"
        "    sys.argv, out = [path, '--help'], io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "        runpy.run_path(path, run_name='__main__')\n"
        "    texts[path] = out.getvalue()\n"
        "print(json.dumps(texts))\n")
    done = subprocess.run([sys.executable, "-c", runner, *map(str, paths)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_gpu_scripts_print_their_usage():
    texts = help_texts([ROOT / "scripts" / script for script in GPU_SCRIPTS])
    assert len(texts) == len(GPU_SCRIPTS)
    for path, text in texts.items():
        assert "usage:" in text and "GPU" in text, path


@pytest.mark.slow
def test_the_vllm_smoke_script_runs_end_to_end_on_the_stand_in(tmp_path):
    """The GPU script's logic, dry-run on the CPU with the vLLM stand-in as `vllm` (the real run needs a GPU)."""
    runner = tmp_path / "run.py"
    runner.write_text(
        "import runpy, sys, types\n"
        f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
        "import fake_vllm\n"
        "vllm = types.ModuleType('vllm')\n"
        "vllm.LLM, vllm.SamplingParams = fake_vllm.FakeLLM, fake_vllm.SamplingParams\n"
        "sys.modules['vllm'] = vllm\n"
        f"sys.argv = ['gpu_smoke_vllm.py', '--chat', '--device', 'cpu']\n"
        f"runpy.run_path({str(ROOT / 'scripts' / 'gpu_smoke_vllm.py')!r}, run_name='__main__')\n")
    done = subprocess.run([sys.executable, str(runner)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(lines) == 7 and all(line.startswith("PASS") for line in lines), lines  # checks 1-4 and the verdict


@pytest.mark.slow
def test_the_vllm_server_smoke_script_runs_end_to_end_on_the_stand_in(tmp_path):
    """The GPU script's logic, dry-run on the CPU against the `vllm serve` stand-in, its weights over gloo."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_smoke_vllm_server.py"), "--chat", "--stand-in"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(lines) == 7 and all(line.startswith("PASS") for line in lines), lines  # checks 1-4 and the verdict


def test_the_quickstart_figure_is_drawn_from_the_runs_mlflow_record(tmp_path):
    import math

    from mlflow.tracking import MlflowClient

    from lightning_rlvr.plots import trailing_mean

    assert trailing_mean([1.0, math.nan, 3.0, 5.0], 2) == [1.0, 1.0, 2.0, 4.0]  # NaN steps are skipped
    assert trailing_mean([1.0, 2.0, 3.0, 4.0], 3) == [1.0, 1.5, 2.0, 3.0]  # a partial window at the start
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("quickstart"))
    for step in range(10):
        client.log_metric(run.info.run_id, "entropy/failed", 1.0 - step / 20, step=step)
        client.log_metric(run.info.run_id, "entropy/successful", 0.5 - step / 20, step=step)
    for step, accuracy in ((0, 0.05), (9, 0.8)):
        client.log_metric(run.info.run_id, "val/accuracy", accuracy, step=step)
    client.set_terminated(run.info.run_id)
    out = tmp_path / "figure.png"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "quickstart_figure.py"), "--tracking-uri", uri,
                           "--out", str(out), "--window", "3"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "10 steps, held-out accuracy 0.050 -> 0.800" in done.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run([sys.executable, str(ROOT / "scripts" / "quickstart_figure.py"), "--tracking-uri", uri,
                              "--experiment", "nope"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert missing.returncode != 0 and "no experiment 'nope'" in missing.stderr
