"""benchmarks/forward_rows.py: k-row forwards against one row, with and without the two-group tile."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

from kernel_settings import tile_settings
from tokenleap import LLM


def test_forward_rows_times_every_case(load_benchmark: Callable[[str], ModuleType], llm: LLM) -> None:
    m = load_benchmark("forward_rows")
    result = m.measure(llm, [1, 5], context=16, rounds=1)
    cases = result["cases"]
    assert cases["1 rows"]["best_rel"] == 1.0 and cases["5 rows"]["best_ms"] > 0
    assert "torch.sum 256 MB" in cases and result["sum_gbps"] > 0
    if llm.model.kernels is not None and llm.model.kernels.quant_pair_rows():
        assert "5 rows, one-group tile" in cases
        assert llm.model.kernels.quant_pair_rows() == 4  # put back
    if llm.model.kernels is not None:
        assert result["linears_gbps"] > 0


def test_without_vnni_it_compares_the_superblock_major_tile(
    load_benchmark: Callable[[str], ModuleType], llm: LLM
) -> None:
    """Where the linears run without VNNI (the AVX2 variant; here the host's with VNNI off) the
    other case is the K-quants' group-major tile, or the superblock-major one where the load
    chose the group-major tile (kernels/tiles.py), and the setting is put back."""
    kernels = llm.model.kernels
    if kernels is None or not hasattr(kernels.lib, "tl_quant_xb"):
        pytest.skip("no tokenleap kernels with the superblock-major tile here")
    m = load_benchmark("forward_rows")
    with tile_settings(kernels, vnni=False):
        for default, other in ((4, "group-major tile"), (0, "superblock-major tile")):
            kernels.quant_xb_rows(default)
            cases = m.measure(llm, [1, 5], context=16, rounds=1)["cases"]
            assert f"5 rows, {other}" in cases and "1 rows, " + other not in cases, (default, list(cases))
            assert "5 rows, one-group tile" not in cases
            assert kernels.quant_xb_rows() == default  # put back


def test_parts_time_the_linears_and_the_head_at_each_row_count(
    load_benchmark: Callable[[str], ModuleType], llm: LLM
) -> None:
    if llm.model.kernels is None:
        pytest.skip("no tokenleap kernels here")
    m = load_benchmark("forward_rows")
    cases = m.measure(llm, [1, 3], context=16, rounds=1, parts=True)["cases"]
    for n in (1, 3):
        assert cases[f"{n} rows: layer linears"]["best_ms"] > 0 and cases[f"{n} rows: LM head"]["best_ms"] > 0
    assert "1 rows: layer linears" in m.measure(llm, [1], context=16, rounds=1, parts=True)["cases"]
    assert not any("LM head" in k for k in m.measure(llm, [1], context=16, rounds=1)["cases"])
