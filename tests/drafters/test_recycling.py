"""Token Recycling ("recycling"): the adjacency table's top-k rows from the target's logits, the
breadth-first token tree along the template within the budget, the table shared across requests
and registries' drafters but request-local for seeded sampled requests, a chain forwarding the
logits, and on the real model the engine's hook (prefill row, verified rows) making drafts that
get accepted, greedy output unchanged."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from tokenleap import LLM, SamplingParams, SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.drafters.base import DraftRequest, ReadsLogits
from tokenleap.drafters.chain import ChainDrafter
from tokenleap.drafters.ngram import NgramDrafter
from tokenleap.drafters.recycling import (
    DEFAULT_BRANCHING,
    AdjacencyTable,
    RecyclingOptions,
    TokenRecyclingDrafter,
    build_tree,
    top_candidates,
)
from tokenleap.engine.engine import Engine
from tokenleap.errors import TokenleapError
from tokenleap.verify.tree import check_parents, tree_depths

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, seed=3)
VOCAB = 32


def logits_ranking(rows: Sequence[Sequence[int]], vocab: int = VOCAB) -> torch.Tensor:
    """Logits whose row i ranks rows[i]'s tokens first, in that order (the rest far below)."""
    out = torch.zeros(len(rows), vocab)
    for i, ranked in enumerate(rows):
        for rank, t in enumerate(ranked):
            out[i, t] = 100.0 - rank
    return out


def table_of(rows: dict[int, Sequence[int]], k: int = 4) -> AdjacencyTable:
    table = AdjacencyTable(k)
    table.write(list(rows), np.array([list(r) for r in rows.values()]), VOCAB)
    return table


def begin(drafter: TokenRecyclingDrafter, request_id: str, params: SamplingParams = GREEDY) -> None:
    drafter.begin(DraftRequest(request_id, [1, 2], params, torch.Generator()))


# --------------------------------------------------------------------------- the table


@pytest.mark.parametrize("vocab", [5, 100, 640, 1000, 49152 + 17])
def test_top_candidates_are_torch_topk(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=gen) * 4
    assert torch.equal(top_candidates(logits, 8), torch.topk(logits, min(8, vocab)).indices)
    assert torch.equal(top_candidates(logits[2:5], 3), torch.topk(logits[2:5], min(3, vocab)).indices)  # a view of rows


def test_table_rows_start_empty_and_hold_the_last_write() -> None:
    table = AdjacencyTable(4)
    assert table.children(5, 4) == [] and table.nbytes == 0  # allocated at the first write
    table.write([5, 6], np.array([[1, 2, 3, 4], [7, 8, 9, 10]]), VOCAB)
    assert table.nbytes == VOCAB * 4 * 4
    assert table.children(5, 2) == [1, 2] and table.children(6, 8) == [7, 8, 9, 10]
    assert table.children(7, 4) == [] and table.children(-1, 4) == [] and table.children(VOCAB + 3, 4) == []
    table.write([5], np.array([[11, 12, 13, 14]]), VOCAB)
    assert table.children(5, 4) == [11, 12, 13, 14]
    table.write([40], np.array([[1, 2]]), 48)  # a wider vocabulary grows it; fewer than k columns leave -1
    assert table.children(40, 4) == [1, 2] and table.children(6, 4) == [7, 8, 9, 10]
    sparse = AdjacencyTable(4, dense=False)
    sparse.write([5], np.array([[1, 2, 3, 4]]), VOCAB)
    assert sparse.children(5, 3) == [1, 2, 3] and sparse.children(6, 3) == [] and sparse.nbytes == 0


def test_observe_logits_writes_each_tokens_top_k_first_row_winning() -> None:
    drafter = TokenRecyclingDrafter(topk=3)
    assert isinstance(drafter, ReadsLogits) and drafter.needs_logits and not drafter.needs_hidden_states
    drafter.observe_logits("r", [4, 9, 4], logits_ranking([[1, 2, 3], [5, 6, 7], [8, 9, 10]]))
    assert drafter.table.children(4, 3) == [1, 2, 3]  # row 0's (the committed row), not the later one's
    assert drafter.table.children(9, 3) == [5, 6, 7]
    drafter.observe_logits("r", [4], logits_ranking([[11, 12, 13]]))
    assert drafter.table.children(4, 3) == [11, 12, 13]  # a later step's row replaces it


# --------------------------------------------------------------------------- the tree


def test_tree_grows_breadth_first_along_the_template() -> None:
    table = table_of({1: [2, 3, 4, 5], 2: [6, 7, 8, 9], 3: [10, 11, 12, 13], 6: [14, 15, 16, 17], 7: [18, 19, 20, 21]})
    tokens, parents = build_tree(table, 1, (2, 2, 1), budget=16)
    # depth 0: M[1][:2]; depth 1: M[2][:2], M[3][:2]; depth 2: M[6][:1], M[7][:1] (10 and 11 have no row)
    assert tokens == [2, 3, 6, 7, 10, 11, 14, 18]
    assert parents == [-1, -1, 0, 0, 1, 1, 2, 3]
    check_parents(parents, len(tokens))
    assert all(p < i for i, p in enumerate(parents))
    assert tree_depths(parents) == [1, 1, 2, 2, 2, 2, 3, 3]
    for budget in range(len(tokens) + 1):  # the budget keeps the first nodes: still a tree
        assert build_tree(table, 1, (2, 2, 1), budget) == (tokens[:budget], parents[:budget])
    for p in set(parents):  # siblings are distinct
        kids = [t for t, q in zip(tokens, parents) if q == p]
        assert len(kids) == len(set(kids))


def test_empty_rows_have_no_children() -> None:
    table = table_of({1: [2, 3, 4, 5]})
    assert build_tree(table, 1, (4, 4, 4), 16) == ([2, 3, 4, 5], [-1, -1, -1, -1])
    assert build_tree(table, 9, (4, 4, 4), 16) == ([], [])
    assert build_tree(AdjacencyTable(4), 1, (4,), 16) == ([], [])


def test_propose_drafts_the_tree_from_the_last_token_within_the_budget() -> None:
    drafter = TokenRecyclingDrafter(topk=4, branching=(3, 1))
    begin(drafter, "r")
    assert drafter.propose("r", [1, 2], 8).tokens == []  # nothing observed yet
    drafter.observe_logits("r", [2, 5], logits_ranking([[5, 6, 7, 8], [9, 10, 11, 12]]))
    draft = drafter.propose("r", [1, 2], 8)
    assert (draft.tokens, draft.parents, draft.probs) == ([5, 6, 7, 9], [-1, -1, -1, 0], None)
    assert len(drafter.propose("r", [1, 2], 2)) == 2 and drafter.propose("r", [1, 2], 0).tokens == []
    assert drafter.propose("r", [], 4).tokens == []


# --------------------------------------------------------------------------- sharing and request-local tables


def test_the_table_outlives_requests_but_seeded_sampled_ones_keep_their_own() -> None:
    drafter = TokenRecyclingDrafter(topk=2, branching=(2,))
    begin(drafter, "earlier")
    drafter.observe_logits("earlier", [7], logits_ranking([[8, 9]]))
    drafter.end("earlier")
    begin(drafter, "greedy")
    assert drafter.propose("greedy", [1, 7], 4).tokens == [8, 9]  # the earlier request's row
    begin(drafter, "seeded", SEEDED)
    assert drafter.propose("seeded", [1, 7], 4).tokens == []  # not read by a seeded sampled request
    drafter.observe_logits("seeded", [7, 3], logits_ranking([[10, 11], [12, 13]]))
    assert drafter.propose("seeded", [1, 7], 4).tokens == [10, 11]  # its own rows
    assert drafter.propose("seeded", [1, 4], 4).tokens == []
    assert drafter.propose("greedy", [1, 3], 4).tokens == [12, 13]  # which still feed the shared table
    drafter.end("seeded")
    assert "seeded" not in drafter._local
    begin(drafter, "unseeded", SamplingParams(temperature=0.8))
    assert drafter.propose("unseeded", [1, 7], 4).tokens == [10, 11]


def test_options_and_one_table_per_k_for_a_registry() -> None:
    assert RecyclingOptions().recycling_branching == DEFAULT_BRANCHING == (2, 2, 1)
    assert RecyclingOptions(recycling_branching="3, 1").recycling_branching == (3, 1)
    assert SpecConfig.from_dict(
        {"method": "token-recycling", "recycling_branching": [4, 2, 1]}
    ).options_for().recycling_branching == (4, 2, 1)
    for bad in ("", "x", "0,1", "9", ",".join(["1"] * 33)):
        with pytest.raises(TokenleapError, match="recycling_branching"):
            RecyclingOptions(recycling_branching=bad)
    with pytest.raises(TokenleapError, match="recycling_topk"):
        RecyclingOptions(recycling_topk=0)
    registry = default_registry()
    a = registry.create("recycling", SpecConfig.from_dict({"method": "recycling"}))
    b = registry.create("recycling", SpecConfig.from_dict({"method": "recycling", "recycling_branching": "4,1"}))
    c = registry.create("recycling", SpecConfig.from_dict({"method": "recycling", "recycling_topk": 4}))
    assert (
        isinstance(a, TokenRecyclingDrafter)
        and isinstance(b, TokenRecyclingDrafter)
        and isinstance(c, TokenRecyclingDrafter)
    )
    assert a.table is b.table and a.table is not c.table and b.branching == (4, 1) and c.table.k == 4
    assert default_registry().create("recycling", SpecConfig.from_dict({"method": "recycling"})).table is not a.table


def test_a_chain_forwards_logits_to_its_members_that_read_them() -> None:
    recycling = TokenRecyclingDrafter(topk=2, branching=(2,))
    chain = ChainDrafter([NgramDrafter(), recycling])
    assert chain.needs_logits and not ChainDrafter([NgramDrafter()]).needs_logits
    chain.begin(DraftRequest("r", [1, 2], GREEDY, torch.Generator()))
    chain.observe_logits("r", [2], logits_ranking([[5, 6]]))
    assert chain.propose("r", [1, 2], 4).tokens == [5, 6]  # ngram has nothing: recycling's tree
    assert chain.propose("r", [1, 2], 4).source == "recycling"


# --------------------------------------------------------------------------- on the real model

REPETITIVE = "Continue the pattern: red, green, blue, red, green, blue, red, green, blue, red, green, blue, red, green,"


def _engine(llm: LLM, raw: dict[str, object]) -> tuple[Engine, TokenRecyclingDrafter]:
    cfg = SpecConfig.from_dict({"method": "recycling", "adaptive": False, "num_speculative_tokens": 8, **raw})
    assert cfg is not None
    drafter = default_registry().create(cfg.method, cfg)
    assert isinstance(drafter, TokenRecyclingDrafter)
    return Engine(llm.model, llm.tokenizer, spec=cfg, drafter=drafter), drafter


@pytest.mark.slow
def test_the_engine_feeds_the_table_and_its_trees_get_accepted(llm: LLM) -> None:
    """The prefill's last row and each step's verified rows reach the table (greedy: a row's best
    candidate is the token that followed); a repetitive answer then gets draft tokens accepted,
    with the output of plain decoding."""
    engine, drafter = _engine(llm, {})
    prompt = llm.chat_token_ids([{"role": "user", "content": REPETITIVE}])
    params = SamplingParams(temperature=0.0, max_tokens=40)
    req = engine.add_request(prompt, params)
    engine.start(req)  # begin + prefill: the last prompt position's row
    assert drafter.table.children(prompt[-1], 1) == req.output_ids[:1]
    engine.step(req)  # row 0 is the first output token's
    assert drafter.table.children(req.output_ids[0], 1) == req.output_ids[1:2]
    while not req.finished:
        engine.step(req)
    engine.finish(req)
    plain = Engine(llm.model, llm.tokenizer)
    assert req.output_ids == plain.run(plain.add_request(prompt, params)).output_ids
    stats = req.metrics.spec
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, (
        "the table never made an accepted draft: is the hook feeding it?"
    )
    assert (
        stats.num_accepted_tokens / stats.num_drafts > 0.5
    )  # the pattern's next tokens are the target's top candidates


@pytest.mark.slow
def test_a_seeded_sampled_request_drafts_from_its_own_table(llm: LLM) -> None:
    """Its text depends on its seed, prompt and config, not on what the drafter learned before;
    its trees are verified by the sampled tree walk (deterministic drafts: no q)."""
    prompt = llm.chat_token_ids([{"role": "user", "content": REPETITIVE}])
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=32)
    fresh, _ = _engine(llm, {})
    first = fresh.run(fresh.add_request(prompt, params))
    taught, drafter = _engine(llm, {})
    taught.run(taught.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=32)))  # fills the shared table
    assert drafter.table.nbytes > 0
    again = taught.run(taught.add_request(prompt, params))
    assert again.output_ids == first.output_ids
    assert again.metrics.spec.num_drafts > 0 and not drafter._local
