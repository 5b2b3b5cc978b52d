"""ngram-mod (llama.cpp's hash pool): drafts on hand-made token sequences, last writer wins,
collisions, the pool shared across requests, its size, lazy allocation, and one pool per
(n, size) for every drafter of a registry."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tokenleap import SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.drafters.base import DraftRequest
from tokenleap.drafters.chain import ChainDrafter
from tokenleap.drafters.ngram_mod import DEFAULT_POOL_SIZE, HashPool, NgramModDrafter, PoolStore, ngram_slot
from tokenleap.errors import TokenleapError
from tokenleap.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def begin(drafter: NgramModDrafter, request_id: str, prompt: Sequence[int]) -> None:
    drafter.begin(DraftRequest(request_id, list(prompt), GREEDY, torch.Generator()))


def propose(context: Sequence[int], max_tokens: int = 8, size_n: int = 2, pool_size: int = 1 << 12) -> list[int]:
    drafter = NgramModDrafter(size_n, pool_size)
    begin(drafter, "r", context)
    return drafter.propose("r", list(context), max_tokens).tokens


# --------------------------------------------------------------------------- drafts


def test_follows_the_stored_continuation_around_a_cycle() -> None:
    # (1,2)->3, (2,3)->4, (3,4)->1, (4,1)->2: the walk goes round the cycle until max_tokens
    assert propose([1, 2, 3, 4, 1, 2], max_tokens=6) == [3, 4, 1, 2, 3, 4]
    assert propose([1, 2, 3, 4, 1, 2], max_tokens=2) == [3, 4]
    assert propose([1, 2, 3, 4, 1, 2], max_tokens=0) == []


def test_draft_stops_at_an_unseen_ngram() -> None:
    assert propose([5, 6, 7, 8, 5, 6]) == [7, 8, 5, 6, 7, 8, 5, 6]  # a cycle
    assert propose([5, 6, 7, 9, 8, 5, 6], max_tokens=8) == [7, 9, 8, 5, 6, 7, 9, 8]
    assert propose([1, 2, 3, 1, 2], size_n=3) == []  # (3,1,2) was never followed by anything
    assert propose([1, 2, 3, 4]) == []  # the context's own last n-gram is not its own match
    assert propose([1]) == []  # shorter than n


def test_last_writer_wins() -> None:
    # (5,6) was followed by 7, later by 8: the later one is drafted
    assert propose([5, 6, 7, 1, 5, 6, 8, 2, 5, 6], max_tokens=1) == [8]


def test_collisions_only_cost_wrong_drafts() -> None:
    # one slot: every n-gram collides, so the pool holds only the last token written
    assert propose([1, 2, 3, 4, 1, 2], max_tokens=3, pool_size=1) == [2, 2, 2]  # (4,1) -> 2 came last


def test_slot_is_a_deterministic_hash_within_the_pool() -> None:
    assert ngram_slot([1, 2, 3], 1 << 20) == ngram_slot((1, 2, 3), 1 << 20)
    assert ngram_slot([1, 2, 3], 1 << 20) != ngram_slot([3, 2, 1], 1 << 20)
    slots = {ngram_slot([a, b], 1000) for a in range(50) for b in range(50)}
    assert all(0 <= s < 1000 for s in slots) and len(slots) > 800  # spread over the pool


def test_incremental_indexing_sees_new_tokens() -> None:
    drafter = NgramModDrafter(2, 1 << 12)
    begin(drafter, "r", [1, 2])
    assert drafter.propose("r", [1, 2], 4).tokens == []
    assert drafter.propose("r", [1, 2, 3, 1, 2], 2).tokens == [3, 1]


def test_pool_is_shared_across_requests_and_outlives_them() -> None:
    drafter = NgramModDrafter(3, 1 << 12)
    begin(drafter, "a", [10, 11, 12, 13, 14, 15])
    drafter.end("a")
    begin(drafter, "b", [7, 10, 11, 12])
    assert drafter.propose("b", [7, 10, 11, 12], 3).tokens == [13, 14, 15]
    begin(drafter, "running", [20, 21, 22, 23, 24])  # written at begin, while still running
    assert drafter.propose("b", [7, 10, 11, 12, 20, 21, 22], 2).tokens == [23, 24]


# --------------------------------------------------------------------------- memory


def test_pool_is_allocated_on_first_write_at_its_configured_size() -> None:
    drafter = NgramModDrafter(3)
    assert drafter.pool.size == DEFAULT_POOL_SIZE == 1 << 20
    assert drafter.pool.nbytes == 0  # nothing allocated by the constructor
    begin(drafter, "r", [1, 2])  # shorter than n + 1: nothing to write yet
    assert drafter.propose("r", [1, 2], 4).tokens == [] and drafter.pool.nbytes == 0
    begin(drafter, "s", [1, 2, 3, 4])
    assert drafter.pool.nbytes == 4 * DEFAULT_POOL_SIZE  # 4 MiB (was 16 MiB, eagerly)
    small = NgramModDrafter(3, pool_size=1000)
    begin(small, "r", [1, 2, 3, 4])
    assert small.pool.nbytes == 4000


def test_spec_config_default_pool_size_is_the_drafters() -> None:
    assert SpecConfig("ngram-mod").ngram_mod_pool_size == DEFAULT_POOL_SIZE


def test_bad_sizes_are_user_errors() -> None:
    with pytest.raises(TokenleapError, match="pool size"):
        HashPool(0)
    with pytest.raises(TokenleapError, match="ngram_mod_pool_size"):
        SpecConfig("ngram-mod", ngram_mod_pool_size=0)
    with pytest.raises(TokenleapError, match="expected 64"):
        NgramModDrafter(3, pool_size=64, pool=HashPool(32))


def test_pool_store_keeps_one_pool_per_ngram_length_and_size() -> None:
    store = PoolStore()
    assert store.get(3, 64) is store.get(3, 64)
    assert store.get(3, 64) is not store.get(4, 64)
    assert store.get(3, 64) is not store.get(3, 128)
    store.get(3, 64).put(0, 5)
    assert store.nbytes() == 64 * 4  # only the pool written to is allocated


def test_registry_shares_pools_between_configs_and_chains() -> None:
    registry = default_registry()
    a = registry.create("ngram-mod", SpecConfig("ngram-mod", num_speculative_tokens=4))
    b = registry.create("ngram-mod", SpecConfig("ngram-mod", num_speculative_tokens=8, draft_min=2))
    chain = registry.create("chain", SpecConfig("suffix+ngram-mod"))
    other_n = registry.create("ngram-mod", SpecConfig("ngram-mod", ngram_size_n=4))
    other_size = registry.create("ngram-mod", SpecConfig("ngram-mod", ngram_mod_pool_size=1 << 10))
    assert isinstance(a, NgramModDrafter) and isinstance(b, NgramModDrafter) and isinstance(chain, ChainDrafter)
    assert a.pool is b.pool is chain.drafters[1].pool  # type: ignore[attr-defined]
    assert other_n.pool is not a.pool and other_size.pool is not a.pool  # type: ignore[attr-defined]
    assert other_size.pool.size == 1 << 10  # type: ignore[attr-defined]
    # a second registry (another engine) has pools of its own
    assert default_registry().create("ngram-mod", SpecConfig("ngram-mod")).pool is not a.pool  # type: ignore[attr-defined]
    # sharing is what the pool is for: what one config's requests wrote, the other's draft
    begin(a, "r", [1, 2, 3, 4, 5, 6])
    begin(b, "s", [9, 1, 2, 3])
    assert b.propose("s", [9, 1, 2, 3], 3).tokens == [4, 5, 6]
