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
