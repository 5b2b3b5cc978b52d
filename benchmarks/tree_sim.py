"""Acceptance-length ceiling of prompt lookup as chains and as token trees, by replay.

Greedy speculative output is the plain greedy output, so how many tokens a draft would get
accepted depends only on that output. This replays, over the plain greedy continuations that
`draft_sim.py` caches (`results/greedy_cache.json`; run it first), two ways of drafting from
earlier occurrences of the context's last 1-4 tokens, with free verification and no adaptive
shortening:

* chain k: prompt lookup (the most recent occurrence of the longest matching suffix), k tokens;
* tree n: a token tree of at most n nodes merging the continuations of up to 8 occurrences per
  suffix length, longest suffix and most recent first (the first continuation gets `main`
  tokens, each other branch `alt` tokens, at most `branches` branches).

It prints the mean acceptance length (tokens per target forward) per group and the mean number
of draft nodes per step. Used to bound what model-free drafts can reach (BENCHMARKS.md,
summarization).

    .venv/bin/python benchmarks/draft_sim.py -q 8 -n 128 --k 8   # once, writes the cache
    .venv/bin/python benchmarks/tree_sim.py
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent
Node = tuple[int, int]  # (token, parent index; -1 = child of the last committed token)


def occurrences(context: np.ndarray, n_min: int = 1, n_max: int = 4, per_n: int = 8) -> list[int]:
    """Starts of continuations after earlier occurrences of the context's last n tokens, for n
    from n_max down to n_min, most recent first (at most per_n per n)."""
    length, found = len(context), []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], n)
        hits = np.flatnonzero((windows == context[length - n :]).all(axis=1))
        found += [int(h) + n for h in hits[::-1][:per_n]]
    return found


def chain(context: np.ndarray, k: int) -> list[Node]:
    starts = occurrences(context, per_n=1)
    if not starts:
        return []
    return [(int(t), i - 1) for i, t in enumerate(context[starts[0] : starts[0] + k])]


def tree(context: np.ndarray, budget: int, main: int, alt: int, branches: int) -> list[Node]:
    nodes: list[Node] = []
    children: dict[int, dict[int, int]] = defaultdict(dict)
    used = 0
    for i, start in enumerate(occurrences(context)):
        parent, opened = -1, False
        for t in context[start : start + (main if i == 0 else alt)].tolist():
            if len(nodes) >= budget:
                break
            if t in children[parent]:
                parent = children[parent][t]
                continue
            if i > 0 and not opened:
                if used >= branches:
                    break
                used, opened = used + 1, True
            nodes.append((t, parent))
            children[parent][t] = parent = len(nodes) - 1
        if len(nodes) >= budget:
            break
    return nodes


def accepted(nodes: Sequence[Node], truth: Sequence[int]) -> int:
    children: dict[int, dict[int, int]] = defaultdict(dict)
    for i, (t, p) in enumerate(nodes):
        children[p].setdefault(t, i)
    node, n = -1, 0
    for t in truth:
        if t not in children[node]:
            break
        node, n = children[node][t], n + 1
    return n


def replay(runs: Sequence[dict], draft: Callable[[np.ndarray], list[Node]]) -> dict[str, tuple[float, float]]:
    """Per group: (mean acceptance length over prompts, mean draft nodes per step)."""
    per_group: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for run in runs:
        prompt, out = list(run["prompt_ids"]), run["output_ids"]
        i = steps = nodes_total = 0
        while i < len(out):
            nodes = draft(np.asarray(prompt + out[:i], dtype=np.int64))
            i += accepted(nodes, out[i:]) + 1
            steps += 1
            nodes_total += len(nodes)
        per_group[run["group"]].append((len(out) / steps, nodes_total / steps))
    return {g: (statistics.mean(a for a, _ in v), statistics.mean(n for _, n in v)) for g, v in per_group.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--cache", default=str(ROOT / "results/greedy_cache.json"), help="draft_sim.py's greedy cache")
    args = parser.parse_args()
    cache = Path(args.cache)
    if not cache.is_file():
        raise SystemExit(f"error: {cache} not found: run benchmarks/draft_sim.py first")
    runs = json.loads(cache.read_text())["runs"]
    configs: dict[str, Callable[[np.ndarray], list[Node]]] = {
        "chain 8": lambda c: chain(c, 8),
        "chain 16": lambda c: chain(c, 16),
        "tree 8 (main 5, alt 2, 4 branches)": lambda c: tree(c, 8, 5, 2, 4),
        "tree 12 (main 6, alt 2, 6 branches)": lambda c: tree(c, 12, 6, 2, 6),
        "tree 16 (main 8, alt 3, 8 branches)": lambda c: tree(c, 16, 8, 3, 8),
    }
    groups = sorted({r["group"] for r in runs})
    table = Table(title=f"acceptance length / draft nodes per step ({len(runs)} prompts, free verification)")
    table.add_column("draft")
    for g in groups:
        table.add_column(g, justify="right")
    for name, fn in configs.items():
        result = replay(runs, fn)
        table.add_row(name, *(f"{result[g][0]:.2f} / {result[g][1]:.1f}" for g in groups))
    Console().print(table)


if __name__ == "__main__":
    main()
