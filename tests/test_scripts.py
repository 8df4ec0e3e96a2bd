"""The GPU scripts start and explain themselves on a machine without a GPU (their checks need one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["gpu_check_strategies.py", "gpu_smoke_vllm.py"])
def test_gpu_script_prints_its_usage(script):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout and "GPU" in done.stdout


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
