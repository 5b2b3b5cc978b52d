"""ChainDrafter: precedence among model-free members; with a costly member (a head), the choice
per step by expected tokens per unit of cost, per-member acceptance estimates, probing."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenleap.drafters.base import Draft, DraftRequest
from tokenleap.drafters.chain import ChainDrafter
from tokenleap.engine.speculation import CostCurve
from tokenleap.sampling import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=64)


class Fixed:
    """Proposes `draft` (cut to the budget) every time; counts its proposals and feedback."""

    def __init__(self, draft: Sequence[int], relative_draft_cost: float = 0.0) -> None:
        self.draft = list(draft)
        self.relative_draft_cost = relative_draft_cost
        self.proposals = 0
        self.accepted: list[int] = []

    def begin(self, request: DraftRequest) -> None: ...

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        self.proposals += 1
        return Draft(self.draft[:max_tokens])

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        self.accepted.append(num_accepted)

    def end(self, request_id: str) -> None: ...


def _begin(chain: ChainDrafter, rid: str = "r") -> None:
    chain.begin(DraftRequest(rid, [1, 2, 3], PARAMS, torch.Generator()))


FLAT = CostCurve(tuple(1.0 + 0.02 * k for k in range(17)))  # a verified row costs 2 % of a step
STEEP = CostCurve(tuple(1.0 + 0.1 * k for k in range(17)))  # 10 %


def test_model_free_members_keep_precedence() -> None:
    a, b = Fixed([]), Fixed([7, 8])
    chain = ChainDrafter([a, b, Fixed([9])])
    assert not chain.cost_aware
    _begin(chain)
    assert chain.propose("r", [1, 2, 3], 4).tokens == [7, 8] and chain.wins == [0, 1, 0]
    a.draft = [5]
    assert chain.propose("r", [1, 2, 3], 4).tokens == [5] and chain.wins == [1, 1, 0]


def test_a_costly_member_runs_only_when_its_expected_rate_beats_the_draft_in_hand() -> None:
    cheap, head = Fixed([11, 12]), Fixed([21, 22, 23, 24], relative_draft_cost=0.01)
    # order given: head first; the free member is still asked first
    chain = ChainDrafter([head, cheap], probe_every=1000)
    chain.use_cost_curve(FLAT)
    _begin(chain)
    assert chain.cost_aware
    # equal priors (alpha 0.5): the head's 4 tokens (1.94 expected for 1.12) beat the cheap 2 (1.75 for 1.04)
    assert chain.propose("r", [1, 2, 3], 4).tokens == [21, 22, 23, 24] and (cheap.proposals, head.proposals) == (1, 1)
    chain.accept("r", [0], 0)
    for _ in range(12):  # the head's drafts are rejected at once, the cheap member's are accepted whole
        draft = chain.propose("r", [1, 2, 3], 4)
        chain.accept("r", [0], 0 if draft.tokens[0] == 21 else 2)
    assert chain.wins[1] > 0  # the cheap member took over ...
    before = head.proposals
    for _ in range(5):
        assert chain.propose("r", [1, 2, 3], 4).tokens == [11, 12]
        chain.accept("r", [11, 12, 13], 2)
    assert head.proposals == before  # ... and the head is no longer even run: its drafting time is saved


def test_the_head_wins_once_the_cheap_members_drafts_fail() -> None:
    cheap, head = Fixed([11, 12, 13]), Fixed([21, 22, 23, 24], relative_draft_cost=0.01)
    chain = ChainDrafter([cheap, head], probe_every=1000)
    chain.use_cost_curve(FLAT)
    _begin(chain)
    chosen = []
    for _ in range(10):
        draft = chain.propose("r", [1, 2, 3], 4)
        chosen.append(draft.tokens[0])
        chain.accept("r", [0], 0 if draft.tokens[0] == 11 else 4)  # the cheap drafts fail, the head's hold
    assert chosen[-5:] == [21] * 5


def test_no_draft_when_nothing_beats_plain_decoding_and_probes_refresh_estimates() -> None:
    cheap = Fixed([11, 12, 13])
    head = Fixed([21, 22], relative_draft_cost=0.5)  # a very expensive drafter
    chain = ChainDrafter([cheap, head], probe_every=3)
    chain.use_cost_curve(STEEP)
    _begin(chain)
    results = []
    for _ in range(12):
        draft = chain.propose("r", [1, 2, 3], 2)
        results.append(tuple(draft.tokens))
        chain.accept("r", [0], 0)  # every draft rejected
    assert () in results  # both estimates fell: no draft verified (plain decoding is cheaper)
    assert results.count((21, 22)) >= 1 and results.count((11, 12)) >= 2  # probes still try each member now and then


def test_estimates_are_per_request_and_released_at_end() -> None:
    cheap, head = Fixed([11]), Fixed([21, 22, 23], relative_draft_cost=0.05)
    chain = ChainDrafter([cheap, head])
    _begin(chain, "a")
    _begin(chain, "b")
    for _ in range(6):
        chain.propose("a", [1], 3)
        chain.accept("a", [0], 0)
    # b's priors untouched by a's failures: the head asked for its best length at alpha 0.5 (2 of 3)
    assert chain.propose("b", [1], 3).tokens == [21, 22]
    chain.end("a")
    chain.end("b")
    assert not chain._estimates and not chain._last


def test_each_member_counts_its_calls_and_names_its_drafts() -> None:
    """llama.cpp's per-implementation counters, per member: begin / propose / accept calls (a
    member asked after another proposed is not called), and the chosen draft names its member."""
    a, b = Fixed([]), Fixed([7, 8])
    chain = ChainDrafter([a, b, Fixed([9])], names=["ngram-simple", "ngram-mod", "suffix"])
    _begin(chain)
    stats = chain.member_statistics("r")
    assert list(stats) == ["ngram-simple", "ngram-mod", "suffix"]
    draft = chain.propose("r", [1, 2, 3], 4)
    assert (draft.tokens, draft.source) == ([7, 8], "ngram-mod")
    chain.accept("r", [7, 8, 5], 2)
    assert [(s.num_begin_calls, s.num_propose_calls, s.num_accept_calls) for s in stats.values()] == [
        (1, 1, 1),
        (1, 1, 1),
        (1, 0, 1),
    ]
    assert all(s.begin_seconds >= 0 and s.draft_seconds >= 0 for s in stats.values())
    assert chain.propose("r", [1, 2, 3], 4).source == "ngram-mod"
    assert chain.member_statistics("r")["ngram-mod"].num_propose_calls == 2  # the same live counters
    chain.end("r")
    assert chain.member_statistics("r") == {} and stats["ngram-mod"].num_propose_calls == 2  # the caller's copy stays
    # a costly chain names its drafts too; repeated names are told apart by position
    cheap, head = Fixed([11, 12]), Fixed([21, 22, 23, 24], relative_draft_cost=0.01)
    chain = ChainDrafter([head, cheap], names=["eagle3", "eagle3"])
    chain.use_cost_curve(FLAT)
    _begin(chain)
    assert chain.propose("r", [1, 2, 3], 4).source in ("eagle3#1", "eagle3#2")
    assert list(chain.member_statistics("r")) == ["eagle3#1", "eagle3#2"]


class WithModel(Fixed):
    """A member that runs a draft model of its own (`DraftsWithModel`)."""

    drafts_with_model = True


def test_draftless_members_precede_a_draft_model_whatever_the_order_given() -> None:
    """llama.cpp: "If a draft model is combined with a draftless decoding the draftless decoding
    has higher precedence." Named first, the draft model is still asked after the n-grams."""
    model, lookup, other = WithModel([21, 22, 23]), Fixed([]), Fixed([31])
    chain = ChainDrafter([model, lookup, other], names=["draft-model", "ngram-simple", "suffix"])
    assert not chain.cost_aware
    _begin(chain)
    draft = chain.propose("r", [1, 2, 3], 4)
    assert (draft.tokens, draft.source) == ([31], "suffix") and model.proposals == 0  # the model not even run
    assert chain.member_statistics("r")["ngram-simple"].num_propose_calls == 1  # asked first, had nothing
    other.draft = []
    draft = chain.propose("r", [1, 2, 3], 4)
    # none of them had one
    assert (draft.tokens, draft.source) == ([21, 22, 23], "draft-model") and model.proposals == 1
    lookup.draft = [41]
    assert chain.propose("r", [1, 2, 3], 4).tokens == [41]  # the draftless member again, in the order given
    assert chain.wins == [1, 1, 1]


def test_a_costly_chain_keeps_weighing_its_head_beside_a_draft_model() -> None:
    """The cost-aware chain (a head with a drafting cost) is unchanged: free members first,
    draftless before a draft model, and the best expected rate wins (here the head's)."""
    model, cheap, head = WithModel([11]), Fixed([12]), Fixed([21, 22, 23, 24], relative_draft_cost=0.01)
    chain = ChainDrafter([model, head, cheap], probe_every=1000)
    chain.use_cost_curve(FLAT)
    _begin(chain)
    assert chain.cost_aware and chain._order == [2, 0, 1]  # the free draftless, the free model, the costly head
    assert chain.propose("r", [1, 2, 3], 4).tokens == [21, 22, 23, 24]


class Counting(WithModel):
    """A draft-model member that records its lifecycle calls; its begin takes a while (a prefill)."""

    def __init__(self, draft: Sequence[int], relative_draft_cost: float = 0.0) -> None:
        super().__init__(draft, relative_draft_cost)
        self.calls: list[str] = []

    def begin(self, request: DraftRequest) -> None:
        import time

        time.sleep(0.02)
        self.calls.append("begin")

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        self.calls.append("accept")

    def end(self, request_id: str) -> None:
        self.calls.append("end")


def test_a_draft_model_member_begins_only_when_first_asked_and_its_prefill_is_setup() -> None:
    """The draft model's prefill is not paid by a request the draftless members serve alone;
    when it is paid, the chosen draft carries it as setup (not as the price of its tokens)."""
    model, cheap = Counting([21, 22]), Fixed([11])
    chain = ChainDrafter([cheap, model])
    _begin(chain, "served")
    assert chain.propose("served", [1, 2, 3], 4).tokens == [11]
    chain.accept("served", [11, 5], 1)
    chain.end("served")
    assert model.calls == [] and chain.member_statistics("served") == {}
    _begin(chain, "r")
    cheap.draft = []
    draft = chain.propose("r", [1, 2, 3], 4)
    assert draft.tokens == [21, 22] and draft.setup_seconds >= 0.02
    assert chain.member_statistics("r")["Fixed"].num_begin_calls == 1  # the draftless member began at once
    chain.accept("r", [21, 22, 5], 2)
    assert chain.propose("r", [1, 2, 3, 21, 22, 5], 4).setup_seconds < 0.02  # begun once
    chain.end("r")
    assert model.calls == ["begin", "accept", "end"]


def test_a_probe_never_displaces_a_draft_that_pays() -> None:
    """A costly member idle past `probe_every` is probed only on a step where no free draft beats
    plain decoding: on code, suffix decoding's accepted drafts were displaced every 16 steps."""
    cheap, model = Fixed([11, 12, 13]), Counting([21, 22, 23], relative_draft_cost=0.3)
    chain = ChainDrafter([cheap, model], probe_every=2)
    chain.use_cost_curve(FLAT)
    _begin(chain)
    for _ in range(10):
        assert chain.propose("r", [1, 2, 3], 3).tokens == [11, 12, 13]
        chain.accept("r", [11, 12, 13, 5], 3)
    assert model.proposals == 0 and model.calls == []  # never run, never begun
    cheap.draft = []  # the free member has nothing: the idle draft model is probed
    assert chain.propose("r", [1, 2, 3], 3).tokens == [21, 22, 23]
    assert model.calls == ["begin"]


class WithSetup(Counting):
    """A draft-model member with a one-off cost before its next draft (its prefill), in target steps."""

    def __init__(self, draft: Sequence[int], relative_draft_cost: float, setup: float) -> None:
        super().__init__(draft, relative_draft_cost)
        self.setup = setup

    def setup_cost(self, request: DraftRequest, tokens: Sequence[int]) -> float:
        return self.setup


def test_a_draft_models_prefill_is_weighed_against_what_it_can_still_save() -> None:
    """On HumanEval the chain began the 0.5B draft at a step without a suffix draft and paid its
    prefill (~0.55 s, ten target steps) for a handful of drafts: a member's one-off cost is now
    spread over the steps it may still serve (tokens left x the share of steps without a paying
    free draft), so a request with little left does not buy it, and one with much left does."""
    nothing, model = Fixed([]), WithSetup([21], relative_draft_cost=0.1, setup=10.0)
    chain = ChainDrafter([nothing, model], probe_every=2)
    chain.use_cost_curve(FLAT)
    for rid, max_tokens in (("short", 8), ("long", 1000)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        chain.begin(DraftRequest(rid, [1, 2, 3], params, torch.Generator()))
    for _ in range(4):  # probes included: 10 steps of prefill cannot be won back in 8 tokens
        assert chain.propose("short", [1, 2, 3], 4).tokens == []
    assert model.calls == []
    assert chain.propose("long", [1, 2, 3], 4).tokens == [21] and model.calls == ["begin"]
    model.setup = 0.0  # begun, caught up: nothing stands in the short request's way but its prior
    assert chain.propose("short", [1, 2, 3], 4).tokens == [21]
