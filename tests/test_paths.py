"""paths.py: the cache directory and the file identity cache entries record."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tokenleap.paths import cache_dir, source_identity, still_current


def test_the_cache_directory_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLEAP_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TOKENLEAP_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x" / "tokenleap"


def test_an_entry_is_current_until_its_file_changes_or_goes(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    meta = source_identity(f)
    assert still_current(meta)
    f.write_bytes(b"GGUF, longer")
    assert not still_current(meta)
    meta = source_identity(f)
    os.utime(f, (1, 1))
    assert not still_current(meta)
    meta = source_identity(f)
    f.unlink()
    assert not still_current(meta)
    for broken in ({}, {"source": str(f)}, [], None):
        assert not still_current(broken)  # type: ignore[arg-type]
