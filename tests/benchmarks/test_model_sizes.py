"""benchmarks/model_sizes.py: replay drafts against plain decoding on the default model."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from tokenleap import LLM


def test_replay_pairs_runs_and_keeps_the_output(load_benchmark: Callable[[str], ModuleType], llm: LLM) -> None:
    m = load_benchmark("model_sizes")
    result = m.replay(llm, "Name three colours.", 12, [2], 0.5, rounds=2)
    assert result["rounds"] == 2 and [(r["k"], r["p"]) for r in result["rows"]] == [(2, 1.0), (2, 0.5)]
    for row in result["rows"]:
        assert row["identical"] and len(row["speedups"]) == 2
        assert min(row["speedups"]) <= row["speedup"] <= max(row["speedups"])
    # drafts right every time: every verify keeps both and the bonus token (the last one cut by
    # max_tokens: 11 decoded tokens in 4 forwards); drafts right half the time keep fewer
    assert result["rows"][0]["tokens_per_forward"] == 11 / 4 > result["rows"][1]["tokens_per_forward"]
