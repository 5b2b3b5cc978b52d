"""benchmarks/tree_sim.py: chain and tree drafts from earlier occurrences, and the replay's counting."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest


@pytest.fixture(scope="module")
def tree_sim(load_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return load_benchmark("tree_sim")


def test_tree_holds_every_continuation_the_chain_misses(tree_sim: ModuleType) -> None:
    # "1 2" was followed by 3 (long ago) and by 4 (recently); the context ends in "1 2"
    context = np.array([1, 2, 3, 9, 9, 1, 2, 4, 8, 7, 1, 2])
    chain = tree_sim.chain(context, 3)
    assert [t for t, _ in chain] == [4, 8, 7] and [p for _, p in chain] == [-1, 0, 1]
    tree = tree_sim.tree(context, budget=6, main=3, alt=2, branches=2)
    roots = {t for t, p in tree if p == -1}
    assert {3, 4} <= roots and len(tree) <= 6
    assert tree_sim.accepted(chain, [3, 9]) == 0  # the chain bet on the recent continuation
    assert tree_sim.accepted(tree, [3, 9]) == 2  # the tree also holds the older one


def test_replay_counts_one_target_token_per_step(tree_sim: ModuleType) -> None:
    prompt = list(range(100, 130))
    runs = [{"group": "copy", "prompt_ids": prompt, "output_ids": prompt[:20]}]
    result = tree_sim.replay(runs, lambda c: tree_sim.chain(c, 4))
    # step 1: no earlier occurrence of token 129, 1 token; then 4 accepted + 1 per step
    assert result["copy"][0] == pytest.approx(20 / (1 + 4))
