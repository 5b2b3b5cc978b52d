"""Verification of a chain draft against the target's logits (Leviathan et al., 2023; Chen et
al., 2023, "Accelerating LLM decoding with speculative sampling").

Greedy: accept draft tokens while each equals the target argmax at its position, then take the
target argmax (a bonus token when the whole draft passed). Sampling: accept draft token x_i with
probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample the recovered token from
norm(max(0, p_i - q_i)); after a full acceptance sample the bonus token from p_k. A
deterministic drafter has q one-hot, so x_i is accepted with probability p_i(x_i) and the
residual is p_i without x_i. Output tokens are then distributed exactly as the target's.

p is the target distribution after the request's processors (penalties, temperature, min-p, top-k, top-p:
`tokenleap.sampling.logits_to_probs`, the same function plain decoding uses). Uniforms for the
acceptance tests are drawn up front, one per draft token, from the request's generator, so the
vectorized function and the slow reference (`tokenleap.verify.reference`) consume randomness
identically and must agree exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenleap.sampling import SamplingParams, logits_to_probs


@dataclass(frozen=True)
class VerifyResult:
    tokens: list[int]  # committed: accepted draft tokens + one recovered or bonus token
    num_accepted: int  # how many draft tokens passed


def verify_chain(
    draft: Sequence[int],
    target_logits: torch.Tensor,  # [k+1, V] fp32: rows for last committed token + k drafts
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,  # [k, V] q the draft was sampled from; None = one-hot
) -> VerifyResult:
    k = len(draft)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} target rows for a draft of {k}, got {target_logits.shape[0]}")
    if params.greedy:
        target = target_logits.argmax(dim=-1).tolist()
        n = 0
        while n < k and draft[n] == target[n]:
            n += 1
        return VerifyResult(list(draft[:n]) + [target[n]], n)

    p = logits_to_probs(target_logits, params)  # [k+1, V]
    if k == 0:
        return VerifyResult([int(torch.multinomial(p[0], 1, generator=generator))], 0)
    idx = torch.tensor(draft, dtype=torch.long)
    rows = torch.arange(k)
    p_x = p[rows, idx]  # [k]
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64)
    if draft_probs is None:
        accept = uniforms < p_x.double()
    else:
        q_x = draft_probs[rows, idx]
        accept = uniforms * q_x.double() < p_x.double()  # u < p/q without dividing by q
    rejected = (~accept).nonzero()
    n = int(rejected[0]) if len(rejected) else k
    if n == k:
        bonus = int(torch.multinomial(p[k], 1, generator=generator))
        return VerifyResult(list(draft) + [bonus], k)
    residual = p[n].clone()
    if draft_probs is None:
        residual[draft[n]] = 0.0
    else:
        residual = (residual - draft_probs[n]).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:  # p == q exactly: rejection had probability 0
        residual = p[n]
    recovered = int(torch.multinomial(residual, 1, generator=generator))
    return VerifyResult(list(draft[:n]) + [recovered], n)
