"""benchmarks/prefill_ab.py: prefill, or one-row decode steps, of two trees in alternating processes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", [[], ["--decode"], ["--xb-rows", "0"]])
def test_both_trees_are_timed_per_model_and_length(
    load_benchmark: Callable[[str], ModuleType], tmp_path: Path, mode: list[str]
) -> None:
    m = load_benchmark("prefill_ab")
    out = tmp_path / "ab.json"
    argv = ["--baseline", str(ROOT), "--models", "smollm2-135m-instruct", "--lengths", "8,20", "--pairs", "1"]
    assert m.main([*argv, *mode, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["cases"]) == {"smollm2-135m-instruct 8", "smollm2-135m-instruct 20"}
    assert result["unit"] == ("ms a decode step at that context" if "--decode" in mode else "ms a prompt token")
    assert result["xb_rows"] == (0 if "--xb-rows" in mode else -1)  # set in each worker after its load
    for case in result["cases"].values():
        assert case["baseline_ms"] > 0 and case["current_ms"] > 0
        assert len(case["runs"]["baseline"]) == len(case["runs"]["current"]) == 1


def test_a_folder_that_is_no_checkout_and_an_unknown_model_are_usage_errors(
    load_benchmark: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    m = load_benchmark("prefill_ab")
    with pytest.raises(SystemExit) as exc:
        m.main(["--baseline", str(tmp_path)])
    assert exc.value.code == 2
    with pytest.raises(SystemExit, match="worker on .* failed"):
        m.main(["--baseline", str(ROOT), "--models", "no-such-model", "--lengths", "4", "--pairs", "1",
                "--out", str(tmp_path / "x.json")])
