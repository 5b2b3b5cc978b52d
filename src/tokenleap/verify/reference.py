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


def verify_tree_reference(tokens: Sequence[int], parents: Sequence[int], target_logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Greedy tree verification by brute force: verify every root-to-leaf path as a chain (with
    the target rows along it) and keep the longest acceptance (on ties, the accepted path whose
    node indices come first lexicographically). Returns (committed tokens, accepted path)."""
    n = len(tokens)
    inner = set(parents)
    leaves = [i for i in range(n) if i not in inner]
    best_tokens: list[int] = [int(torch.argmax(target_logits[0]))]
    best_path: list[int] = []
    for leaf in leaves:
        path, node = [], leaf
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        rows = target_logits[[0] + [i + 1 for i in path]]
        result = verify_chain_reference([tokens[i] for i in path], rows, SamplingParams(temperature=0.0), torch.Generator())
        accepted = path[: result.num_accepted]
        if len(accepted) > len(best_path) or (len(accepted) == len(best_path) and accepted < best_path):
            best_tokens, best_path = result.tokens, accepted
    return best_tokens, best_path
