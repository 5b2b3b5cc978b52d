"""llama.cpp's n-gram map drafters: `ngram-simple`, `ngram-map-k`, `ngram-map-k4v`.

All three look up the context's last n tokens (the key) in the request's own history and draft
the m tokens (the m-gram) that followed it:

* `ngram-simple`: the most recent earlier occurrence of the key; draft what followed it.
* `ngram-map-k`: an incrementally built hash map key -> positions; draft the m-gram after the
  most recent occurrence only when at least `min_hits` occurrences were followed by it. The
  accepted length is remembered per key and caps the next draft from that key.
* `ngram-map-k4v`: per key, up to four distinct m-gram values with counts; a value is drafted
  only when it dominates (seen at least `min_hits` times and more than twice as often as any
  other value). As llama.cpp, each (key, value) keeps the accepted length of its last draft
  (its `n_accepted`, m until drafted), which caps the next draft from it; as `ngram-map-k` here,
  that cap is the accepted length plus 2 (llama.cpp's cap can only shrink, and a value whose
  draft was rejected outright would never draft again), and the accepted length is what the
  committed tokens confirm of this drafter's own draft (in a chain the verified draft may be
  another member's).

Indexing is incremental (only new positions each step), so a step costs O(new tokens + m).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from tokenleap.drafters.base import Draft, DraftRequest, StatelessDrafter
from tokenleap.drafters.methods import MethodRecord, option, options_of
from tokenleap.drafters.ngram import longest_suffix_match
from tokenleap.errors import TokenleapError

if TYPE_CHECKING:
    from tokenleap.drafters.spec import SpecConfig


class NgramSimpleDrafter(StatelessDrafter):
    name: ClassVar[str] = "ngram-simple"

    def __init__(self, size_n: int = 3, size_m: int = 16) -> None:
        self.size_n, self.size_m = size_n, size_m

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        if len(tokens) <= self.size_n or max_tokens <= 0:
            return Draft()
        arr = np.asarray(tokens, dtype=np.int64)
        match = longest_suffix_match(arr, self.size_n, self.size_n)
        if match is None:
            return Draft()
        start = match[0]
        return Draft(arr[start : start + min(self.size_m, max_tokens)].tolist())


@dataclass
class _KeyIndex:
    """Positions right after each n-gram key, built incrementally over a request's tokens."""

    size_n: int
    positions: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    indexed: int = 0  # keys ending before this position are indexed
    last_key: tuple[int, ...] | None = None  # key of the last draft (for acceptance feedback)
    accepted: dict[tuple[int, ...], int] = field(default_factory=dict)

    def update(self, tokens: Sequence[int]) -> None:
        n = self.size_n
        # a key ending at e (exclusive) is indexed once a token follows it: e <= len - 1
        for end in range(max(self.indexed, n), len(tokens)):
            self.positions.setdefault(tuple(tokens[end - n : end]), []).append(end)
        self.indexed = max(self.indexed, len(tokens))


# a key's (or value's) next draft may run this far past what was accepted from its last one
_REACH_PAST_ACCEPTED = 2


class NgramMapKDrafter:
    name: ClassVar[str] = "ngram-map-k"
    needs_hidden_states: ClassVar[bool] = False
    DEFAULT_MIN_HITS: ClassVar[int] = 1  # llama.cpp's default

    def __init__(self, size_n: int = 3, size_m: int = 16, min_hits: int = DEFAULT_MIN_HITS) -> None:
        self.size_n, self.size_m, self.min_hits = size_n, size_m, min_hits
        self._index: dict[str, _KeyIndex] = {}

    def begin(self, request: DraftRequest) -> None:
        self._index[request.request_id] = _KeyIndex(self.size_n)

    def _candidates(self, idx: _KeyIndex, tokens: Sequence[int]) -> tuple[tuple[int, ...], list[int]] | None:
        if len(tokens) <= self.size_n:
            return None
        idx.update(tokens)
        key = tuple(tokens[-self.size_n :])
        starts = idx.positions.get(key)
        return (key, starts) if starts else None

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        idx = self._index[request_id]
        found = self._candidates(idx, tokens)
        if found is None or max_tokens <= 0:
            return Draft()
        key, starts = found
        limit = min(self.size_m, max_tokens)
        if key in idx.accepted:  # drafts from this key were cut short before: draft a bit past that
            limit = min(limit, idx.accepted[key] + _REACH_PAST_ACCEPTED)
        value = tuple(tokens[starts[-1] : starts[-1] + limit])
        hits = sum(1 for s in starts if tuple(tokens[s : s + len(value)]) == value)
        if hits < self.min_hits:
            return Draft()
        idx.last_key = key
        return Draft(list(value))

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        idx = self._index.get(request_id)
        if idx is not None and idx.last_key is not None:
            idx.accepted[idx.last_key] = num_accepted
            idx.last_key = None

    def end(self, request_id: str) -> None:
        self._index.pop(request_id, None)


@dataclass
class _ValueTable:
    """Per key, up to four m-gram values with occurrence counts, and the accepted length of each
    (key, value)'s last draft (llama.cpp's `n_accepted`)."""

    size_n: int
    size_m: int
    values: dict[tuple[int, ...], dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0  # key starts below this are indexed (their m-gram was complete)
    accepted: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = field(default_factory=dict)
    last: tuple[tuple[int, ...], tuple[int, ...], list[int]] | None = None  # key, value, draft in verification

    def update(self, tokens: Sequence[int]) -> None:
        n, m = self.size_n, self.size_m
        last_start = len(tokens) - n - m  # the m-gram after a key starting here is complete
        for start in range(self.indexed, last_start + 1):
            key = tuple(tokens[start : start + n])
            value = tuple(tokens[start + n : start + n + m])
            table = self.values.setdefault(key, {})
            if value in table:
                table[value] += 1
            elif len(table) < 4:
                table[value] = 1
            else:  # replace the rarest value, keeping the slot count at four (a new slot: no statistics)
                rarest = min(table, key=table.__getitem__)
                del table[rarest]
                self.accepted.pop((key, rarest), None)
                table[value] = 1
        self.indexed = max(self.indexed, last_start + 1)


class NgramMapK4VDrafter:
    name: ClassVar[str] = "ngram-map-k4v"
    needs_hidden_states: ClassVar[bool] = False
    DEFAULT_MIN_HITS: ClassVar[int] = 2  # a value seen once does not yet dominate (llama.cpp: 1; its docs' example: 2)

    def __init__(self, size_n: int = 3, size_m: int = 8, min_hits: int = DEFAULT_MIN_HITS) -> None:
        self.size_n, self.size_m, self.min_hits = size_n, size_m, min_hits
        self._tables: dict[str, _ValueTable] = {}

    def begin(self, request: DraftRequest) -> None:
        self._tables[request.request_id] = _ValueTable(self.size_n, self.size_m)

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        table = self._tables[request_id]
        table.last = None
        if len(tokens) <= self.size_n or max_tokens <= 0:
            return Draft()
        table.update(tokens)
        key = tuple(tokens[-self.size_n :])
        values = table.values.get(key)
        if not values:
            return Draft()
        ranked = sorted(values.items(), key=lambda kv: kv[1], reverse=True)
        best, count = ranked[0]
        runner_up = ranked[1][1] if len(ranked) > 1 else 0
        if count < self.min_hits or count <= 2 * runner_up:
            return Draft()
        limit = max_tokens
        if (key, best) in table.accepted:  # its last draft was cut short: draft a bit past that
            limit = min(limit, table.accepted[key, best] + _REACH_PAST_ACCEPTED)
        draft = list(best[:limit])
        table.last = (key, best, draft)
        return Draft(draft)

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        table = self._tables.get(request_id)
        if table is None or table.last is None:
            return
        key, value, draft = table.last
        table.last = None
        confirmed = next((i for i, (d, t) in enumerate(zip(draft, tokens)) if d != t), min(len(draft), len(tokens)))
        table.accepted[key, value] = min(num_accepted, confirmed)

    def end(self, request_id: str) -> None:
        self._tables.pop(request_id, None)


def ngram_size_n_option(own_flags: tuple[str, ...] = ()) -> Any:
    """`ngram_size_n`, the key length every llama.cpp n-gram type has (`--spec-ngram-size-n`, and
    the type's own spelling of current llama.cpp: `--spec-ngram-map-k-size-n`, ...)."""
    return option(3, help="n-gram key length", flags=("--spec-ngram-size-n",), own_flags=own_flags, request_max=64)


def _size_m_option(own_flags: tuple[str, ...]) -> Any:
    return option(16, help="m-gram draft length", flags=("--spec-ngram-size-m",), own_flags=own_flags, request_max=64)


@dataclass(frozen=True)
class NgramSimpleOptions:
    """ngram-simple's options: the key length n and the drafted m-gram length m."""

    ngram_size_n: int = ngram_size_n_option(("--spec-ngram-simple-size-n",))
    ngram_size_m: int = _size_m_option(("--spec-ngram-simple-size-m",))

    def __post_init__(self) -> None:
        if self.ngram_size_n < 1 or self.ngram_size_m < 1:
            raise TokenleapError(
                f"ngram_size_n and ngram_size_m must be >= 1, got {self.ngram_size_n} and {self.ngram_size_m}"
            )


_MIN_HITS_HELP = "occurrences a key's m-gram needs before it is drafted"


@dataclass(frozen=True)
class NgramMapKOptions(NgramSimpleOptions):
    """ngram-map-k's options: n, m and the occurrences a value needs (`min_hits`)."""

    ngram_size_n: int = ngram_size_n_option(("--spec-ngram-map-k-size-n",))
    ngram_size_m: int = _size_m_option(("--spec-ngram-map-k-size-m",))
    ngram_min_hits: int = option(
        NgramMapKDrafter.DEFAULT_MIN_HITS,
        help=_MIN_HITS_HELP,
        flags=("--spec-ngram-min-hits",),
        own_flags=("--spec-ngram-map-k-min-hits",),
        request_max=1024,
    )

    def __post_init__(self) -> None:
        if self.ngram_size_n < 1 or self.ngram_size_m < 1 or self.ngram_min_hits < 1:
            raise TokenleapError(
                f"ngram_size_n, ngram_size_m and ngram_min_hits must be >= 1, "
                f"got {self.ngram_size_n}, {self.ngram_size_m}, {self.ngram_min_hits}"
            )


@dataclass(frozen=True)
class NgramMapK4VOptions(NgramMapKOptions):
    """ngram-map-k4v's options: those of ngram-map-k, with its own default min hits."""

    ngram_size_n: int = ngram_size_n_option(("--spec-ngram-map-k4v-size-n",))
    ngram_size_m: int = _size_m_option(("--spec-ngram-map-k4v-size-m",))
    ngram_min_hits: int = option(
        NgramMapK4VDrafter.DEFAULT_MIN_HITS,
        help=_MIN_HITS_HELP,
        flags=("--spec-ngram-min-hits",),
        own_flags=("--spec-ngram-map-k4v-min-hits",),
        request_max=1024,
    )


def llamacpp_shared(registry: Any) -> dict[str, Any]:
    """What the llama.cpp n-gram types' drafters of one registry share: one ngram-cache
    statistics table per (n_max, bound) (ngram-mod's pools: `ngram_mod.pools_shared`)."""
    return {"dynamic": {}}


def _simple(config: SpecConfig, **_: Any) -> NgramSimpleDrafter:
    opts = options_of(config, "ngram-simple", NgramSimpleOptions)
    return NgramSimpleDrafter(opts.ngram_size_n, opts.ngram_size_m)


def _map_k(config: SpecConfig, **_: Any) -> NgramMapKDrafter:
    opts = options_of(config, "ngram-map-k", NgramMapKOptions)
    return NgramMapKDrafter(opts.ngram_size_n, opts.ngram_size_m, opts.ngram_min_hits)


def _map_k4v(config: SpecConfig, **_: Any) -> NgramMapK4VDrafter:
    opts = options_of(config, "ngram-map-k4v", NgramMapK4VOptions)
    return NgramMapK4VDrafter(opts.ngram_size_n, opts.ngram_size_m, opts.ngram_min_hits)


SIMPLE = MethodRecord(
    "ngram-simple",
    _simple,
    "llama.cpp's ngram-simple: the m tokens after the last earlier match of the last n",
    options=NgramSimpleOptions,
    shared=llamacpp_shared,
)
MAP_K = MethodRecord(
    "ngram-map-k",
    _map_k,
    "llama.cpp's ngram-map-k: an n-gram map over the request's history, capped by each key's last accepted length",
    options=NgramMapKOptions,
    shared=llamacpp_shared,
)
MAP_K4V = MethodRecord(
    "ngram-map-k4v",
    _map_k4v,
    "llama.cpp's ngram-map-k4v: up to 4 values per key, capped by each key and value's last accepted length",
    options=NgramMapK4VOptions,
    shared=llamacpp_shared,
)
