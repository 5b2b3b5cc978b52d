"""Typical acceptance (Medusa, Cai et al., 2024, section 2.3.1): a LOSSY verifier for sampled
requests, used only when a speculative config opts in with `acceptance="typical-lossy"`.

A draft node with token x is acceptable when the target's processed distribution p at its
parent (penalties, temperature, min-p, top-k, top-p: `tokenleap.sampling.logits_to_probs`) gives it

    p(x) > min(threshold, alpha * exp(-H(p)))          (H: entropy of p in nats)

(Medusa's `posterior_threshold` 0.09 and `posterior_alpha` 0.3 are the defaults). The deepest
root path whose nodes are all acceptable is kept (on ties, the path whose node indices come
first), and one more token is drawn from p after it. Unlike `verify_chain` /
`verify_tree_sampled`, the output is NOT distributed as the target's: plausible draft tokens
are kept even where the target would rarely have chosen them, trading fidelity for longer
acceptance. Greedy requests never use it.

Randomness: one `torch.rand(1, dtype=float64)` from the request's generator per verification,
the inverse-CDF coin of the last token (`tree_sampling.sample_inverse_cdf`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenleap.sampling import SamplingParams, logits_to_probs
from tokenleap.verify.tree import TreeVerifyResult, check_parents
from tokenleap.verify.tree_sampling import children_of, sample_inverse_cdf

DEFAULT_THRESHOLD = 0.09
DEFAULT_ALPHA = 0.3


def typical_mask(p: torch.Tensor, threshold: float, alpha: float) -> torch.Tensor:
    """`[n, V]` probabilities -> `[n, V]` bool: the tokens typical acceptance would accept."""
    p = p.double()
    logp = torch.where(p > 0, p.log(), torch.zeros_like(p))
    entropy = -(p * logp).sum(dim=-1, keepdim=True)
    bound = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    return p > bound


def verify_tree_typical(
    tokens: Sequence[int],
    parents: Sequence[int] | None,  # None: a chain
    target_logits: torch.Tensor,  # [n + 1, V]
    params: SamplingParams,
    generator: torch.Generator,
    threshold: float = DEFAULT_THRESHOLD,
    alpha: float = DEFAULT_ALPHA,
) -> TreeVerifyResult:
    n = len(tokens)
    parents = list(range(-1, n - 1)) if parents is None else list(parents)
    check_parents(parents, n)
    if target_logits.shape[0] != n + 1:
        raise ValueError(f"need {n + 1} target rows for a draft of {n}, got {target_logits.shape[0]}")
    if params.greedy:
        raise ValueError("typical acceptance is for sampled requests; greedy requests verify exactly")
    p = logits_to_probs(target_logits, params)
    ok = typical_mask(p, threshold, alpha)
    children = children_of(parents)
    best: list[int] = []
    stack: list[tuple[int, list[int]]] = [(-1, [])]
    while stack:  # depth-first, children in node order: the deepest path, the first on ties
        node, path = stack.pop()
        if len(path) > len(best):
            best = path
        good = [c for c in children.get(node, []) if bool(ok[node + 1, int(tokens[c])])]
        stack.extend((c, path + [c]) for c in reversed(good))
    u = float(torch.rand(1, generator=generator, dtype=torch.float64))
    last = sample_inverse_cdf(p[best[-1] + 1 if best else 0], u)
    return TreeVerifyResult([int(tokens[i]) for i in best] + [last], len(best), best)
