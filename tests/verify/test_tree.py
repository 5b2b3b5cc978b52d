"""Greedy token-tree verification against the brute-force reference, exact cases, bad trees."""

from __future__ import annotations

import random

import pytest
import torch

from tokenleap.verify.reference import verify_tree_reference
from tokenleap.verify.tree import check_parents, first_path, tree_depths, verify_tree_greedy

V = 6


def _logits(targets: list[int]) -> torch.Tensor:
    """Rows whose argmax is targets[i]."""
    x = torch.zeros(len(targets), V)
    x[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    return x


def test_follows_the_target_down_the_matching_branch() -> None:
    # root children: 0 ('1'), 1 ('2'); node 1's children: 2 ('3'), 3 ('4'); node 3's child 4 ('5')
    tokens, parents = [1, 2, 3, 4, 5], [-1, -1, 1, 1, 3]
    # target after root: 2 (node 1); after node 1: 4 (node 3); after node 3: 5 (node 4); after node 4: 0
    targets = [2, 0, 4, 0, 5, 0]
    r = verify_tree_greedy(tokens, parents, _logits(targets))
    assert (r.tokens, r.num_accepted, r.path) == ([2, 4, 5, 0], 3, [1, 3, 4])
    # nothing matches: the target's own token after the last committed one
    r = verify_tree_greedy(tokens, parents, _logits([3, 0, 0, 0, 0, 0]))
    assert (r.tokens, r.num_accepted, r.path) == ([3], 0, [])
    r = verify_tree_greedy([], [], _logits([4]))  # empty draft
    assert (r.tokens, r.num_accepted) == ([4], 0)


def test_repeated_sibling_tokens_take_the_deeper_branch() -> None:
    tokens, parents = [1, 1, 2], [-1, -1, 1]  # node 2 continues the second '1' only
    r = verify_tree_greedy(tokens, parents, _logits([1, 0, 2, 3]))
    assert (r.tokens, r.path) == ([1, 2, 3], [1, 2])


def test_matches_the_brute_force_reference_on_random_trees() -> None:
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(0, 12)
        parents = [rng.randint(-1, i - 1) for i in range(n)]
        tokens = [rng.randrange(3) for _ in range(n)]  # few symbols: many repeats and matches
        logits = torch.randn(n + 1, 3, generator=torch.Generator().manual_seed(rng.randrange(10**6)))
        r = verify_tree_greedy(tokens, parents, logits)
        ref_tokens, ref_path = verify_tree_reference(tokens, parents, logits)
        assert (r.tokens, r.path) == (ref_tokens, ref_path), (tokens, parents)


def test_tree_helpers_and_malformed_trees() -> None:
    assert tree_depths([-1, 0, 0, 1, -1]) == [1, 2, 2, 3, 1]
    assert first_path([-1, 0, 0, 1, -1]) == [0, 1, 3]
    check_parents([-1, 0, 1], 3)
    with pytest.raises(ValueError, match="precede"):
        check_parents([-1, 2, 0], 3)
    with pytest.raises(ValueError, match="needs 2 parents"):
        verify_tree_greedy([1, 2], [-1], _logits([0, 0, 0]))
    with pytest.raises(ValueError, match="target rows"):
        verify_tree_greedy([1], [-1], _logits([0]))
