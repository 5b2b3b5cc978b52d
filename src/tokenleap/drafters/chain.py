"""Drafter chaining: several drafters behind one.

Without a member of declared drafting cost: the first member that proposes wins, the draftless
ones (n-grams, suffix trees, prompt lookup) asked before those that run a model of their own (a
draft model: `DraftsWithModel`), whatever order they are named in, as llama.cpp gives draftless
decoding precedence over a draft model; among each kind, the order given. With a member that
costs target time to draft (a trained head, `relative_draft_cost` > 0), the chain chooses per
step by expected tokens per unit of cost, as the engine's draft-length controller does for one
drafter (Leviathan et al., 2023, section 3.4): each member keeps its own decayed acceptance
estimate alpha_m per request (from the verifications of its own drafts), a draft of L tokens is
worth E(alpha_m, L) = sum_{j<=L} alpha_m^j tokens for cost(L) (the engine's measured verify cost
curve) + L x the member's drafting cost, the free members propose first, and a costly member
runs, asked for its best length, only when its expected rate there beats the best draft in hand;
the best rate wins, and none when no draft beats plain decoding's 1 token per unit. A member
left unused for `probe_every` proposals is tried once to refresh its estimate, on a step where
no free member's draft beats plain decoding (a probe is never forced over a draft that pays: on
code, suffix decoding's drafts were displaced every 16 steps by a draft model's). Every member
sees every request's lifecycle (begin / accept / end / observe), so each keeps its own state
current whether or not its draft was used; except that a member running a draft model of its own
(`DraftsWithModel`, hidden states not read) begins a request only when first asked for a draft:
its prompt's prefill (a third of the target's for the 0.5B draft of a 1.5B) is not paid by a
request its draftless members serve alone, and when paid it is timed as setup
(`Draft.setup_seconds`), not as the price of drafting. That one-off work, and a begun draft's
catch-up on tokens its draftless partner drafted (`HasSetupCost.setup_cost`, in target steps),
enters the member's rate spread over the steps it may still serve: the request's tokens left
times the decayed share of steps on which no free draft paid, over its tokens a step. On code the
draftless member serves nearly every step and a 0.5B draft's prefill (ten target steps for a
HumanEval prompt) is not bought for the few steps left to it; on chat, where it serves few, the
draft model begins as it would alone.

Statistics per member, as llama.cpp prints a line per implementation: each request's calls of
every member's begin / propose / accept and their durations (`member_statistics`), and the chosen
draft names its member (`Draft.source`) so the engine counts its verified and accepted tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from tokenleap.cost import expected_tokens
from tokenleap.drafters.base import (
    Draft,
    Drafter,
    DraftRequest,
    DraftsWithModel,
    HasSetupCost,
    LearnsAcrossRequests,
    ReadsHiddenStates,
    ReadsLogits,
    draft_cost_of,
    hidden_layers_of,
)
from tokenleap.drafters.methods import MethodRecord
from tokenleap.types import SpecStats

MISS_DECAY = 0.9  # the share of steps without a paying free draft: a decayed average
HORIZON_WITHOUT_CAP = 256  # tokens a request without max_tokens is assumed to have left


@dataclass
class _Estimate:
    accepted: float = 1.0  # decayed counts: prior alpha 0.5
    trials: float = 2.0
    idle: int = 0  # proposals since this member's draft was last used

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials


class ChainDrafter:
    name: ClassVar[str] = "chain"
    needs_hidden_states: bool = False  # per chain: whether a member reads target hidden states

    def __init__(
        self, drafters: Sequence[Drafter], decay: float = 0.9, probe_every: int = 16, names: Sequence[str] | None = None
    ) -> None:
        """`names`: the members' names in statistics (default: each drafter's `name`; a repeated
        name gets its position appended)."""
        if not drafters:
            raise ValueError("a drafter chain needs at least one drafter")
        self.drafters = list(drafters)
        raw = list(names) if names is not None else [str(getattr(d, "name", type(d).__name__)) for d in self.drafters]
        if len(raw) != len(self.drafters):
            raise ValueError(f"a drafter chain of {len(self.drafters)} members got {len(raw)} names")
        self.names = [n if raw.count(n) == 1 else f"{n}#{i + 1}" for i, n in enumerate(raw)]
        self._stats: dict[str, list[SpecStats]] = {}  # request -> each member's counters
        # the Drafter protocol's flag (a user's may lack it)
        self._readers = [d for d in self.drafters if getattr(d, "needs_hidden_states", False)]
        self.needs_hidden_states = bool(self._readers)
        self.hidden_layers = tuple(sorted({layer for d in self._readers for layer in hidden_layers_of(d)}))
        self._logit_readers = [
            cast(ReadsLogits, d) for d in self.drafters if getattr(d, "needs_logits", False)
        ]  # Token Recycling's table
        self.needs_logits = bool(self._logit_readers)
        self.wins = [0] * len(self.drafters)  # how often each drafter's proposal was used
        self.costs = [draft_cost_of(d) for d in self.drafters]
        self.cost_aware = any(c > 0 for c in self.costs)
        # draftless members before those with a model (llama.cpp's precedence), each in the order given
        with_model = [isinstance(d, DraftsWithModel) for d in self.drafters]
        self._precedence = [i for i, m in enumerate(with_model) if not m] + [i for i, m in enumerate(with_model) if m]
        # cost-aware: the free members first (their drafts cost nothing to look at), then the costly ones
        self._order = [i for i in self._precedence if self.costs[i] <= 0] + [
            i for i in self._precedence if self.costs[i] > 0
        ]
        self.decay = decay
        self.probe_every = probe_every
        self._curve: Any = None  # the engine's CostCurve (`use_cost_curve`); else cost(L) = 1 + 0.05 L
        self._estimates: dict[str, list[_Estimate]] = {}
        self._last: dict[str, tuple[int, int]] = {}  # request -> (member, length) of the draft in verification
        # members that run a model of their own (and read no hidden states) begin a request lazily
        self._lazy = {
            i for i, d in enumerate(self.drafters) if with_model[i] and not getattr(d, "needs_hidden_states", False)
        }
        # request -> (itself, its lazy members not yet begun)
        self._unbegun: dict[str, tuple[DraftRequest, set[int]]] = {}
        # a costly member's one-off work (a draft model's prefill, its catch-up) is priced over the
        # steps it may still serve: the request's tokens left x the share of steps no free draft pays
        self._has_setup = [isinstance(d, HasSetupCost) for d in self.drafters]
        self._requests: dict[str, DraftRequest] = {}
        self._miss: dict[str, float] = {}  # request -> decayed share of steps without a paying free draft

    def use_cost_curve(self, curve: Any) -> None:
        """The target's verify cost curve (`tokenleap.cost.CostCurve`), from the engine."""
        self._curve = curve

    def _rate(
        self, member: int, alpha: float, length: int, context: int, setup: float = 0.0, horizon: float = 0.0
    ) -> float:
        """Expected tokens per unit of cost of the member's `length`-token draft; `setup`: the
        member's one-off work in target steps, spread over the steps it may serve (`horizon`
        tokens at its expected tokens a step)."""
        verify = self._curve.cost(length, context) if self._curve is not None else 1.0 + 0.05 * length
        expected = expected_tokens(alpha, length)
        steps = max(1.0, horizon / expected)
        return expected / (verify + self.costs[member] * length + setup / steps)

    def _best_length(
        self, member: int, alpha: float, max_tokens: int, context: int, setup: float = 0.0, horizon: float = 0.0
    ) -> tuple[float, int]:
        """The member's best expected rate over draft lengths 1..max_tokens, and that length."""
        rates = ((self._rate(member, alpha, n, context, setup, horizon), n) for n in range(1, max_tokens + 1))
        return max(rates, default=(0.0, 0))

    def _setup_cost(self, i: int, request_id: str, tokens: Sequence[int]) -> float:
        """Member i's one-off work before its next draft (a draft model's prefill or catch-up),
        in target steps; 0 for a member that declares none."""
        request = self._requests.get(request_id)
        if request is None or not self._has_setup[i]:
            return 0.0
        return float(cast(HasSetupCost, self.drafters[i]).setup_cost(request, tokens))

    def _horizon(self, request_id: str, tokens: Sequence[int]) -> float:
        """Tokens a costly member may still help decode: those left to generate times the share
        of recent steps no free member's draft paid for (prior: half)."""
        request = self._requests.get(request_id)
        if request is None:
            return 0.0
        left = (request.params.max_tokens or HORIZON_WITHOUT_CAP) - (len(tokens) - len(request.prompt_ids))
        return max(0.0, left * self._miss.get(request_id, 0.5))

    def member_statistics(self, request_id: str) -> dict[str, SpecStats]:
        """The request's counters by member name, in chain order (kept up to date until `end`)."""
        return dict(zip(self.names, self._stats.get(request_id, [])))

    def begin(self, request: DraftRequest) -> None:
        self._stats[request.request_id] = [SpecStats() for _ in self.drafters]
        self._requests[request.request_id] = request
        for i in range(len(self.drafters)):
            if i not in self._lazy:
                self._begin(i, request)
        if self._lazy:
            self._unbegun[request.request_id] = (request, set(self._lazy))
        if self.cost_aware:
            self._estimates[request.request_id] = [_Estimate() for _ in self.drafters]

    def _begin(self, i: int, request: DraftRequest) -> float:
        """Member i begins the request, counted in its statistics; the seconds it took."""
        t0 = time.perf_counter()
        self.drafters[i].begin(request)
        seconds = time.perf_counter() - t0
        st = self._stats.get(request.request_id)
        if st is not None:
            st[i].begin_seconds += seconds
            st[i].num_begin_calls += 1
        return seconds

    def _begun(self, i: int, request_id: str) -> bool:
        unbegun = self._unbegun.get(request_id)
        return unbegun is None or i not in unbegun[1]

    def _propose(self, i: int, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        """Member i's proposal, counted in its statistics; a lazy member begins the request
        first, that time returned as the draft's setup."""
        setup = 0.0
        unbegun = self._unbegun.get(request_id)
        if unbegun is not None and i in unbegun[1]:
            unbegun[1].discard(i)
            setup = self._begin(i, unbegun[0])
        t0 = time.perf_counter()
        draft = self.drafters[i].propose(request_id, tokens, max_tokens)
        stats = self._stats.get(request_id)
        if stats is not None:
            stats[i].draft_seconds += time.perf_counter() - t0
            stats[i].num_propose_calls += 1
        return dataclasses.replace(draft, setup_seconds=draft.setup_seconds + setup) if setup else draft

    def _chosen(self, i: int, draft: Draft) -> Draft:
        self.wins[i] += 1
        return dataclasses.replace(draft, source=self.names[i])

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        estimates = self._estimates.get(request_id)
        setup = 0.0  # members' one-off work this step (a lazy begin, a catch-up): not a draft's price
        if estimates is None:  # precedence: the first member that proposes wins
            for i in self._precedence:
                draft = self._propose(i, request_id, tokens, max_tokens)
                setup += draft.setup_seconds
                if len(draft):
                    return self._chosen(i, dataclasses.replace(draft, setup_seconds=setup))
            return Draft(setup_seconds=setup)
        context = len(tokens)
        horizon = self._horizon(request_id, tokens)
        best: tuple[float, int, Draft] | None = None
        free_paid = False
        for i in self._order:
            est = estimates[i]
            est.idle += 1
            length = max_tokens
            # a probe refreshes an idle member's estimate, but never displaces a draft that pays
            probe = est.idle > self.probe_every and (best is None or best[0] <= 1.0)
            if self.costs[i] > 0:
                one_off = self._setup_cost(i, request_id, tokens)
                if probe and one_off > 0.0 and self._rate(i, est.alpha, 1, context, one_off, horizon) <= 1.0:
                    probe = False  # nor paid for with a prefill the request cannot win back
                if not probe:
                    expected, length = self._best_length(i, est.alpha, max_tokens, context, one_off, horizon)
                    if expected <= (best[0] if best is not None else 1.0):
                        continue  # not worth its drafting time this step
            draft = self._propose(i, request_id, tokens, length)
            setup += draft.setup_seconds
            if not len(draft):
                continue
            rate = float("inf") if probe else self._rate(i, est.alpha, len(draft), context)
            free_paid = free_paid or (self.costs[i] <= 0 and rate > 1.0)
            if best is None or rate > best[0]:
                best = (rate, i, draft)
        missed = 0.0 if free_paid else 1.0
        self._miss[request_id] = MISS_DECAY * self._miss.get(request_id, 0.5) + (1 - MISS_DECAY) * missed
        if best is None or best[0] <= 1.0:
            return Draft(setup_seconds=setup)
        _, i, draft = best
        estimates[i].idle = 0
        self._last[request_id] = (i, len(draft))
        return self._chosen(i, dataclasses.replace(draft, setup_seconds=setup))

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        stats = self._stats.get(request_id)
        for i, d in enumerate(self.drafters):
            if not self._begun(i, request_id):
                continue  # a lazy member that has not seen the request
            t0 = time.perf_counter()
            d.accept(request_id, tokens, num_accepted)
            if stats is not None:
                stats[i].accept_seconds += time.perf_counter() - t0
                stats[i].num_accept_calls += 1
        last = self._last.pop(request_id, None)
        estimates = self._estimates.get(request_id)
        if last is not None and estimates is not None:
            i, length = last
            est = estimates[i]
            accepted = min(num_accepted, length)
            est.accepted = self.decay * est.accepted + accepted
            est.trials = self.decay * est.trials + accepted + (1 if accepted < length else 0)

    def observe(self, request_id: str, start: int, token_ids: Sequence[int], hidden: dict[int, Any]) -> None:
        """Target hidden states for the members that read them (`needs_hidden_states`)."""
        for d in self._readers:
            reader = cast(ReadsHiddenStates, d)  # needs_hidden_states: one of them
            reader.observe(request_id, start, token_ids, {layer: hidden[layer] for layer in reader.hidden_layers})

    def observe_logits(self, request_id: str, token_ids: Sequence[int], logits: Any) -> None:
        """The target's raw logits for the members that read them (`needs_logits`)."""
        for d in self._logit_readers:
            d.observe_logits(request_id, token_ids, logits)

    def end(self, request_id: str) -> None:
        for i, d in enumerate(self.drafters):
            if self._begun(i, request_id):
                d.end(request_id)
        self._unbegun.pop(request_id, None)
        self._requests.pop(request_id, None)
        self._miss.pop(request_id, None)
        self._estimates.pop(request_id, None)
        self._last.pop(request_id, None)
        self._stats.pop(request_id, None)  # the engine's request metrics keep them

    def learn(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Pass an answer produced elsewhere to every drafter of the chain that learns from answers."""
        for d in self.drafters:
            if isinstance(d, LearnsAcrossRequests):
                d.learn(prompt_ids, output_ids)


def _build(config: Any, *, registry: Any, **context: Any) -> ChainDrafter:
    return ChainDrafter(
        [registry.create(m, dataclasses.replace(config, method=m), **context) for m in config.chain], names=config.chain
    )


def _registry(registry: Any) -> dict[str, Any]:
    return {"registry": registry}


METHOD = MethodRecord(
    "chain",
    _build,
    "the first drafter of a chain that proposes, draftless ones asked before a draft model",
    fields=("chain", "method_options"),  # and each member's own fields; members' options pass through
    per_request=False,
    shared=_registry,
    doc=(
        "the first drafter in the chain that proposes, draftless ones asked before a draft model (llama.cpp's "
        "precedence); with a head, the best expected tokens per unit of cost"
    ),
    knobs="`chain` (or the method `a+b`)",
)
