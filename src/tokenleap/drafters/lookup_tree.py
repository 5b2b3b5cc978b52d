"""Prompt lookup as a token tree (method "ngram-tree"): the continuations of several earlier
occurrences of the context's last n tokens merged into one tree, as in `benchmarks/tree_sim.py`
(the replay that measured it) and the multi-candidate lookups of REST (He et al., 2024) and
SpecInfer's token trees (Miao et al., 2024).

Occurrences are taken for n from `prompt_lookup_max` down to `prompt_lookup_min`, most recent
first, at most 8 per n. The first continuation gets 5/8 of the node budget as the main
branch; each later one adds a short branch (`alt` tokens) where it departs from the tree built
so far, sharing the prefix it has in common (so siblings are always distinct tokens). The tree
holds at most `max_tokens` nodes. Greedy requests verify it with `verify_tree_greedy`, sampled
ones with the lossless multi-candidate walk of `verify/tree_sampling.py` (deterministic
siblings).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from tokenleap.drafters.base import Draft, StatelessDrafter
from tokenleap.drafters.methods import MethodRecord, options_of
from tokenleap.drafters.ngram import NgramOptions

if TYPE_CHECKING:
    from tokenleap.drafters.spec import SpecConfig


def occurrences(context: np.ndarray, n_min: int, n_max: int, per_n: int = 8) -> list[int]:
    """Starts of the continuations after earlier occurrences of the context's last n tokens, for
    n from n_max down to n_min, most recent first (at most `per_n` per n, no repeats)."""
    length, found = len(context), []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], n)
        hits = np.flatnonzero((windows == context[length - n :]).all(axis=1))
        found += [int(h) + n for h in hits[::-1][:per_n] if int(h) + n not in found]
    return found


def build_tree(
    context: np.ndarray, starts: Sequence[int], budget: int, main: int, alt: int, branches: int
) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the tree merging the continuations at `starts`: the first `main`
    tokens long, the others `alt`, at most `branches` new branches and `budget` nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[int, dict[int, int]] = {}
    used = 0
    for i, start in enumerate(starts):
        parent, opened = -1, False
        for t in context[start : start + (main if i == 0 else alt)].tolist():
            if len(tokens) >= budget:
                break
            kids = children.setdefault(parent, {})
            if t in kids:
                parent = kids[t]
                continue
            if i > 0 and not opened:
                if used >= branches:
                    break
                used, opened = used + 1, True
            tokens.append(int(t))
            parents.append(parent)
            kids[t] = parent = len(tokens) - 1
        if len(tokens) >= budget:
            break
    return tokens, parents


class LookupTreeDrafter(StatelessDrafter):
    name: ClassVar[str] = "ngram-tree"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or len(tokens) < 2:
            return Draft()
        arr = np.asarray(tokens, dtype=np.int64)
        starts = occurrences(arr, self.n_min, self.n_max)
        if not starts:
            return Draft()
        main = max(1, (5 * max_tokens) // 8)  # tree_sim.py's shapes: 8 nodes -> 5 on the main branch
        alt = 2 if max_tokens < 16 else 3
        draft, parents = build_tree(arr, starts, max_tokens, main, alt, branches=max(1, max_tokens // 2))
        return Draft(draft, parents)


def _build(config: SpecConfig, **_: Any) -> LookupTreeDrafter:
    opts = options_of(config, "ngram-tree", NgramOptions)
    return LookupTreeDrafter(opts.prompt_lookup_min, opts.prompt_lookup_max)


METHOD = MethodRecord(
    "ngram-tree",
    _build,
    "prompt lookup as a token tree: the continuations of up to 8 earlier occurrences per suffix length merged",
    options=NgramOptions,
    doc=(
        "prompt lookup as a token tree: the continuations of up to 8 earlier occurrences per suffix length merged "
        "(`drafters/lookup_tree.py`)"
    ),
)
