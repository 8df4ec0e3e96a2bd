"""The study file: a base ``fit`` config, methods that override it, seeds, and where the runs and report go.

A study YAML has these keys (anything else is refused by name)::

    name: entropy_study             # MLflow experiment (unless ``experiment`` is given) and the runs' tag
    tracking_uri: sqlite:///mlflow.db
    output_dir: study/entropy_study # per-run configs (runs/), logs (logs/), the report
    seeds: [0, 1, 2]
    workers: 2                      # runs at once, each in its own process
    threads_per_run: 1              # OMP/torch threads of each run
    report: {baseline: grpo, late_window: 100, block: 100, entropy_keepers: [clip_cov, kl_cov],
             method_configs: configs}  # each method's own config: <method_configs>/<method>.yaml
    base: {trainer: ..., model: ..., data: ...}   # a `lightning_rlvr fit` config
    methods:
      grpo: {}
      clip_cov: {trainer: {callbacks: [{class_path: lightning_rlvr.callbacks.ClipCov, init_args: {...}}]}}

A run's config is ``base`` with the method's keys merged in: dicts merge key by key, a method's
``trainer.callbacks`` are *appended* to the base's (so diagnostics in the base observe every method), any
other value replaces the base's. The study then sets ``seed_everything`` and ``trainer.logger`` (an
``MLFlowLogger`` with the run's name and the tags ``study``, ``study.method``, ``study.seed``,
``study.config_hash``), so neither may appear in ``base`` or a method.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import inspect
import json
import re
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ReportSettings", "StudyConfig", "StudyConfigError", "callback_arguments", "config_overrides", "load_study",
           "merge_method"]

_METHOD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_FIT_SECTIONS = {"trainer", "model", "data", "optimizer", "lr_scheduler", "ckpt_path"}
_OWNED_BY_STUDY = "set by the study"


class StudyConfigError(ValueError):
    """A study file that cannot be run as written; the message names the key and the file."""


@dataclasses.dataclass(frozen=True)
class ReportSettings:
    """What the report compares.

    Attributes:
        baseline: the method others are compared with (ratios, finding (c)).
        late_window: rollout steps at the end of a run whose mean token entropy is its "final entropy".
        entropy_keepers: methods expected to keep entropy above the baseline late in training (finding (c)).
        polarity_ablation: methods that train on one advantage sign only (``PolarityFilter``), reported beside
            finding (f) (default: ``positive_only`` and ``negative_only`` where the study runs them).
        block: rollout steps per block in finding (b)'s checkpoint-scale comparison (predicted and observed
            changes summed over each block: the source paper compares adjacent checkpoints, not single updates).
        method_configs: a folder holding each method's own fit config as ``<method>.yaml`` (``configs``): the
            report lists every setting in which the study's run of a method differs from it
            (:func:`config_overrides`). ``None``: no such column.
        config_of: for a method whose own config has another name (a variant of a shipped method), that name:
            ``{"clip_cov_reference": "clip_cov"}`` compares the row with ``<method_configs>/clip_cov.yaml``
            (entries for methods the study does not run are ignored).
    """

    baseline: str = "grpo"
    late_window: int = 100
    block: int = 100
    entropy_keepers: tuple[str, ...] = ("clip_cov", "kl_cov")
    polarity_ablation: tuple[str, ...] = ("positive_only", "negative_only")
    method_configs: str | None = None
    config_of: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """A parsed, validated study file (see the module docstring for the keys)."""

    name: str
    base: dict[str, Any]
    methods: dict[str, dict[str, Any]]
    seeds: tuple[int, ...]
    tracking_uri: str = "sqlite:///mlflow.db"
    experiment: str = ""
    output_dir: str = ""
    workers: int = 1
    threads_per_run: int = 1
    report: ReportSettings = ReportSettings()
    source: str = "<dict>"

    def run_name(self, method: str, seed: int) -> str:
        return f"{method}-seed{seed}"

    def grid(self) -> list[tuple[str, int]]:
        """Every (method, seed), seed-major: a study cut short has all methods at its first seeds."""
        return [(method, seed) for seed in self.seeds for method in self.methods]

    def method_config(self, method: str) -> dict[str, Any]:
        """``base`` with ``method``'s keys merged in (no seed, no logger)."""
        return merge_method(self.base, self.methods[method])

    def config_hash(self, method: str) -> str:
        """Identifies a method's training config: a finished run with another hash is stale and rerun."""
        text = json.dumps(self.method_config(method), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def run_config(self, method: str, seed: int) -> dict[str, Any]:
        """The full ``lightning_rlvr fit`` config of one run, MLflow logger and seed included."""
        config = self.method_config(method)
        config["seed_everything"] = seed
        trainer = config.setdefault("trainer", {})
        trainer.setdefault("enable_progress_bar", False)  # the study draws the progress bar
        trainer["logger"] = {
            "class_path": "lightning.pytorch.loggers.MLFlowLogger",
            "init_args": {
                "experiment_name": self.experiment,
                "tracking_uri": self.tracking_uri,
                "run_name": self.run_name(method, seed),
                "tags": {"study": self.name, "study.method": method, "study.seed": str(seed),
                         "study.config_hash": self.config_hash(method)},
            },
        }
        return config


def merge_method(base: dict[str, Any], override: dict[str, Any], path: str = "") -> dict[str, Any]:
    """Deep-merge ``override`` into a copy of ``base``; ``trainer.callbacks`` lists are concatenated.

    Example::

        >>> merge_method({"model": {"lr": 1, "clip": 0.2}, "trainer": {"callbacks": ["A"]}},
        ...              {"model": {"lr": 2}, "trainer": {"callbacks": ["B"]}})
        {'model': {'lr': 2, 'clip': 0.2}, 'trainer': {'callbacks': ['A', 'B']}}
    """
    merged = copy.deepcopy(base)
    for key, value in override.items():
        where = f"{path}.{key}" if path else key
        if where == "trainer.callbacks":
            merged[key] = [*copy.deepcopy(merged.get(key) or []), *copy.deepcopy(value or [])]
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_method(merged[key], value, where)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _check_fit_config(config: Any, where: str) -> None:
    if not isinstance(config, dict):
        raise StudyConfigError(f"{where}: expected a mapping of fit-config sections, got {type(config).__name__}")
    unknown = set(config) - _FIT_SECTIONS
    if unknown:
        raise StudyConfigError(f"{where}: unknown section(s) {sorted(unknown)}; a fit config has "
                               f"{sorted(_FIT_SECTIONS)}" + ("; seeds come from the study's `seeds`" if "seed_everything" in unknown else ""))
    trainer = config.get("trainer") or {}
    if not isinstance(trainer, dict):
        raise StudyConfigError(f"{where}.trainer: expected a mapping")
    if "logger" in trainer:
        raise StudyConfigError(f"{where}.trainer.logger is {_OWNED_BY_STUDY} (an MLflow logger on the study's "
                               "experiment); remove it")
    if not isinstance(trainer.get("callbacks") or [], list):
        raise StudyConfigError(f"{where}.trainer.callbacks: expected a list of {{class_path, init_args}}")
    for section in ("model", "data"):
        if section in config and not isinstance(config[section], dict):
            raise StudyConfigError(f"{where}.{section}: expected a mapping")


def _positive_int(raw: dict[str, Any], key: str, default: int, source: str) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StudyConfigError(f"{source}: `{key}` must be an integer >= 1, got {value!r}")
    return value


# Settings that change only what is evaluated or logged, not what is trained: left out of config_overrides.
_NOT_TRAINING = ("trainer.logger", "trainer.callbacks", "trainer.enable_", "trainer.default_root_dir",
                 "trainer.log_every_n_steps", "trainer.num_sanity_val_steps", "trainer.check_val_every_n_epoch",
                 "trainer.val_check_interval", "trainer.limit_val_batches", "data.val_", "data.verifier_workers",
                 "model.log_completions_", "seed_everything")
_DEFAULT = "(default)"


def _flatten(config: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(config, dict):
        return {prefix: config}
    flat: dict[str, Any] = {}
    for key, value in config.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _defaults(target: Any) -> dict[str, Any]:
    """The constructor defaults of a class (or of ``"module.Class"``); ``{}`` for ``None`` or what cannot be
    imported."""
    if target is None:
        return {}
    if isinstance(target, str):
        module_name, _, attribute = target.rpartition(".")
        try:
            target = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError, ValueError):
            return {}
    return {name: p.default for name, p in inspect.signature(target).parameters.items()
            if p.default is not inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD}


def _resolved(section: Any, owner: Any) -> Any:
    """``section`` with ``owner``'s constructor defaults filled in, recursively for ``class_path`` values."""
    if isinstance(section, dict) and "class_path" in section:
        return {"class_path": section["class_path"],
                "init_args": _resolved(section.get("init_args") or {}, section["class_path"])}
    if not isinstance(section, dict):
        return section
    return {**_defaults(owner), **{k: _resolved(v, None) if v is not None else v for k, v in section.items()}}


def callback_arguments(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{name: init_args with defaults}`` of ``trainer.callbacks`` (a repeated class gets ``#2``, ``#3``, ...)."""
    named: dict[str, dict[str, Any]] = {}
    for callback in (config.get("trainer") or {}).get("callbacks") or []:
        class_path = str(callback.get("class_path", "?"))
        name = class_path.rsplit(".", 1)[-1]
        key, n = name, 1
        while key in named:
            n += 1
            key = f"{name}#{n}"
        named[key] = {**_defaults(class_path), **(callback.get("init_args") or {})}
    return named


def config_overrides(own: dict[str, Any], run: dict[str, Any], shared_callbacks: tuple[str, ...] = ()) -> list[str]:
    """Every training setting in which ``run`` (a study's fit config of a method) differs from ``own`` (the method's
    own config), as ``"key: own → run"`` (``(default)`` where a side leaves the key unset).

    Compared, with the constructors' defaults filled in on both sides (so ``clip_high`` left at its default equals
    an explicit 0.2): every key of ``model``, ``data`` and ``trainer`` except those that only change evaluation or
    logging (validation schedule and sizes, loggers, progress bars, completion tables, the seed); and the callbacks
    by class:
    each of ``own``'s callbacks missing from ``run`` (``without X``), each argument that differs (``X.arg: a → b``),
    and each of ``run``'s callbacks that ``own`` lacks (``with X``) unless it is in ``shared_callbacks`` (the
    study's instrumentation, the same for every method).
    """
    owners = {"model": "lightning_rlvr.module.RLVRModule", "data": "lightning_rlvr.data.RolloutDataModule",
              "trainer": "lightning.pytorch.Trainer"}

    def settings(config: dict[str, Any]) -> dict[str, Any]:
        flat = _flatten({k: _resolved(config.get(k) or {}, owner) for k, owner in owners.items()}, "")
        return {k: v for k, v in flat.items() if not k.startswith(_NOT_TRAINING)}

    def differences(mine: dict[str, Any], theirs: dict[str, Any], prefix: str = "") -> list[str]:
        def show(value: Any) -> str:
            return value if isinstance(value, str) else json.dumps(value)

        return [f"{prefix}{key}: {show(mine.get(key, _DEFAULT))} → {show(theirs.get(key, _DEFAULT))}"
                for key in sorted(mine.keys() | theirs.keys()) if mine.get(key, _DEFAULT) != theirs.get(key, _DEFAULT)]

    out = differences(settings(own), settings(run))
    own_callbacks, run_callbacks = callback_arguments(own), callback_arguments(run)
    for name, arguments in own_callbacks.items():
        if name not in run_callbacks:
            out.append(f"without {name}")
        else:
            out += differences(_flatten(arguments, ""), _flatten(run_callbacks[name], ""), f"{name}.")
    out += [f"with {name}" for name in run_callbacks if name not in own_callbacks and name not in shared_callbacks]
    return out


def load_study(source: str | Path | dict[str, Any]) -> StudyConfig:
    """Read and validate a study (a YAML path or an already-loaded dict).

    Checks here are structural (keys, types, names); each run's fit config is validated by the
    ``lightning_rlvr`` parser before anything trains (:func:`lightning_rlvr.study.runner.validate_runs`).

    Raises:
        StudyConfigError: naming the key and the file.
    """
    if isinstance(source, dict):
        raw, where = copy.deepcopy(source), "<dict>"
    else:
        where = str(source)
        try:
            raw = yaml.safe_load(Path(source).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise StudyConfigError(f"study file not found: {where}") from None
        except yaml.YAMLError as err:
            raise StudyConfigError(f"{where}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise StudyConfigError(f"{where}: expected a mapping at the top level")
    allowed = {f.name for f in dataclasses.fields(StudyConfig)} - {"source"}
    unknown = set(raw) - allowed
    if unknown:
        raise StudyConfigError(f"{where}: unknown key(s) {sorted(unknown)}; a study has {sorted(allowed)}")
    for key in ("name", "base", "methods", "seeds"):
        if key not in raw:
            raise StudyConfigError(f"{where}: missing required key `{key}`")
    name = raw["name"]
    if not isinstance(name, str) or not _METHOD_NAME.match(name):
        raise StudyConfigError(f"{where}: `name` must be a non-empty name of letters, digits, '_', '-', '.'; "
                               f"got {name!r}")
    _check_fit_config(raw["base"], f"{where}: base")
    methods = raw["methods"]
    if not isinstance(methods, dict) or not methods:
        raise StudyConfigError(f"{where}: `methods` must be a non-empty mapping of name -> overrides")
    for method, override in methods.items():
        if not isinstance(method, str) or not _METHOD_NAME.match(method):
            raise StudyConfigError(f"{where}: method name {method!r} must be letters, digits, '_', '-', '.'")
        _check_fit_config(override if override is not None else {}, f"{where}: methods.{method}")
    seeds = raw["seeds"]
    if (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
        raise StudyConfigError(f"{where}: `seeds` must be a non-empty list of distinct integers, got {seeds!r}")
    report_raw = raw.get("report") or {}
    if not isinstance(report_raw, dict):
        raise StudyConfigError(f"{where}: `report` must be a mapping")
    report_keys = {f.name for f in dataclasses.fields(ReportSettings)}
    if set(report_raw) - report_keys:
        raise StudyConfigError(f"{where}: unknown report key(s) {sorted(set(report_raw) - report_keys)}; "
                               f"allowed {sorted(report_keys)}")
    # Defaults adapt to the methods present: GRPO (else the first method) is the baseline, absent keepers drop.
    default_baseline = ReportSettings.baseline if ReportSettings.baseline in methods else next(iter(methods))
    report = ReportSettings(
        baseline=str(report_raw.get("baseline", default_baseline)),
        late_window=_positive_int(report_raw, "late_window", ReportSettings.late_window, f"{where}: report"),
        block=_positive_int(report_raw, "block", ReportSettings.block, f"{where}: report"),
        entropy_keepers=tuple(report_raw.get("entropy_keepers",
                                             [m for m in ReportSettings.entropy_keepers if m in methods])),
        polarity_ablation=tuple(report_raw.get("polarity_ablation",
                                               [m for m in ReportSettings.polarity_ablation if m in methods])),
        method_configs=None if report_raw.get("method_configs") is None else str(report_raw["method_configs"]),
        config_of={str(k): str(v) for k, v in (report_raw.get("config_of") or {}).items() if k in methods},
    )
    for key, names in (("baseline", [report.baseline]), ("entropy_keepers", report.entropy_keepers),
                       ("polarity_ablation", report.polarity_ablation)):
        missing = [n for n in names if n not in methods]
        if missing:
            raise StudyConfigError(f"{where}: report.{key} names {missing}, which are not methods of the study "
                                   f"({sorted(methods)})")
    output_dir = raw.get("output_dir") or f"study/{name}"
    return StudyConfig(
        name=name, base=raw["base"], methods={m: o or {} for m, o in methods.items()}, seeds=tuple(seeds),
        tracking_uri=str(raw.get("tracking_uri", StudyConfig.tracking_uri)),
        experiment=str(raw.get("experiment") or name), output_dir=str(output_dir),
        workers=_positive_int(raw, "workers", 1, where),
        threads_per_run=_positive_int(raw, "threads_per_run", 1, where),
        report=report, source=where,
    )
