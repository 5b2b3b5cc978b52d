"""benchmarks/tg_pairs.py: plain decode against llama-bench in pairs, split by the memory's state."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


def _pair(before: float, after: float, ours: float, peer: float) -> dict[str, float]:
    return {"read_before": before, "read_after": after, "tokenleap": ours, "llama_cpp": peer, "ratio": ours / peer}


def test_pairs_count_for_the_state_both_their_read_rates_are_in(load_benchmark: Callable[[str], ModuleType]) -> None:
    m = load_benchmark("tg_pairs")
    pairs = [_pair(34, 35, 7.0, 6.6), _pair(33, 34, 7.2, 6.8), _pair(35, 58, 9.0, 6.6), _pair(55, 57, 10.0, 9.0)]
    s = m.summarize(pairs, fast_gbps=45.0)
    assert s["slow"]["pairs"] == 2 and s["slow"]["ratio"] == pytest.approx((7.0 / 6.6 + 7.2 / 6.8) / 2)
    assert s["slow"]["read_gbps"] == pytest.approx(34.0)
    assert s["fast"]["pairs"] == 1 and s["fast"]["tokenleap"] == 10.0  # the straddling pair counts for neither
    assert s["all"]["pairs"] == 4
    assert "fast" not in m.summarize(pairs[:2], fast_gbps=45.0)
    assert "tokenleap_of_floor" not in s["slow"]  # pairs without the floor (older results) summarize as before


def test_shares_of_the_memory_floor_are_medians_per_state(load_benchmark: Callable[[str], ModuleType]) -> None:
    m = load_benchmark("tg_pairs")
    pairs = [{**_pair(34, 34, 7.0, 6.6), "tokenleap_of_floor": 0.97, "llama_cpp_of_floor": 0.91},
             {**_pair(33, 33, 7.2, 6.8), "tokenleap_of_floor": 0.95, "llama_cpp_of_floor": 0.93}]
    s = m.summarize(pairs, fast_gbps=45.0)
    assert s["slow"]["tokenleap_of_floor"] == pytest.approx(0.96) and s["slow"]["llama_cpp_of_floor"] == pytest.approx(
        0.92
    )


def test_missing_files_and_binaries_are_usage_errors(
    load_benchmark: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    m = load_benchmark("tg_pairs")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    for argv in (
        [str(tmp_path / "none.gguf"), "--llama-bench", str(gguf)],
        [str(gguf), "--llama-bench", str(tmp_path / "no-bench")],
    ):
        with pytest.raises(SystemExit) as exc:
            m.main(argv)
        assert exc.value.code == 2
