"""benchmarks/first_request.py: a first request measures the cost curve, a second LLM reads it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import tokenleap.engine.speculation as speculation
from tokenleap.config import DEFAULT_MODEL


def test_first_request_measures_then_reads_the_curve(
    load_benchmark: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    m = load_benchmark("first_request")
    user_cache = speculation.cache_dir
    out = tmp_path / "first.json"
    assert m.main([DEFAULT_MODEL, "--tokens", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["measured"] > 0 and result["from the cache"] > 0 and result["cached_curves"] == 1
    assert speculation.cache_dir is user_cache  # put back
