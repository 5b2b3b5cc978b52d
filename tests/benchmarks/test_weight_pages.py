"""benchmarks/weight_pages.py: decoding on huge-page weight buffers against numpy's, in pairs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from smaps import vm_flags  # tests/smaps.py
from tokenleap.kernels.formats import QuantWeight


@pytest.mark.slow
def test_pairs_decode_both_loads_and_the_small_page_load_uses_numpys_buffers(
    load_benchmark: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    m = load_benchmark("weight_pages")
    out = tmp_path / "wp.json"
    assert m.main(["smollm2-135m-instruct", "--pairs", "2", "--tokens", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["pairs"]) == 2 and all(p["huge"] > 0 and p["small"] > 0 for p in result["pairs"])
    assert result["median_ratio"] > 0
    # the library's own allocator is back after the small-page load
    big = QuantWeight.from_blocks(np.zeros((64 * 1024, 34), dtype=np.uint8), 8, 64 * 1024, 32)
    assert big.data.data_ptr() % (2 << 20) == 0


def test_bad_arguments_are_usage_errors(load_benchmark: Callable[[str], ModuleType], tmp_path: Path) -> None:
    m = load_benchmark("weight_pages")
    for argv in ([str(tmp_path / "none.gguf")], ["smollm2-135m-instruct", "--pairs", "0"]):
        with pytest.raises(SystemExit) as exc:
            m.main(argv)
        assert exc.value.code == 2


def test_the_no_gather_load_leaves_small_weights_apart_and_puts_the_gather_back(
    load_benchmark: Callable[[str], ModuleType],
) -> None:
    import tokenleap.models.weights as model_weights
    from tokenleap.kernels.memory import gather_on_huge_pages

    m = load_benchmark("weight_pages")
    model = m.load_on_small_pages("smollm2-135m-instruct", "no-gather").model
    flags = vm_flags(model.layers[len(model.layers) // 2].linears()[0].weight.data.data_ptr())
    assert flags and "hg" not in flags  # where numpy's allocator put it: not madvised for huge pages
    assert model_weights.gather_on_huge_pages is gather_on_huge_pages
