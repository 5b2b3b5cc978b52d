"""llama.cpp's `ngram-cache` (lookup decoding with n-gram statistics, llama.cpp PRs #5479,
#6828): counts of which token followed each 1..4-gram, kept at three levels:

* context: the current request's prompt and output;
* dynamic: merged from every finished request of this engine;
* static: loaded read-only from a file (for example statistics of a corpus, or of earlier runs
  saved with `save`).

Drafting repeatedly picks the next token from the longest n-gram with enough evidence, asking
the context statistics first, then dynamic, then static; a token is drafted only when it holds
at least `min_share` of its n-gram's continuations and was seen `min_count` times. The file is
JSON: `{"format": "tokenleap-ngram-cache", "version": 1, "n_max": 4, "entries": [[ngram...,
next, count], ...]}`.

The context and dynamic statistics hold at most `max_entries` (n-gram, next token) pairs each
(`DEFAULT_MAX_ENTRIES`, about 300 bytes a pair in CPython: some 75 MiB when full): past the cap
the least recently updated n-grams are dropped, a sixteenth of the cap at a time, so a
long-running engine keeps the statistics of recent text (llama.cpp's cache is unbounded). The
drafters one registry makes share one dynamic table per (n_max, bound), so several speculative
configs of an engine do not each hold one.

A seeded sampled request (`DraftRequest.request_local`) drafts from its context and the static
file only, never from the dynamic statistics that other requests shape; its tokens still join
them when it ends (see `tokenleap.drafters.base`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import ItemsView, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tokenleap.drafters.base import Draft, DraftRequest
from tokenleap.drafters.methods import MethodRecord, option, options_of
from tokenleap.drafters.ngram_map import llamacpp_shared, ngram_size_n_option
from tokenleap.errors import TokenleapError

if TYPE_CHECKING:
    from tokenleap.drafters.spec import SpecConfig

DEFAULT_MAX_ENTRIES = 1 << 18


class Stats:
    """n-gram -> counts of the tokens that followed it, with at most `max_entries` (n-gram,
    token) pairs (None: unbounded). The table is kept in order of last update, so eviction drops
    the least recently updated n-grams first."""

    def __init__(self, max_entries: int | None = None) -> None:
        if max_entries is not None and max_entries < 1:
            raise TokenleapError(f"ngram-cache max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.num_entries = 0  # (n-gram, token) pairs held
        self._table: dict[tuple[int, ...], Counter[int]] = {}

    def __len__(self) -> int:
        return len(self._table)

    def get(self, key: tuple[int, ...]) -> Counter[int] | None:
        return self._table.get(key)

    def items(self) -> ItemsView[tuple[int, ...], Counter[int]]:
        return self._table.items()

    def add(self, key: tuple[int, ...], token: int, count: int = 1) -> None:
        counts = self._table.pop(key, None)  # re-inserted last: the most recently updated
        if counts is None:
            counts = Counter()
        if token not in counts:
            self.num_entries += 1
        counts[token] += count
        self._table[key] = counts
        if self.max_entries is not None and self.num_entries > self.max_entries:
            self._evict(self.max_entries - self.max_entries // 16)

    def _evict(self, target: int) -> None:
        """Drop the least recently updated n-grams until at most `target` pairs remain."""
        dropped, freed = [], 0
        for key, counts in self._table.items():
            if self.num_entries - freed <= target:
                break
            dropped.append(key)
            freed += len(counts)
        for key in dropped:
            del self._table[key]
        self.num_entries -= freed


def _count(stats: Stats, tokens: Sequence[int], start: int, n_max: int) -> None:
    """Add the continuations of every 1..n_max-gram ending before positions start..len-1."""
    for pos in range(max(start, 1), len(tokens)):
        token = int(tokens[pos])
        for n in range(1, min(n_max, pos) + 1):
            stats.add(tuple(tokens[pos - n : pos]), token)


class NgramCacheDrafter:
    name: ClassVar[str] = "ngram-cache"
    needs_hidden_states: ClassVar[bool] = False

    def __init__(
        self,
        n_max: int = 4,
        min_count: int = 1,
        min_share: float = 0.5,
        static_path: str | None = None,
        max_entries: int | None = DEFAULT_MAX_ENTRIES,
        dynamic: Stats | None = None,
    ) -> None:
        self.n_max, self.min_count, self.min_share = n_max, min_count, min_share
        self.max_entries = max_entries
        self.dynamic = dynamic if dynamic is not None else Stats(max_entries)  # may be shared
        self.static = load_stats(Path(static_path)) if static_path else Stats()
        self._context: dict[str, tuple[Stats, int]] = {}  # request -> (stats, tokens counted)
        self._tokens: dict[str, list[int]] = {}
        self._local: set[str] = set()  # seeded sampled requests: no dynamic statistics

    def begin(self, request: DraftRequest) -> None:
        self._context[request.request_id] = (Stats(self.max_entries), 0)
        if request.request_local:
            self._local.add(request.request_id)

    def _update(self, request_id: str, tokens: Sequence[int]) -> Stats:
        stats, counted = self._context[request_id]
        _count(stats, tokens, counted, self.n_max)
        self._context[request_id] = (stats, len(tokens))
        self._tokens[request_id] = list(tokens)
        return stats

    def _next(self, levels: Sequence[Stats], window: Sequence[int]) -> int | None:
        for n in range(min(self.n_max, len(window)), 0, -1):
            key = tuple(window[-n:])
            for stats in levels:
                counts = stats.get(key)
                if not counts:
                    continue
                tok, c = counts.most_common(1)[0]
                if c >= self.min_count and c >= self.min_share * sum(counts.values()):
                    return tok
        return None

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        context = self._update(request_id, tokens)
        levels = (context, self.static) if request_id in self._local else (context, self.dynamic, self.static)
        window = list(tokens[-self.n_max :])
        draft: list[int] = []
        while len(draft) < max_tokens:
            tok = self._next(levels, window)
            if tok is None:
                break
            draft.append(tok)
            window = (window + [tok])[-self.n_max :]
        return Draft(draft)

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        return None

    def end(self, request_id: str) -> None:
        self._context.pop(request_id, None)
        self._local.discard(request_id)
        tokens = self._tokens.pop(request_id, None)
        if tokens:
            _count(self.dynamic, tokens, 1, self.n_max)

    @property
    def shared_store(self) -> object:
        """What `learn` writes to: the dynamic statistics, shared by the engine's ngram-cache drafters."""
        return self.dynamic

    def learn(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Merge an answer produced elsewhere (another replica) into the dynamic statistics."""
        _count(self.dynamic, [int(t) for t in (*prompt_ids, *output_ids)], 1, self.n_max)

    def save(self, path: str | Path) -> None:
        """Write the dynamic statistics (merged with the static ones) to `path`."""
        merged = Stats()
        for stats in (self.static, self.dynamic):
            for key, counts in stats.items():
                for token, count in counts.items():
                    merged.add(key, token, count)
        save_stats(Path(path), merged, self.n_max)


def save_stats(path: Path, stats: Stats, n_max: int) -> None:
    entries = [[*key, tok, c] for key, counts in stats.items() for tok, c in counts.items()]
    path.write_text(json.dumps({"format": "tokenleap-ngram-cache", "version": 1, "n_max": n_max, "entries": entries}))


def load_stats(path: Path) -> Stats:
    if not path.is_file():
        raise TokenleapError(f"n-gram cache file not found: {path}")
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != "tokenleap-ngram-cache":
            raise ValueError("not a tokenleap n-gram cache")
        stats = Stats()
        for *key, tok, count in raw["entries"]:
            stats.add(tuple(int(t) for t in key), int(tok), int(count))
    except (ValueError, KeyError, TypeError) as exc:
        raise TokenleapError(f"{path} is not a valid n-gram cache file: {exc}") from exc
    return stats


@dataclass(frozen=True)
class NgramCacheOptions:
    """ngram-cache's options: the longest n-gram (capped at 4), a static statistics file and the
    bound on the statistics kept per level."""

    ngram_size_n: int = ngram_size_n_option()
    ngram_cache_path: str | None = option(
        None, help="static statistics file to load", flags=("--spec-ngram-cache",), per_request=False
    )
    ngram_cache_max_entries: int = option(
        DEFAULT_MAX_ENTRIES,
        help="(n-gram, token) pairs kept per level, least recently updated dropped",
        flags=("--spec-ngram-cache-max-entries",),
        per_request=False,
    )

    def __post_init__(self) -> None:
        if self.ngram_size_n < 1 or self.ngram_cache_max_entries < 1:
            raise TokenleapError(
                f"ngram_size_n and ngram_cache_max_entries must be >= 1, "
                f"got {self.ngram_size_n} and {self.ngram_cache_max_entries}"
            )


def _build(config: SpecConfig, *, dynamic: dict[tuple[int, int], Stats], **_: Any) -> NgramCacheDrafter:
    # one engine-wide statistics table per (n_max, bound) for a registry's drafters
    opts = options_of(config, "ngram-cache", NgramCacheOptions)
    n_max, bound = min(opts.ngram_size_n, 4), opts.ngram_cache_max_entries
    shared = dynamic.setdefault((n_max, bound), Stats(bound))
    return NgramCacheDrafter(n_max=n_max, static_path=opts.ngram_cache_path, max_entries=bound, dynamic=shared)


METHOD = MethodRecord("ngram-cache", _build, "n-gram statistics of the request, the engine and a static file",
                      options=NgramCacheOptions, shared=llamacpp_shared)
