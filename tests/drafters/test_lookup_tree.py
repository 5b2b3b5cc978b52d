"""Prompt lookup as a token tree ("ngram-tree"): the tree merges continuations of several
earlier occurrences, siblings are distinct, the node budget holds, and the engine verifies it."""

from __future__ import annotations

import numpy as np

from tokenleap import SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.drafters.lookup_tree import LookupTreeDrafter, build_tree, occurrences
from tokenleap.verify.tree import check_parents


def test_occurrences_longest_suffix_first_most_recent_first() -> None:
    ctx = np.array([5, 1, 2, 7, 1, 2, 8, 3, 2, 9, 1, 2])
    # "1 2" occurs at 1 and 4 (continuations at 3 and 6); "2" alone also at 8 (continuation 9)
    assert occurrences(ctx, 1, 4) == [6, 3, 9]


def test_tree_merges_continuations_with_distinct_siblings() -> None:
    ctx = np.array([1, 2, 7, 8, 9, 0, 1, 2, 7, 5, 6, 0, 1, 2, 4, 4, 0, 1, 2])
    starts = occurrences(ctx, 1, 4)
    tokens, parents = build_tree(ctx, starts, budget=8, main=3, alt=2, branches=4)
    check_parents(parents, len(tokens))
    # main branch: the most recent continuation 4 4 0; then 7 5 shares nothing (a new root
    # child) and 7 8 shares "7" (one new node under it)
    assert (tokens, parents) == ([4, 4, 0, 7, 5, 8], [-1, 0, 1, -1, 3, 3])
    for p in set(parents):
        kids = [tokens[i] for i in range(len(tokens)) if parents[i] == p]
        assert len(kids) == len(set(kids))
    small, small_parents = build_tree(ctx, starts, budget=4, main=3, alt=2, branches=4)
    assert len(small) == 4 and small_parents == parents[:4]


def test_drafter_from_registry_proposes_trees_within_budget() -> None:
    drafter = default_registry().create("ngram-tree", SpecConfig(method="ngram-tree"))
    assert isinstance(drafter, LookupTreeDrafter)
    history = [3, 1, 2, 7, 8, 9, 1, 2, 5, 6, 4, 1, 2]
    draft = drafter.propose("r", history, 6)
    assert draft.parents is not None and 1 < len(draft) <= 6 and draft.parents.count(-1) >= 2
    assert drafter.propose("r", [1, 2, 3], 6).tokens == [] and drafter.propose("r", history, 0).tokens == []
