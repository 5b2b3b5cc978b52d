"""Greedy verification of a token tree (SpecInfer, Miao et al., 2024; the tree attention of
Medusa, Cai et al., 2024).

A tree draft is tokens with parents (`parents[i]` < i, -1 for a child of the last committed
token). The target scores every node in one forward under a tree mask (each node attends to
the cache and its own ancestors, `tokenleap.attention.tree_mask`), so row i+1 of the logits is
the target's prediction after node i's path (row 0: after the last committed token). Greedy
verification follows the target: from the root, step to a child whose token is the target's
argmax, as deep as that goes; the committed tokens are that path plus the target's argmax after
it. When siblings repeat a token, the deepest continuation wins (on ties the path whose node
indices come first), so the result is the longest accepted root path, as a chain verifier would find on each
path separately (`tokenleap.verify.reference.verify_tree_reference`). Sampled requests verify
a tree in `tokenleap.verify.tree_sampling` (every branch, lossless), or reduced to its first root
path (`sampled_tree="first-path"`, also lossless).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeVerifyResult:
    tokens: list[int]  # the accepted path's tokens + the target's next token
    num_accepted: int
    path: list[int]  # node indices of the accepted path, root first


def check_parents(parents: Sequence[int], n: int) -> None:
    """Raise ValueError unless `parents` describes a tree over n nodes in topological order."""
    if len(parents) != n:
        raise ValueError(f"a tree draft of {n} tokens needs {n} parents, got {len(parents)}")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree parents must precede their children: node {i} has parent {p}")


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 1 for children of the last committed token."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def first_path(parents: Sequence[int]) -> list[int]:
    """The root path that takes the first child at every level (the chain a tree reduces to)."""
    path, cur = [], -1
    for i, p in enumerate(parents):
        if p == cur:
            path.append(i)
            cur = i
    return path


def verify_tree_greedy(tokens: Sequence[int], parents: Sequence[int], target_logits: torch.Tensor) -> TreeVerifyResult:
    """`target_logits` `[n + 1, V]`: row 0 after the last committed token, row i + 1 after node i."""
    n = len(tokens)
    check_parents(parents, n)
    if target_logits.shape[0] != n + 1:
        raise ValueError(f"need {n + 1} target rows for a tree of {n}, got {target_logits.shape[0]}")
    target = target_logits.argmax(dim=-1).tolist()
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    # depth-first, children in node order, over nodes that match the target: the deepest
    # accepted path, the lexicographically first on ties
    best: list[int] = []
    stack: list[tuple[int, list[int]]] = [(-1, [])]
    while stack:
        node, path = stack.pop()
        if len(path) > len(best):
            best = path
        row = node + 1
        matches = [c for c in children.get(node, []) if tokens[c] == target[row]]
        stack.extend((c, path + [c]) for c in reversed(matches))
    last_row = best[-1] + 1 if best else 0
    return TreeVerifyResult([tokens[i] for i in best] + [target[last_row]], len(best), best)
