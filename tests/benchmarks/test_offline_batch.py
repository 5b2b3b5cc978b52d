"""benchmarks/offline_batch.py: the ABBA measurement on the tiny model (outputs compared, ratios, memory probe)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tokenleap import LLM, SamplingParams


@pytest.fixture(scope="module")
def offline_batch(load_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return load_benchmark("offline_batch")


def test_measure_alternates_modes_and_compares_outputs(offline_batch: ModuleType, tiny_hf_folder: Path) -> None:
    llm = LLM(str(tiny_hf_folder), dtype="float32", max_model_len=64)
    prompts = [[(3 * i + j) % 200 + 20 for j in range(4 + i)] for i in range(7)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    result = offline_batch.measure(llm, prompts, params, [3], rounds=2)
    assert [run["mode"] for run in result["runs"]] == ["one-at-a-time", "batched-3", "batched-3", "one-at-a-time"]
    summary = result["summary"]
    assert summary["one-at-a-time"]["ratio_to_one_at_a_time"] == 1.0
    for name, live in (("one-at-a-time", 1), ("batched-3", 3)):
        s = summary[name]
        assert s["prompts_identical"] == 7 and s["runs_identical"] == 2
        assert s["peak_live_requests"] == live and s["peak_kv_mb"] > 0
        assert s["output_tokens_per_second"] > 0
    assert llm.config.max_num_seqs == 16  # restored
    assert "add_request" not in vars(llm.engine)  # the probe's wrappers are gone
    eager = offline_batch.eager_allocation(llm, prompts)
    assert eager["peak_live_requests"] == 7
