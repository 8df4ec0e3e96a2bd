"""The scripts start and explain themselves; the GPU ones dry-run on the stand-ins (their real checks need a GPU)."""

from __future__ import annotations

import contextlib
import io
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


GPU_SCRIPTS = ["gpu_check_strategies.py", "gpu_smoke_vllm.py", "gpu_smoke_vllm_server.py"]


def run_script(path: Path, *args: str) -> tuple[int, str]:
    """``python path args`` in this interpreter (a subprocess would import torch again, ~5 s): the exit code and what
    it printed."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.parent))  # as running the script puts its directory first
    out, code = io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return code, out.getvalue()


def help_texts(paths: list[Path]) -> dict[str, str]:
    """Each script's ``--help`` output."""
    texts = {}
    for path in paths:
        code, texts[str(path)] = run_script(path, "--help")
        assert code == 0, path
    return texts


def test_gpu_scripts_print_their_usage():
    texts = help_texts([ROOT / "scripts" / script for script in GPU_SCRIPTS])
    assert len(texts) == len(GPU_SCRIPTS)
    for path, text in texts.items():
        assert "usage:" in text and "GPU" in text, path


@pytest.mark.slow
def test_the_vllm_smoke_script_runs_end_to_end_on_the_stand_in(monkeypatch):
    """The GPU script's logic, dry-run on the CPU with the vLLM stand-in as `vllm` (the real run needs a GPU)."""
    from tests.fake_vllm import install

    install(monkeypatch)
    code, out = run_script(ROOT / "scripts" / "gpu_smoke_vllm.py", "--chat", "--device", "cpu")
    lines = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert code == 0, out[-2000:]
    assert len(lines) == 7 and all(line.startswith("PASS") for line in lines), lines  # checks 1-4 and the verdict


@pytest.mark.slow
def test_the_vllm_server_smoke_script_runs_end_to_end_on_the_stand_in(tmp_path, monkeypatch):
    """The GPU script's logic, dry-run on the CPU against the `vllm serve` stand-in, its weights over gloo."""
    monkeypatch.chdir(tmp_path)
    code, out = run_script(ROOT / "scripts" / "gpu_smoke_vllm_server.py", "--chat", "--stand-in")
    lines = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert code == 0, out[-2000:]
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
