"""benchmarks/quant_stream.py: the decode's quantized linears against a plain read, built per revision."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tokenleap.kernels.build import cpu_flags, kernel_variant


def test_a_build_streams_a_shape_and_reports_its_fraction_of_the_read(
    load_benchmark: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    variant = kernel_variant(cpu_flags())
    if variant is None or shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no kernels or no C compiler on this machine")
    m = load_benchmark("quant_stream")
    binary = m.build(m.KERNEL_DIR, variant, tmp_path / "qs", optimize="-O1")
    for fmt, huge in ((m.FORMATS["Q4_K"], True), (m.FORMATS["Q8_0"], False)):
        run = m.run_once(binary, fmt, 256, 512, 1.0, rows=2, threads=2, huge=huge)
        assert run["gbps"] > 0 and run["read"] > 0 and run["us_per_call"] > 0
        assert run["ratio"] == pytest.approx(run["gbps"] / run["read"], rel=1e-2)
    runs = [
        {"gbps": 30.0, "read": 50.0, "ratio": 0.6},
        {"gbps": 30.0, "read": 33.0, "ratio": 0.9},
        {"gbps": 31.0, "read": 33.0, "ratio": 0.94},
    ]
    states = m.summarize(runs, fast_gbps=45.0)
    assert states["fast"]["n"] == 1 and states["fast"]["ratio"] == 0.6
    assert states["slow"]["n"] == 2 and states["slow"]["ratio"] == pytest.approx(0.92)


def test_a_bad_type_is_a_usage_error(load_benchmark: Callable[[str], ModuleType]) -> None:
    m = load_benchmark("quant_stream")
    with pytest.raises(SystemExit) as exc:
        m.main(["--types", "Q3_K"])
    assert exc.value.code == 2
