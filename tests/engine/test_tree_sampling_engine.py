"""Sampled requests with token-tree drafts through the engine (tiny model): the first three
tokens are distributed as plain sampling (chi-squared over many seeds), seeded requests
repeat, and the whole tree is verified (deeper acceptance than the first path)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch

from sampling_stats import fit_pvalue
from tokenleap import SpecConfig
from tokenleap.drafters.base import Draft, StatelessDrafter
from tokenleap.engine.engine import Engine
from tokenleap.models.llama import LlamaModel
from tokenleap.sampling import SamplingParams, logits_to_probs
from tokenleap.tokenizer import Tokenizer

PROMPT = [17, 42, 99, 5, 200]
PARAMS = SamplingParams(temperature=1.0, top_k=3, max_tokens=16, ignore_eos=True)  # top-3: 27 outcomes for 3 tokens


def _next_probs(model: LlamaModel, ids: Sequence[int]) -> torch.Tensor:
    kv = model.new_kv_cache(64)
    out = model.forward(torch.tensor(list(ids)), torch.arange(len(ids)), kv)
    logits = model.compute_logits(out.hidden, [len(ids) - 1])
    kv.free()
    return logits_to_probs(logits, PARAMS)[0].double()


class SupportTree(StatelessDrafter):
    """A tree over the target's top-k support (known from plain forwards): at the root, the
    second most likely token, a token outside the support, then the most likely one; under
    each of those two, the support of the next step in reverse order of probability."""

    name = "support-tree"

    def __init__(self, support: dict[tuple[int, ...], list[int]]) -> None:
        self.support = support
        self.calls = 0

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        ctx = tuple(tokens[len(PROMPT) :])
        if ctx not in self.support:
            return Draft()
        self.calls += 1
        top = self.support[ctx]
        outside = next(t for t in range(256) if t not in top)
        draft, parents = [top[1], outside, top[0]], [-1, -1, -1]
        for node in (0, 2):
            for t in reversed(self.support.get(ctx + (draft[node],), [])):
                draft.append(t)
                parents.append(node)
        return Draft(draft[:max_tokens], parents[:max_tokens])


def _first_three(engine: Engine, seed: int, spec: SpecConfig | bool = True) -> tuple[tuple[int, ...], int]:
    """Decode until 3 tokens are out (the draft budget is not cut by max_tokens): (tokens, accepted)."""
    req = engine.add_request(PROMPT, dataclasses.replace(PARAMS, seed=seed), speculative=spec)
    try:
        engine.start(req)
        while len(req.output_ids) < 3:
            engine.step(req)
    finally:
        engine.finish(req)
    return tuple(req.output_ids[:3]), req.metrics.spec.num_accepted_tokens


def _exact(model: LlamaModel) -> tuple[dict[tuple[int, ...], list[int]], dict[tuple[int, ...], float]]:
    """Top-k supports after each generated prefix and the exact joint of the first 3 tokens."""
    support: dict[tuple[int, ...], list[int]] = {}
    probs: dict[tuple[int, ...], torch.Tensor] = {}

    def dist(ctx: tuple[int, ...]) -> torch.Tensor:
        if ctx not in probs:
            probs[ctx] = _next_probs(model, PROMPT + list(ctx))
            nz = probs[ctx].nonzero().flatten().tolist()
            support[ctx] = sorted(nz, key=lambda t: -float(probs[ctx][t]))
        return probs[ctx]

    joint: dict[tuple[int, ...], float] = {}
    for a in dist(()).nonzero().flatten().tolist():
        for b in dist((a,)).nonzero().flatten().tolist():
            for c in dist((a, b)).nonzero().flatten().tolist():
                joint[(a, b, c)] = float(dist(())[a] * dist((a,))[b] * dist((a, b))[c])
    return support, joint


def test_first_three_tokens_follow_plain_sampling(tiny_model: LlamaModel, tokenizer: Tokenizer) -> None:
    support, joint = _exact(tiny_model)
    assert len(joint) == 27 and abs(sum(joint.values()) - 1) < 1e-6
    drafter = SupportTree(support)
    spec = SpecConfig(method="custom", drafter=drafter, adaptive=False, num_speculative_tokens=9)
    engine = Engine(tiny_model, tokenizer, spec=spec, drafter=drafter)
    cells = sorted(joint)
    counts = dict.fromkeys(cells, 0)
    accepted = 0
    n = 2000
    for seed in range(n):
        out, acc = _first_three(engine, seed)
        assert out in counts, f"an impossible output {out}"
        counts[out] += 1
        accepted += acc
    pvalue, report = fit_pvalue(counts, joint)
    assert pvalue >= 1e-3, report
    # the tree was verified as a tree: the first root child is not the likeliest token, yet
    # most first steps accept a token, often two (a first-path-only verifier gets far fewer)
    assert drafter.calls >= n and accepted / n > 1.2, accepted / n


def _accepted(engine: Engine, spec: SpecConfig, seeds: range) -> float:
    return sum(_first_three(engine, seed, spec)[1] for seed in seeds) / len(seeds)


def test_full_tree_accepts_more_than_first_path_and_seeds_repeat(tiny_model: LlamaModel, tokenizer: Tokenizer) -> None:
    support, _ = _exact(tiny_model)
    drafter = SupportTree(support)
    full = SpecConfig(method="custom", drafter=drafter, adaptive=False, num_speculative_tokens=9)
    first = SpecConfig(
        method="custom", drafter=drafter, adaptive=False, num_speculative_tokens=9, sampled_tree="first-path"
    )
    engine = Engine(tiny_model, tokenizer, spec=full, drafter=drafter)
    a_full, a_first = _accepted(engine, full, range(200)), _accepted(engine, first, range(200))
    assert a_full > a_first + 0.3, (a_full, a_first)
    params = dataclasses.replace(PARAMS, seed=7)
    runs = [engine.run(engine.add_request(PROMPT, params)).output_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 16


def test_sampled_tree_config_is_validated() -> None:
    from tokenleap.errors import TokenleapError

    with pytest.raises(TokenleapError, match="sampled_tree must be one of"):
        SpecConfig(method="ngram", sampled_tree="all")
    assert SpecConfig(method="ngram").sampled_tree == "full"


def test_typical_lossy_opt_in_runs_and_leaves_greedy_exact(tiny_model: LlamaModel, tokenizer: Tokenizer) -> None:
    support, _ = _exact(tiny_model)
    drafter = SupportTree(support)
    typical = SpecConfig(
        method="custom", drafter=drafter, adaptive=False, num_speculative_tokens=9, acceptance="typical-lossy"
    )
    engine = Engine(tiny_model, tokenizer, spec=typical, drafter=drafter)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    spec_out = engine.run(engine.add_request(PROMPT, greedy)).output_ids
    assert spec_out == engine.run(engine.add_request(PROMPT, greedy, speculative=False)).output_ids
    # top-3 supports: every drafted support token passes the typical bound, so the first step
    # always accepts two tokens (the lossy rule's point: longer acceptance)
    assert all(_first_three(engine, seed)[1] == 2 for seed in range(20))
