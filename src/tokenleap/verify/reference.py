"""Slow, obvious reference for chain verification: a Python loop over draft positions that
follows the speculative-sampling algorithm line by line (Leviathan et al., 2023, Algorithm 1),
used only by tests as the oracle for `tokenleap.verify.chain.verify_chain`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenleap.sampling import SamplingParams, logits_to_probs
from tokenleap.verify.chain import VerifyResult


def verify_chain_reference(
    draft: Sequence[int],
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    k = len(draft)
    out: list[int] = []
    if params.greedy:
        for i in range(k):
            best = int(torch.argmax(target_logits[i]))
            if draft[i] != best:
                return VerifyResult(out + [best], i)
            out.append(draft[i])
        return VerifyResult(out + [int(torch.argmax(target_logits[k]))], k)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64).tolist() if k else []
    for i in range(k):
        p = logits_to_probs(target_logits[i : i + 1], params)[0]
        x = draft[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        else:
            q = draft_probs[i]
        if uniforms[i] * float(q[x]) < float(p[x]):
            out.append(x)
            continue
        residual = torch.clamp(p - q, min=0.0)
        if float(residual.sum()) <= 0.0:
            residual = p
        return VerifyResult(out + [int(torch.multinomial(residual, 1, generator=generator))], i)
    p_last = logits_to_probs(target_logits[k : k + 1], params)[0]
    return VerifyResult(out + [int(torch.multinomial(p_last, 1, generator=generator))], k)


def verify_tree_reference(
    tokens: Sequence[int], parents: Sequence[int], target_logits: torch.Tensor
) -> tuple[list[int], list[int]]:
    """Greedy tree verification by brute force: verify every root-to-leaf path as a chain (with
    the target rows along it) and keep the longest acceptance (on ties, the accepted path whose
    node indices come first lexicographically). Returns (committed tokens, accepted path)."""
    n = len(tokens)
    inner = set(parents)
    leaves = [i for i in range(n) if i not in inner]
    best_tokens: list[int] = [int(torch.argmax(target_logits[0]))]
    best_path: list[int] = []
    for leaf in leaves:
        path: list[int] = []
        node = leaf
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        rows = target_logits[[0] + [i + 1 for i in path]]
        result = verify_chain_reference(
            [tokens[i] for i in path], rows, SamplingParams(temperature=0.0), torch.Generator()
        )
        accepted = path[: result.num_accepted]
        if len(accepted) > len(best_path) or (len(accepted) == len(best_path) and accepted < best_path):
            best_tokens, best_path = result.tokens, accepted
    return best_tokens, best_path


def verify_tree_sampled_reference(
    tokens: Sequence[int],
    parents: Sequence[int],
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> tuple[list[int], list[int]]:
    """Sampled tree verification written out with Python floats, one token at a time: at each
    node try the children in order, accepting child c with probability min(1, p(x) / q(x));
    after a rejection replace p by max(0, p - q) renormalised (q one-hot on x for a
    deterministic draft); descend into an accepted child with the target's distribution there;
    when no child is accepted draw the last token from p by walking its cumulative sum. Draws
    `n + 1` uniforms up front like `verify_tree_sampled`. Returns (committed tokens, path)."""
    n = len(tokens)
    uniforms = torch.rand(n + 1, generator=generator, dtype=torch.float64).tolist()
    path: list[int] = []
    node = -1
    while True:
        p = [float(v) for v in logits_to_probs(target_logits[node + 1 : node + 2], params)[0].tolist()]
        accepted = None
        for c in range(n):
            if parents[c] != node:
                continue
            x = tokens[c]
            if draft_probs is None:
                q = [0.0] * len(p)
                q[x] = 1.0
            else:
                q = [float(v) for v in draft_probs[c].tolist()]
            if (uniforms[c] < min(1.0, p[x] / q[x])) if q[x] > 0 else (p[x] > 0):
                accepted = c
                break
            residual = [max(0.0, a - b) for a, b in zip(p, q)]
            total = sum(residual)
            if total > 0.0:
                p = [r / total for r in residual]
        if accepted is None:
            total = sum(p)
            target, running, last = uniforms[n] * total, 0.0, None
            for token, mass in enumerate(p):
                if mass > 0.0:
                    last = token
                    running += mass
                    if running > target:
                        break
            assert last is not None
            return [tokens[i] for i in path] + [last], path
        path.append(accepted)
        node = accepted
