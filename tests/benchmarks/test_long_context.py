"""benchmarks/long_context.py and kv_attention.py on small sizes: decode after a prompt of a given
depth (bf16 and q8_0 caches), and one layer's attention over the fp32, bf16 and q8_0 caches."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from tokenleap.kernels import CpuKernels


def test_decode_at_depth(load_benchmark: Callable[[str], ModuleType], kernels: CpuKernels) -> None:
    if not kernels.bf16_attention:
        import pytest

        pytest.skip(
            "no blocked bf16 attention in this CPU's kernel variant (AVX-512 without BF16): no bf16 or q8_0 cache"
        )
    m = load_benchmark("long_context")
    from tokenleap import LLM

    llm = LLM(model="smollm2-135m-instruct", max_model_len=256)
    row = m.decode_at_depth(llm, 100, 8)
    assert row["tg"] > 0 and row["prefill_tps"] > 0 and row["kv_dtype"] == "bfloat16"
    c = llm.model.config
    assert row["kv_gb"] == c.num_layers * 2 * c.num_kv_heads * c.head_dim * llm.model.kv_dtype.itemsize * 108 / 1e9
    q8 = m.decode_at_depth(LLM(model="smollm2-135m-instruct", max_model_len=256, kv_cache_dtype="q8_0"), 100, 8)
    assert q8["kv_dtype"] == "q8_0" and q8["kv_gb"] == row["kv_gb"] * 17 / 32


def test_kv_attention_measures_every_layout(load_benchmark: Callable[[str], ModuleType], kernels: CpuKernels) -> None:
    if not kernels.bf16_attention:
        import pytest

        pytest.skip("no bf16 attention kernels")
    m = load_benchmark("kv_attention")
    out = m.measure([64], [1, 3], 2, 2)
    assert out["variant"] == kernels.variant and len(out["rows"]) == 2
    assert all(r["fp32_us"] > 0 and r["bf16_us"] > 0 and r["q8_0_us"] > 0 for r in out["rows"])
    both = m.measure([1024], [1], 1, 16, pages="both")["rows"][0]  # 16 layers at 1,024 tokens: caches past 2 MB
    assert both["bf16_4k_us"] > 0 and both["q8_0_4k_us"] > 0 and "fp32_4k_us" not in both
