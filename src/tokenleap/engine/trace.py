"""A per-step speculation trace (NDJSON, one line per verified draft: request, method, step,
drafted ids, tree parents, accepted count), written when `TOKENLEAP_SPEC_TRACE` names a file, to
see what a drafter proposed and what the target kept without a debugger (llama.cpp users read
the same from its per-step debug logs)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

ENV = "TOKENLEAP_SPEC_TRACE"


class SpecTrace:
    """Appends one JSON object per line to `path` (opened on the first line; a lock keeps lines
    whole when several engines share one file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> SpecTrace | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def step(self, request_id: str, method: str, step: int, drafted: Sequence[int], parents: Sequence[int] | None,
             accepted: int) -> None:
        line = {
            "request": request_id,
            "method": method,
            "step": step,
            "drafted": [int(t) for t in drafted],
            "accepted": int(accepted),
        }
        if parents is not None:
            line["parents"] = [int(p) for p in parents]
        with self._lock:
            if self._file is None:
                self._file = self.path.open("a", encoding="utf-8")
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
