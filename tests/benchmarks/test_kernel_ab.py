"""benchmarks/kernel_ab.py: one linear's time in two kernel builds, or in one build with a tile off."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from kernel_settings import tile_settings
from tokenleap.kernels import load_kernels


def test_a_tile_against_the_same_build_without_it(load_benchmark: Callable[[str], ModuleType], tmp_path: Path) -> None:
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("no tokenleap kernels on this machine")
    tile = "pair" if kernels.quant_vnni() else "xb"
    switch = kernels.quant_pair_rows if tile == "pair" else kernels.quant_xb_rows
    default = switch()
    m = load_benchmark("kernel_ab")
    out = tmp_path / "ab.json"
    args = ["--without-tile", tile, "--shape", "qwen2.5-1.5b", "--types", "Q4_K", "--rows", "4", "--rounds", "1"]
    assert m.main([*args, "--budget-mb", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["baseline"] == f"this build, {tile} tile off" and len(result["ms"]) == 3
    assert all(v["baseline"] > 0 and v["current"] > 0 for v in result["ms"].values())
    assert switch() == default  # put back


def test_the_xb_tile_is_compared_where_the_load_chose_the_group_major_one(
    load_benchmark: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    """Without VNNI, where kernels/tiles.py left the buffered tiles off, `--without-tile xb` still
    compares them (from 4 rows) with the group-major tile, and leaves the setting at 0."""
    kernels = load_kernels()
    if kernels is None or not hasattr(kernels.lib, "tl_quant_xb"):
        pytest.skip("no buffered tiles on this machine")
    m = load_benchmark("kernel_ab")
    with tile_settings(kernels, vnni=False, xb_rows=0):
        out = tmp_path / "ab.json"
        args = ["--without-tile", "xb", "--shape", "qwen2.5-1.5b", "--types", "Q4_K", "--rows", "4", "--rounds", "1"]
        assert m.main([*args, "--budget-mb", "1", "--out", str(out)]) == 0
        assert json.loads(out.read_text())["baseline"] == "this build, xb tile off"
        assert kernels.quant_xb_rows() == 0


@pytest.mark.parametrize("argv", [[], ["--baseline", "HEAD", "--without-tile", "xb"]])
def test_one_comparison_must_be_named(load_benchmark: Callable[[str], ModuleType], argv: list[str]) -> None:
    m = load_benchmark("kernel_ab")
    with pytest.raises(SystemExit) as exc:
        m.main(argv)
    assert exc.value.code == 2
