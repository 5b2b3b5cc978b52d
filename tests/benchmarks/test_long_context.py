"""benchmarks/long_context.py and kv_attention.py on small sizes: decode after a prompt of a given
depth, and one layer's attention over both cache layouts."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType


def test_decode_at_depth(load_benchmark: Callable[[str], ModuleType]) -> None:
    m = load_benchmark("long_context")
    from tokenleap import LLM

    llm = LLM(model="smollm2-135m-instruct", max_model_len=256)
    row = m.decode_at_depth(llm, 100, 8)
    assert row["tg"] > 0 and row["prefill_tps"] > 0
    c = llm.model.config
    assert row["kv_gb"] == c.num_layers * 2 * c.num_kv_heads * c.head_dim * llm.model.kv_dtype.itemsize * 108 / 1e9


def test_kv_attention_measures_both_layouts(load_benchmark: Callable[[str], ModuleType], kernels) -> None:  # type: ignore[no-untyped-def]
    if not kernels.bf16_attention:
        import pytest

        pytest.skip("no bf16 attention kernels")
    m = load_benchmark("kv_attention")
    out = m.measure([64], [1, 3], 2)
    assert out["variant"] == kernels.variant and len(out["rows"]) == 2
    assert all(r["fp32_us"] > 0 and r["bf16_us"] > 0 for r in out["rows"])
