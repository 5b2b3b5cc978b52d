"""benchmarks/tree_sampling.py: the prompts cycle through the groups and the compared configs
differ only in how a sampled request verifies the tree."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from tokenleap.bench import default_spec_bench


def test_questions_and_methods(load_benchmark: Callable[[str], ModuleType]) -> None:
    bench = load_benchmark("tree_sampling")
    qs = bench.pick_questions(default_spec_bench(), 8)
    assert len(qs) == 8 and all(len(q.turns) == 1 for q in qs)
    groups = [q.group for q in qs]
    assert len(set(groups[:6])) == 6  # one per group before any repeats
    m = bench.methods(8)
    assert m["ngram-tree"].sampled_tree == "full" and m["ngram-tree/first-path"].sampled_tree == "first-path"
    assert m["ngram-tree"].method == m["ngram-tree/first-path"].method == "ngram-tree"
