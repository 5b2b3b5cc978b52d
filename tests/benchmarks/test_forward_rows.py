"""benchmarks/forward_rows.py: k-row forwards against one row, with and without the two-group tile."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

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
