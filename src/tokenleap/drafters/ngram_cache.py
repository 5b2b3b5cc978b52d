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
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from tokenleap.drafters.base import Draft, DraftRequest
from tokenleap.errors import TokenleapError

Stats = dict[tuple[int, ...], Counter]


def _count(stats: Stats, tokens: Sequence[int], start: int, n_max: int) -> None:
    """Add the continuations of every 1..n_max-gram ending before positions start..len-1."""
    for pos in range(max(start, 1), len(tokens)):
        for n in range(1, min(n_max, pos) + 1):
            stats[tuple(tokens[pos - n : pos])][tokens[pos]] += 1


class NgramCacheDrafter:
    name: ClassVar[str] = "ngram-cache"
    needs_hidden_states: ClassVar[bool] = False

    def __init__(self, n_max: int = 4, min_count: int = 1, min_share: float = 0.5, static_path: str | None = None) -> None:
        self.n_max, self.min_count, self.min_share = n_max, min_count, min_share
        self.dynamic: Stats = defaultdict(Counter)
        self.static: Stats = load_stats(Path(static_path)) if static_path else {}
        self._context: dict[str, tuple[Stats, int]] = {}  # request -> (stats, tokens counted)
        self._tokens: dict[str, list[int]] = {}

    def begin(self, request: DraftRequest) -> None:
        self._context[request.request_id] = (defaultdict(Counter), 0)

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
        levels = (self._update(request_id, tokens), self.dynamic, self.static)
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
        tokens = self._tokens.pop(request_id, None)
        if tokens:
            _count(self.dynamic, tokens, 1, self.n_max)

    def save(self, path: str | Path) -> None:
        """Write the dynamic statistics (merged with the static ones) to `path`."""
        merged: Stats = defaultdict(Counter)
        for stats in (self.static, self.dynamic):
            for key, counts in stats.items():
                merged[key].update(counts)
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
        stats: Stats = defaultdict(Counter)
        for *key, tok, count in raw["entries"]:
            stats[tuple(int(t) for t in key)][int(tok)] += int(count)
    except (ValueError, KeyError, TypeError) as exc:
        raise TokenleapError(f"{path} is not a valid n-gram cache file: {exc}") from exc
    return stats
