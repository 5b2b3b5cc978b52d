"""ngram-cache (llama.cpp's lookup decoding statistics): drafts on hand-made token sequences, the
evidence thresholds, the three levels (context, dynamic, static), save / load of the statistics
file, and the bound on the statistics with least-recently-updated eviction."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tokenleap import SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.drafters.base import DraftRequest
from tokenleap.drafters.ngram_cache import DEFAULT_MAX_ENTRIES, NgramCacheDrafter, Stats, load_stats
from tokenleap.errors import TokenleapError
from tokenleap.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def begin(drafter: NgramCacheDrafter, request_id: str, prompt: Sequence[int]) -> None:
    drafter.begin(DraftRequest(request_id, list(prompt), GREEDY, torch.Generator()))


def run(drafter: NgramCacheDrafter, request_id: str, tokens: Sequence[int]) -> None:
    """A whole request: begin, one propose over all its tokens, end (its tokens join the dynamic level)."""
    begin(drafter, request_id, tokens[:1])
    drafter.propose(request_id, list(tokens), 1)
    drafter.end(request_id)


def propose(context: Sequence[int], max_tokens: int = 4, **kwargs: object) -> list[int]:
    drafter = NgramCacheDrafter(**kwargs)  # type: ignore[arg-type]
    begin(drafter, "r", context)
    return drafter.propose("r", list(context), max_tokens).tokens


def pairs(stats: Stats) -> int:
    return sum(len(counts) for _, counts in stats.items())


# --------------------------------------------------------------------------- drafts


def test_drafts_the_continuation_of_the_context() -> None:
    assert propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2, 3]
    assert propose([1, 2, 3, 4, 1, 2, 3], max_tokens=2) == [4, 1]
    assert propose([1, 2, 3, 4, 1, 2, 3], max_tokens=0) == []
    assert propose([1, 2, 3, 4]) == []  # nothing followed 4 yet
    assert propose([]) == []


def test_the_longest_ngram_with_enough_evidence_decides() -> None:
    # 3 was followed by 7 twice and by 8 once; but after (1, 2, 3) it was always 8
    context = [3, 7, 3, 7, 1, 2, 3, 8, 5, 1, 2, 3]
    assert propose(context, max_tokens=1) == [8]
    assert propose(context, max_tokens=1, n_max=1) == [7]


def test_min_share_and_min_count() -> None:
    tie = [1, 2, 5, 1, 2, 6, 1, 2]  # (1, 2) -> 5 once, 6 once
    assert propose(tie, max_tokens=1) == [5]  # a half share is enough by default; ties: first seen
    assert propose(tie, max_tokens=1, min_share=0.6) == []
    twice = [1, 2, 5, 1, 2, 5, 1, 2]
    assert propose(twice, max_tokens=1, min_count=2) == [5]
    assert propose(twice, max_tokens=1, min_count=3) == []


def test_context_statistics_are_updated_incrementally() -> None:
    drafter = NgramCacheDrafter()
    begin(drafter, "r", [1, 2, 3])
    assert drafter.propose("r", [1, 2, 3], 2).tokens == []
    assert drafter.propose("r", [1, 2, 3, 9, 1, 2, 3], 2).tokens == [9, 1]


def test_finished_requests_feed_the_dynamic_level() -> None:
    drafter = NgramCacheDrafter()
    run(drafter, "a", [10, 11, 12, 13, 14])
    assert len(drafter._context) == 0 and len(drafter._tokens) == 0  # per-request state is freed
    begin(drafter, "b", [7, 11, 12])
    assert drafter.propose("b", [7, 11, 12], 2).tokens == [13, 14]


def test_context_level_is_asked_before_the_dynamic_one() -> None:
    drafter = NgramCacheDrafter()
    run(drafter, "a", [1, 2, 3, 4])
    context = [1, 2, 3, 9, 1, 2, 3]  # this request says 9 after (1, 2, 3); earlier ones said 4
    begin(drafter, "b", context)
    assert drafter.propose("b", context, 1).tokens == [9]


# --------------------------------------------------------------------------- the statistics file


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    drafter = NgramCacheDrafter()
    run(drafter, "a", [10, 11, 12, 13, 14])
    run(drafter, "b", [10, 11, 12, 13, 20])
    path = tmp_path / "stats.json"
    drafter.save(path)
    raw = json.loads(path.read_text())
    assert raw["format"] == "tokenleap-ngram-cache" and raw["version"] == 1 and raw["n_max"] == 4
    loaded = load_stats(path)
    assert loaded.get((10, 11, 12)) == {13: 2}
    assert loaded.get((13,)) == {14: 1, 20: 1}
    assert pairs(loaded) == drafter.dynamic.num_entries
    # a fresh drafter drafts from the file (the static level) ...
    fresh = NgramCacheDrafter(static_path=str(path))
    begin(fresh, "c", [5, 10, 11])
    assert fresh.propose("c", [5, 10, 11], 2).tokens == [12, 13]
    # ... and saves the static and dynamic statistics merged
    run(fresh, "d", [10, 11, 12, 13, 14])
    again = tmp_path / "again.json"
    fresh.save(again)
    assert load_stats(again).get((10, 11, 12)) == {13: 3}


def test_bad_statistics_files_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenleapError, match="not found"):
        NgramCacheDrafter(static_path=str(tmp_path / "missing.json"))
    for name, text in {
        "garbage": "not json",
        "other": '{"format": "x"}',
        "short": '{"format": "tokenleap-ngram-cache"}',
    }.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.raises(TokenleapError, match="not a valid n-gram cache file"):
            load_stats(path)


# --------------------------------------------------------------------------- bounds


def test_stats_hold_at_most_max_entries_and_evict_least_recently_updated() -> None:
    stats = Stats(max_entries=64)
    rng = random.Random(0)
    for i in range(5000):
        stats.add((rng.randrange(1000), rng.randrange(1000)), rng.randrange(5))
        assert stats.num_entries <= 64
        if i == 4000:
            stats.add((-1,), 7)  # updated long ago: evicted by now
    assert stats.num_entries == pairs(stats) > 48  # evicted a sixteenth at a time, not all
    assert stats.get((-1,)) is None
    stats.add((-2,), 3)
    assert stats.get((-2,)) == {3: 1}  # the latest update survives eviction
    # updating an old n-gram makes it recent again
    oldest = next(iter(key for key, _ in stats.items()))
    stats.add(oldest, 4)
    for i in range(10):
        stats.add((2000 + i,), 0)
    assert stats.get(oldest) is not None


def test_unbounded_stats_and_bad_bounds() -> None:
    stats = Stats()
    for i in range(1000):
        stats.add((i,), i)
    assert stats.num_entries == 1000 and len(stats) == 1000
    with pytest.raises(TokenleapError, match="max_entries"):
        Stats(max_entries=0)
    with pytest.raises(TokenleapError, match="ngram_cache_max_entries"):
        SpecConfig("ngram-cache", ngram_cache_max_entries=0)


def test_memory_stays_bounded_over_a_long_stream_and_drafts_still_work() -> None:
    drafter = NgramCacheDrafter(max_entries=2000)
    rng = random.Random(1)
    for i in range(60):  # 60 requests of 300 random tokens: ~70k pairs unbounded
        run(drafter, f"req-{i}", [rng.randrange(5000) for _ in range(300)])
        assert drafter.dynamic.num_entries <= 2000
    assert drafter.dynamic.num_entries == pairs(drafter.dynamic)
    recent = [rng.randrange(5000) for _ in range(12)]
    run(drafter, "recent", recent)
    begin(drafter, "reader", [9999, *recent[:4]])
    assert drafter.propose("reader", [9999, *recent[:4]], 6).tokens == recent[4:10]
    # the request's own context statistics are bounded the same way
    begin(drafter, "long", [1])
    drafter.propose("long", [rng.randrange(5000) for _ in range(1000)], 4)
    assert drafter._context["long"][0].num_entries <= 2000


def test_registry_passes_the_configured_bound() -> None:
    assert SpecConfig("ngram-cache").ngram_cache_max_entries == DEFAULT_MAX_ENTRIES
    drafter = default_registry().create("ngram-cache", SpecConfig("ngram-cache", ngram_cache_max_entries=123))
    assert isinstance(drafter, NgramCacheDrafter)
    assert drafter.dynamic.max_entries == 123


def test_registry_shares_the_dynamic_statistics_between_configs() -> None:
    registry = default_registry()
    a = registry.create("ngram-cache", SpecConfig("ngram-cache", num_speculative_tokens=4))
    b = registry.create("ngram-cache", SpecConfig("ngram-cache", num_speculative_tokens=8))
    chain = registry.create("chain", SpecConfig("suffix+ngram-cache"))
    other = registry.create("ngram-cache", SpecConfig("ngram-cache", ngram_size_n=2))
    assert isinstance(a, NgramCacheDrafter) and isinstance(b, NgramCacheDrafter)
    assert a.dynamic is b.dynamic is chain.drafters[1].dynamic  # type: ignore[attr-defined]
    assert other.dynamic is not a.dynamic  # type: ignore[attr-defined]
    assert default_registry().create("ngram-cache", SpecConfig("ngram-cache")).dynamic is not a.dynamic  # type: ignore[attr-defined]
    run(a, "r", [10, 11, 12, 13, 14])
    begin(b, "s", [7, 11, 12])
    assert b.propose("s", [7, 11, 12], 2).tokens == [13, 14]
