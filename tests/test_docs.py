"""The documentation is built, complete and true to the code.

- The site builds with ``mkdocs build --strict`` (a broken link, anchor or API reference fails), and its inventory
  lists every public name of the documented packages.
- Every metric a fit logs with every intervention is defined in the metrics reference or on its intervention's page.
- The tutorial's code runs as written, in order.
- Every shipped config opens with a comment saying what it is for and how long it takes on its hardware.
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import re
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOCUMENTED_PACKAGES = ["callbacks", "algorithms", "metrics", "verifiers", "data", "rollout", "training"]


def _public_names() -> set[str]:
    """``module.name`` of every name that a module of the documented packages lists in ``__all__`` and defines
    itself (a top-level ``def``, ``class`` or assignment; re-exports are documented where they are defined)."""
    names = set()
    for package_name in DOCUMENTED_PACKAGES:
        package = importlib.import_module(f"lightning_rlvr.{package_name}")
        for info in pkgutil.iter_modules(package.__path__):
            if info.name.startswith("_"):
                continue
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
            defined = set()
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    defined.add(node.name)
                elif isinstance(node, ast.Assign):
                    defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    defined.add(node.target.id)
            names |= {f"{module.__name__}.{name}" for name in getattr(module, "__all__", []) if name in defined}
    return names


def _inventory(site: Path) -> set[str]:
    """The object names of the site's Sphinx-format inventory (``objects.inv``, written by mkdocstrings)."""
    raw = (site / "objects.inv").read_bytes()
    body = raw.split(b"\n", 4)[4]  # four header lines, then zlib-compressed "name domain:role priority uri display"
    return {line.split(" ", 1)[0] for line in zlib.decompress(body).decode().splitlines() if line}


@pytest.mark.slow
def test_the_site_builds_strictly_and_its_api_reference_lists_every_public_name(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    missing = sorted(_public_names() - _inventory(site))
    assert not missing, f"not in the API reference: {missing}"
    intervention_pages = {p.stem for p in (DOCS / "interventions").glob("*.md")}
    assert {"clip_cov", "kl_cov", "steer", "opefo", "paec", "hapo", "ep_grpo", "gtpo", "stage_aware",
            "entropy_bonus", "adaptive_entropy", "top_entropy_tokens", "diagnostics"} <= intervention_pages


# ----------------------------------------------------------------------------------------------- metrics
def _documented_metric_patterns() -> list[re.Pattern]:
    """Backticked metric names in the first column of the tables of the metrics page and the intervention pages;
    ``<placeholder>`` parts match any text without a slash."""
    patterns = []
    for page in [DOCS / "metrics.md", *sorted((DOCS / "interventions").glob("*.md"))]:
        for line in page.read_text(encoding="utf-8").splitlines():
            first_cell = re.match(r"\|\s*`([a-z_<][a-z_<>]*/[^`]+)`", line)
            if first_cell:
                parts = re.split(r"(<[^>]+>)", first_cell.group(1))
                regex = "".join("[^/]+" if p.startswith("<") else re.escape(p) for p in parts)
                patterns.append(re.compile(regex + r"\Z"))
    return patterns


def _logged_metric_names() -> set[str]:
    """Two short fits that together run every intervention and diagnostic (one strictly on-policy, one with two
    updates per rollout and a KL term), with an in-memory logger."""
    import lightning.pytorch as pl

    from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
    from lightning_rlvr import callbacks as cb
    from lightning_rlvr.loggers import InMemoryLogger

    def fit(callbacks, **module_kwargs) -> set[str]:
        logger = InMemoryLogger()
        trainer = pl.Trainer(accelerator="cpu", max_steps=6, log_every_n_steps=1, callbacks=callbacks, logger=logger,
                             val_check_interval=3, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(RLVRModule(model="builtin:tiny", learning_rate=1e-3, **module_kwargs),
                    RolloutDataModule(source=BuiltinTask("addition"), prompts_per_step=4, group_size=4,
                                      val_samples=2, val_k=2, val_max_prompts=4))
        return set(logger.history)

    on_policy = [
        cb.OPEFO(), cb.STEER(), cb.HAPO(), cb.PAEC(), cb.EntropyBonus(coef=1e-3), cb.AdaptiveEntropy(target=0.3),
        cb.ClipCov(ratio=0.1, lower=0.0), cb.TopEntropyTokens(), cb.GTPO(), cb.EntropyChangeProbe(),
        cb.RCEADiagnostics(every_n_steps=2, retention_every_n_steps=3, probe_size=4, probe_samples=2, plots=False,
                           rarefaction_size=2, endpoint_samples=4, endpoint_min_per_stratum=1),
        cb.StageDetector(min_segment=2, patience=1), cb.PerplexityShaping(),
        cb.PositionShaping(active_steps=None, active_fraction=None, entropy_quantile=0.5), cb.EntropyPerformanceAnalysis(slope_window=2),
        cb.EPGRPO(), cb.PolarityFilter("negative"),
    ]
    two_updates = [cb.KLCov(ratio=0.1), cb.StageGated(cb.ClipCov(ratio=0.1, lower=0.0), active_in="always"),
                   cb.AdaptiveEntropy.aer()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fit(on_policy) | fit(two_updates, minibatch_size=8, kl_coef=0.01)


@pytest.mark.slow
def test_every_logged_metric_is_defined_in_the_docs():
    patterns = _documented_metric_patterns()
    logged = _logged_metric_names() - {"epoch"}  # Lightning's own
    assert len(logged) > 150
    undocumented = sorted(name for name in logged if not any(p.match(name) for p in patterns))
    assert not undocumented, f"logged but defined on no page: {undocumented}"


def test_a_placeholder_in_a_documented_name_matches_one_path_segment():
    patterns = [p for p in _documented_metric_patterns() if "[^/]+" in p.pattern]
    assert any(p.match("reward/correct") for p in patterns)
    assert not any(p.match("reward/a/b") for p in patterns)


# ----------------------------------------------------------------------------------------------- tutorial
@pytest.mark.slow
def test_the_tutorial_runs_as_written(tmp_path, monkeypatch, capsys):
    page = (DOCS / "interventions" / "write_your_own.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) == 3
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "tutorial"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile("\n".join(blocks), "write_your_own.md", "exec"), namespace)  # its asserts are the checks
    assert "failed_bonus/loss at the last step" in capsys.readouterr().out
    with pytest.raises(ValueError, match="coef must be > 0"):
        namespace["FailedEntropyBonus"](coef=0.0)


# ----------------------------------------------------------------------------------------------- configs
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
_DURATION = re.compile(r"\b\d+(\.\d+)?\s*(s|min|minutes|h|hours?)\b")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_config_opens_saying_what_it_is_for_and_how_long_it_takes(config):
    header = []
    for line in config.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    assert len(header) >= 2, "no opening comment block"
    runs = [line for line in header if line.startswith("# Runs:")]
    assert len(runs) == 1, "the opening comment has no '# Runs:' line (how long, on what hardware)"
    assert re.search(r"CPU|GPU", runs[0]), runs[0]
    assert _DURATION.search(runs[0]) or "not measured" in runs[0], runs[0]


def test_the_readmes_links_and_figure_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert "docs/quickstart.png" in local and "docs/interventions/clip_cov.md" in local
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"the README links to files that do not exist: {missing}"
