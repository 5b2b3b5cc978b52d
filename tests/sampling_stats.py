"""Helpers for the engine-level chi-squared tests: the exact joint distribution of a request's
first tokens, sampling them through an engine, and the goodness-of-fit p-value."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch
from scipy.stats import chisquare

from tokenleap.engine.engine import Engine
from tokenleap.sampling import SamplingParams


def exact_joint(next_probs: Callable[[list[int]], torch.Tensor]) -> dict[tuple[int, int, int], float]:
    """P(first three tokens) from `next_probs(generated so far) -> [V]` (a small support)."""
    joint: dict[tuple[int, int, int], float] = {}
    p0 = next_probs([])
    for a in p0.nonzero().flatten().tolist():
        p1 = next_probs([a])
        for b in p1.nonzero().flatten().tolist():
            p2 = next_probs([a, b])
            for c in p2.nonzero().flatten().tolist():
                joint[(a, b, c)] = float(p0[a] * p1[b] * p2[c])
    return joint


def first_three(
    engine: Engine, prompt: Sequence[int], params: SamplingParams, seed: int
) -> tuple[tuple[int, ...], int]:
    """Decode a seeded request until 3 tokens are out: (those tokens, draft tokens accepted)."""
    req = engine.add_request(list(prompt), dataclasses.replace(params, seed=seed))
    try:
        engine.start(req)
        while len(req.output_ids) < 3:
            engine.step(req)
    finally:
        engine.finish(req)
    return tuple(req.output_ids[:3]), req.metrics.spec.num_accepted_tokens


def fit_pvalue(counts: dict[tuple[int, ...], int], joint: dict[tuple[int, ...], float]) -> tuple[float, str]:
    """Chi-squared p-value of `counts` against `joint` (cells expecting < 5 pooled), and a report."""
    n = sum(counts.values())
    cells = sorted(joint)
    expected = np.array([joint[c] for c in cells]) / sum(joint.values()) * n
    observed = np.array([counts.get(c, 0) for c in cells], dtype=np.float64)
    small = expected < 5
    obs, exp = observed[~small], expected[~small]
    if small.any():
        obs, exp = np.append(obs, observed[small].sum()), np.append(exp, expected[small].sum())
    pvalue = float(chisquare(obs, exp).pvalue)
    return pvalue, f"p={pvalue:.3g}\nobserved {obs.tolist()}\nexpected {exp.round(1).tolist()}"
