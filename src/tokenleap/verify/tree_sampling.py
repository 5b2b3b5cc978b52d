"""Lossless verification of a token tree for sampled requests: multi-candidate (recursive)
rejection sampling at every node (SpecInfer, Miao et al., 2024, "multi-step speculative
sampling"; Jeon et al., 2024, "Recursive Speculative Decoding", arXiv 2402.14160; the
deterministic-sibling walk of EAGLE's `evaluate_posterior`).

The walk starts at the last committed token with p = the target's distribution there after the
request's processors (`tokenleap.sampling.logits_to_probs`, the function plain sampling draws
from). At a node with children c_1..c_m (node order), for j = 1..m:

    accept c_j with probability min(1, p_j(x_j) / q_j(x_j))      (x_j = token of c_j)
    on rejection  p_{j+1} = norm(max(0, p_j - q_j))

where q_j is the distribution c_j was drawn from (`draft_probs[c_j]`). On acceptance the walk
descends into c_j with p = the target's distribution after c_j; when every child is rejected,
or the node has none, the last token is drawn from the current p (the residual, or the
target's distribution at a leaf) and the walk ends.

* Deterministic siblings (`draft_probs=None`, every copy drafter): q_j is one-hot on x_j, so
  c_j is accepted with probability p_j(x_j) and p_{j+1} is p_j with x_j zeroed and
  renormalised. A repeated sibling token has p_j(x_j) = 0 and is always rejected.
* Drafted siblings, i.i.d. from q (SpecInfer): every sibling's row is the same q.
* Drafted siblings without replacement (RSD): c_j's row is q with the tokens of c_1..c_{j-1}
  removed and renormalised (`without_replacement_rows`); the same rule applies unchanged.

Why it is exact (induction over j): given the walk reached sibling j, the token the node emits
is distributed as p_j. It emits x_j = y after acceptance with probability
q_j(y) min(1, p_j(y)/q_j(y)) = min(q_j(y), p_j(y)); rejection has probability
sum_y max(0, p_j(y) - q_j(y)), after which the emitted token follows p_{j+1}; the two add up to
p_j(y). This needs only that x_j is drawn from q_j independently of the verifier's coins given
the earlier siblings, which holds for fixed tokens, i.i.d. draws and draws without replacement
alike. The emitted token at each node is thus distributed as the target's, and the walk's
output is a sample of plain decoding, token by token.

Randomness, in a fixed order so a seeded request is reproducible: `torch.rand(n + 1,
dtype=float64)` from the request's generator, once per verification; `u[i]` is node i's
acceptance coin (used when node i is tested, otherwise unused) and `u[n]` picks the last token
by inverse CDF over the final distribution. The slow reference
(`tokenleap.verify.reference.verify_tree_sampled_reference`, Python loops over tokens) draws
the same numbers and must agree. Vectorised over the vocabulary: each residual update is one
tensor op, and target rows are processed only for the nodes the walk visits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenleap.sampling import SamplingParams, logits_to_probs
from tokenleap.verify.tree import TreeVerifyResult, check_parents, verify_tree_greedy


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """Node -> its children in node order (-1: the last committed token)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    return children


def without_replacement_rows(q: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """Rows for siblings drawn from `q` `[V]` without replacement, in order: row j is q with
    tokens[:j] removed and renormalised (the distribution tokens[j] was drawn from)."""
    rows, cur = [], q.double().clone()
    for t in tokens:
        rows.append((cur / cur.sum()).to(q.dtype))
        cur[t] = 0.0
    return torch.stack(rows) if rows else q.new_zeros(0, q.shape[-1])


def sample_inverse_cdf(dist: torch.Tensor, u: float) -> int:
    """The token at which the cumulative mass of `dist` (unnormalised, >= 0) first exceeds
    u * total: a draw from dist / dist.sum() for u ~ U[0, 1)."""
    cdf = torch.cumsum(dist.double(), dim=0)
    total = float(cdf[-1])
    idx = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=torch.float64, device=cdf.device), right=True))
    last = int(torch.nonzero(dist > 0).max())  # rounding at the top end must not pick a zero-mass token
    return min(idx, last)


def _residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """norm(max(0, p - q)), q one-hot on x when None; p itself when nothing is left (p == q:
    the rejection had probability 0)."""
    if q is None:
        r = p.clone()
        r[x] = 0.0
    else:
        r = (p - q.to(p.device, torch.float64)).clamp_min(0.0)
    s = float(r.sum())
    return p if s <= 0.0 else r / s


def verify_tree_sampled(
    tokens: Sequence[int],
    parents: Sequence[int],
    target_logits: torch.Tensor,  # [n + 1, V]: row 0 after the last committed token, row i + 1 after node i
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,  # [n, V]: row i = q node i was drawn from; None = deterministic
) -> TreeVerifyResult:
    """Exact verification of a token tree under sampling (greedy requests: `verify_tree_greedy`)."""
    n = len(tokens)
    check_parents(parents, n)
    if target_logits.shape[0] != n + 1:
        raise ValueError(f"need {n + 1} target rows for a tree of {n}, got {target_logits.shape[0]}")
    if draft_probs is not None and tuple(draft_probs.shape) != (n, target_logits.shape[1]):
        raise ValueError(f"draft_probs must be [{n}, {target_logits.shape[1]}], got {list(draft_probs.shape)}")
    if params.greedy:
        return verify_tree_greedy(tokens, parents, target_logits)
    children = children_of(parents)
    u = torch.rand(n + 1, generator=generator, dtype=torch.float64).tolist()
    path: list[int] = []
    node = -1
    while True:
        p = logits_to_probs(target_logits[node + 1 : node + 2], params)[0].double()
        for c in children.get(node, []):
            x = int(tokens[c])
            q = None if draft_probs is None else draft_probs[c]
            q_x = 1.0 if q is None else float(q[x])
            if u[c] * q_x < float(p[x]):  # u < p/q without dividing by q
                path.append(c)
                node = c
                break
            p = _residual(p, q, x)
        else:
            last = sample_inverse_cdf(p, u[n])
            return TreeVerifyResult([int(tokens[i]) for i in path] + [last], len(path), path)
