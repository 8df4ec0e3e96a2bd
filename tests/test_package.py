"""The package's top level: its names resolve on first use, and the kernels import without the trainer."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_rlvr


def test_kernels_import_without_lightning_or_transformers():
    code = ("import sys, lightning_rlvr.ops; "
            "print(sorted(m for m in ('lightning', 'transformers', 'lightning_rlvr.module') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_an_engine_process_and_the_command_line_start_without_lightning_or_transformers():
    """``ProcessEngine``'s decoding process imports its module; ``lightning_rlvr prepare-model`` and ``export`` import
    the command line: neither should pay for Lightning (~5 s) before it needs it."""
    code = ("import sys, lightning_rlvr.rollout.process, lightning_rlvr.cli; "
            "print(sorted(m for m in ('lightning', 'transformers', 'lightning_rlvr.module') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def module_imports() -> dict[str, set[str]]:
    """Each module of the package and the package modules it imports when it is imported (module level, outside
    ``if TYPE_CHECKING``; an import inside a function runs only when it is called)."""
    root = Path(lightning_rlvr.__file__).parent
    names = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}

    def module_of(name: str) -> str | None:
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        imported: set[str | None] = set()
        for statement in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
                continue
            for node in ast.walk(statement) if isinstance(statement, (ast.If, ast.Try)) else [statement]:
                if isinstance(node, ast.Import):
                    imported |= {module_of(a.name) for a in node.names if a.name.startswith("lightning_rlvr")}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(
                        "lightning_rlvr"):
                    imported |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names
                                 else module_of(node.module) for a in node.names}
        graph[name] = imported - {None, name}
    return graph


def test_the_import_graph_has_no_cycle():
    """Every import points downward: a topological order of the package's modules exists."""
    graph = module_imports()
    assert {"lightning_rlvr.module", "lightning_rlvr.training.update", "lightning_rlvr.data.datamodule"} <= set(graph)
    assert "lightning_rlvr.training.update" in graph["lightning_rlvr.module"]
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError, naming the cycle
    assert set(order) >= set(graph)


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
