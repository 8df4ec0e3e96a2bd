"""The package's top level: its names resolve on first use, and the kernels import without the trainer."""

from __future__ import annotations

import subprocess
import sys

import pytest

import lightning_rlvr


def test_kernels_import_without_lightning_or_transformers():
    code = ("import sys, lightning_rlvr.ops; "
            "print(sorted(m for m in ('lightning', 'transformers', 'lightning_rlvr.module') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_top_level_names_are_the_classes_of_their_modules():
    from lightning_rlvr.data import RolloutDataModule
    from lightning_rlvr.module import RLVRModule

    assert lightning_rlvr.RLVRModule is RLVRModule and lightning_rlvr.RolloutDataModule is RolloutDataModule
    assert set(lightning_rlvr.__all__) <= set(dir(lightning_rlvr))
    with pytest.raises(AttributeError, match="no attribute 'RLVRModel'"):
        lightning_rlvr.RLVRModel  # noqa: B018


def test_the_vllm_extra_needs_a_vllm_whose_processed_logprobs_are_after_temperature():
    """Before vLLM 0.10.2 (vllm#22387) `processed_logprobs` were taken before temperature: not the trainer's."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    (requirement,) = [Requirement(r) for r in project["optional-dependencies"]["vllm"]]
    assert requirement.name == "vllm"
    assert not requirement.specifier.contains("0.10.1") and requirement.specifier.contains("0.10.2")


@pytest.mark.slow
def test_the_readmes_python_example_runs(tmp_path, monkeypatch):
    """The stacked-callbacks example on the landing page, two steps instead of 500."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert "max_steps=500" in code and "ClipCov" in code
    monkeypatch.chdir(tmp_path)  # Lightning writes its logs under the working directory
    exec(code.replace("max_steps=500", "max_steps=2, logger=False, enable_checkpointing=False"), {})
