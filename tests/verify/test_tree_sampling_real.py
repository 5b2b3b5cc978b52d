"""The tree sampler on the real model's distributions (temperature 0.7, top-p 0.95): one
forward scores a token tree built from the target's likely tokens; thousands of verifications
of it give a first token distributed as plain sampling's p0 and, after an accepted child, a
second token distributed as the target's next distribution there (chi-squared); a verifier
that draws the last token from p instead of the residual fails the same test."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tokenleap import LLM
from tokenleap.attention import tree_mask
from tokenleap.models.llama import SeqInput
from tokenleap.sampling import SamplingParams, logits_to_probs
from tokenleap.verify.tree import TreeVerifyResult
from tokenleap.verify.tree_sampling import children_of, verify_tree_sampled

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0.7, top_p=0.95)
T1 = SamplingParams(temperature=1.0)
N = 12_000
QUESTION = [{"role": "user", "content": "Name a colour and describe a fruit of that colour in one sentence."}]


def _tree_logits(llm: LLM, ids: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
    model = llm.model
    kv = model.new_kv_cache(len(ids) + len(tokens) + 8)
    try:
        model.forward(torch.tensor(ids[:-1]), torch.arange(len(ids) - 1), kv)
        pos = len(ids) - 1
        depth = {-1: 0}
        for i, p in enumerate(parents):
            depth[i] = depth[p] + 1
        rows = [-1] + [p + 1 for p in parents]
        seq = SeqInput(
            torch.tensor([ids[-1], *tokens]),
            torch.tensor([pos, *(pos + depth[i] for i in range(len(tokens)))]),
            kv,
            tree_mask(rows, pos),
        )
        return model.compute_logits(model.forward_batch([seq]).hidden).float()
    finally:
        kv.free()


def _stale_residual(
    tokens: Sequence[int],
    parents: Sequence[int],
    logits: torch.Tensor,
    params: SamplingParams,
    gen: torch.Generator,
    q: torch.Tensor | None = None,
) -> TreeVerifyResult:
    """Wrong on purpose: after rejecting every child, the last token comes from p itself."""
    kids, node, path = children_of(parents), -1, []
    while True:
        p0 = logits_to_probs(logits[node + 1 : node + 2], params)[0].double()
        p = p0
        for c in kids.get(node, []):
            if float(torch.rand((), generator=gen, dtype=torch.float64)) < float(p[tokens[c]]):
                path.append(c)
                node = c
                break
            p = p.clone()
            p[tokens[c]] = 0.0
            p = p / p.sum()
        else:
            return TreeVerifyResult(
                [tokens[i] for i in path] + [int(torch.multinomial(p0, 1, generator=gen))], len(path), path
            )


def _pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    if counts[probs == 0].sum() > 0:
        return 0.0
    counts, probs = counts[probs > 0], probs[probs > 0]
    exp = probs / probs.sum() * counts.sum()
    keep = exp >= 5
    obs_k, exp_k = counts[keep], exp[keep]
    if (~keep).any() and exp[~keep].sum() > 0:
        obs_k, exp_k = np.append(obs_k, counts[~keep].sum()), np.append(exp_k, exp[~keep].sum())
    return float(chisquare(obs_k, exp_k).pvalue)


def test_tree_sampler_on_real_model_distributions(llm: LLM) -> None:
    ids = llm.chat_token_ids(QUESTION) + llm.tokenizer.encode("My colour is")
    p_root = logits_to_probs(_tree_logits(llm, ids, [], [])[:1], PARAMS)[0]
    top = torch.argsort(p_root, descending=True)[:4].tolist()
    assert float(p_root[top[0]]) < 0.9  # a real choice, not a near-certain token
    low = int(torch.nonzero(p_root == 0)[0])  # a token top-p removed
    # roots: 2nd, a masked-out token, 1st, 4th; under the 1st and 2nd: their own top-3 children
    tokens, parents = [top[1], low, top[0], top[3]], [-1, -1, -1, -1]
    first = _tree_logits(llm, ids, tokens, parents)
    for node in (0, 2):
        for t in torch.argsort(logits_to_probs(first[node + 1 : node + 2], PARAMS)[0], descending=True)[:3].tolist():
            tokens.append(int(t))
            parents.append(node)
    logits = _tree_logits(llm, ids, tokens, parents)
    p = logits_to_probs(logits, PARAMS)
    assert torch.allclose(p[0], p_root, atol=1e-5)  # the tree forward's row 0 is plain decoding's distribution
    # verify on the processed distributions restricted to the tokens any row can emit (others
    # have probability 0 everywhere): log p at temperature 1 reproduces p exactly
    support = torch.unique(torch.cat([torch.nonzero(p.sum(dim=0) > 0).flatten(), torch.tensor(tokens)]))
    local = {int(t): i for i, t in enumerate(support.tolist())}
    small = torch.log(p[:, support])
    small_tokens = [local[t] for t in tokens]
    p_small = p[:, support].double().numpy()
    for verifier, lossless in ((verify_tree_sampled, True), (_stale_residual, False)):
        gen = torch.Generator().manual_seed(0)
        n = N if lossless else N // 4
        first_tok = np.zeros(len(support))
        second_after_top0 = np.zeros(len(support))
        for _ in range(n):
            r = verifier(small_tokens, parents, small, T1, gen)
            first_tok[r.tokens[0]] += 1
            if r.path[:1] == [2]:  # the root child holding the likeliest token was accepted
                second_after_top0[r.tokens[1]] += 1
        pv_first = _pvalue(first_tok, p_small[0])
        if lossless:
            assert pv_first >= 1e-3, pv_first
            assert second_after_top0.sum() > 1000
            assert _pvalue(second_after_top0, p_small[3]) >= 1e-3
        else:
            assert pv_first < 1e-3, f"the wrong verifier passed (p={pv_first:.3g})"
