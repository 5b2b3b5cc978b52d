"""The drafter protocol: llama.cpp's begin / propose / accept / end lifecycle with Hugging Face
assisted generation's feedback hook, and a registry of drafter factories by method name.

A drafter sees a request's prompt once (`begin`), proposes up to `max_tokens` tokens given the
full context (`propose`), learns which of them were accepted (`accept`) and forgets the request
(`end`). A `Draft` is a chain unless `parents` says otherwise, and carries `probs`, the exact
distribution q each token was drawn from, when the drafter samples (None = deterministic, q is
one-hot). The engine dispatches on capability flags (`needs_hidden_states`, `needs_logits`), never
on types.

Shared state and seeds: a drafter object serves many requests, and some keep state across them
(the suffix tree over earlier outputs, the ngram-mod pool, ngram-cache's engine-wide counts).
Drafts never change what a greedy request outputs, nor the distribution of a sampled one, but
they do change how the verifier consumes a sampled request's random numbers. So a seeded sampled
request (`DraftRequest.request_local`) is drafted from its own prompt and output only, which
makes its text a function of the seed, the prompt and the configuration, whatever else the
engine has run or runs beside it. Its history may still feed the shared state: only requests
whose output a draft cannot change (greedy ones) or that promise no reproducibility (unseeded
ones) read it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from tokenleap.errors import TokenleapError
from tokenleap.sampling import SamplingParams
from tokenleap.types import SpecStats


@dataclass(frozen=True)
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] | None = None  # -1 = child of the last committed token; None = chain
    probs: torch.Tensor | None = None  # [n, V] q(x); None = deterministic
    source: str | None = None  # a chain's member that made it (its statistics count the draft)
    # seconds of the drafting that a draft's length does not explain (a draft model catching up
    # on tokens committed while speculation was off): the adaptive controller, which prices a
    # draft token from the drafting time, leaves them out
    setup_seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class DraftRequest:
    """What a drafter may know about a request when it begins."""

    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    generator: torch.Generator

    @property
    def request_local(self) -> bool:
        """Whether this request must be drafted from its own history only: a seeded sampled
        request, whose text would otherwise depend on the other requests (see the module doc)."""
        return self.params.seed is not None and not self.params.greedy


@runtime_checkable
class Drafter(Protocol):
    # read-only: a class constant for most drafters, decided per instance by a head drafter (its
    # head's method) and, for `needs_hidden_states`, by a chain
    @property
    def name(self) -> str: ...

    @property
    def needs_hidden_states(self) -> bool: ...

    def begin(self, request: DraftRequest) -> None: ...

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft: ...

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None: ...

    def end(self, request_id: str) -> None: ...


class StatelessDrafter:
    """Base for drafters that need no per-request state (lifecycle calls are no-ops)."""

    needs_hidden_states: ClassVar[bool] = False

    def begin(self, request: DraftRequest) -> None:
        return None

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        return None

    def end(self, request_id: str) -> None:
        return None


@runtime_checkable
class MemberStatistics(Protocol):
    """A drafter made of members (a chain) that counts each member's calls, as llama.cpp keeps
    statistics per implementation. `member_statistics` gives, after `begin`, the request's
    counters by member name, a dict the drafter keeps updating (its members' begin / propose /
    accept calls and durations); the engine adds the verified drafts of each (`Draft.source`)."""

    def member_statistics(self, request_id: str) -> dict[str, SpecStats]: ...


@runtime_checkable
class DraftsWithModel(Protocol):
    """A drafter that runs a model of its own (a draft model, or a head over the target's hidden
    states): llama.cpp's "implementation with draft model". Declared by the class attribute; a
    chain asks its draftless members first, as llama.cpp gives draftless decoding precedence."""

    drafts_with_model: ClassVar[bool]


@runtime_checkable
class ReadsHiddenStates(Protocol):
    """A drafter that reads the target's hidden states (EAGLE / Medusa / MTP heads): the engine
    captures the outputs of `hidden_layers` (-1: the final, normed hidden state) when
    `needs_hidden_states` is true, and gives them to `observe` for every committed position
    (the prompt's at prefill, the accepted rows' after each verification)."""

    hidden_layers: tuple[int, ...]

    def observe(self, request_id: str, start: int, token_ids: Sequence[int], hidden: dict[int, Any]) -> None:
        """The target's hidden states of positions start .. start + len(token_ids) - 1, per
        layer of `hidden_layers`."""


@runtime_checkable
class ReadsLogits(Protocol):
    """A drafter that reads the target's logits (Token Recycling's adjacency table): when
    `needs_logits` is true the engine gives `observe_logits` the raw rows it computed anyway
    (float32, before a grammar's mask, the request's processors and sampling): the last prompt
    position's at prefill, and after each verification every verified row, rejected ones too (row
    0, the last committed token's, then each draft node's in the draft's order: a view, no copy).
    No extra forward, no extra LM head rows."""

    needs_logits: ClassVar[bool]

    def observe_logits(self, request_id: str, token_ids: Sequence[int], logits: torch.Tensor) -> None:
        """`logits[i]` ([n, V]) is the target's next-token logits at a position holding
        `token_ids[i]` (what it ranked to follow that token there)."""


@runtime_checkable
class HasDraftCost(Protocol):
    """A drafter whose drafting costs target-relative time: `relative_draft_cost` per draft token
    (a one-row target forward = 1), the start of the engine's draft-cost estimate."""

    relative_draft_cost: float


@runtime_checkable
class HasSetupCost(Protocol):
    """A drafter with one-off work before its next draft (a draft model's prefill of the prompt,
    its catch-up on tokens decoded while another member drafted): `setup_cost` is that work in
    target decode steps, for a chain to weigh against what the member can still save."""

    def setup_cost(self, request: DraftRequest, tokens: Sequence[int]) -> float: ...


@runtime_checkable
class WeighsCost(Protocol):
    """A drafter that chooses between drafts by expected tokens per cost itself (the cost-aware
    chain): the engine hands it the target's measured cost curve (`tokenleap.cost.CostCurve`)."""

    def use_cost_curve(self, curve: Any) -> None: ...


@runtime_checkable
class LearnsAcrossRequests(Protocol):
    """A drafter that learns from answers produced elsewhere (suffix trees over earlier outputs,
    ngram-mod's pool, ngram-cache's statistics): Ray replicas share answers through `learn`."""

    def learn(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None: ...


@runtime_checkable
class SharedStore(Protocol):
    """A learning drafter whose state other drafters of one engine may share (ngram-mod's pool,
    ngram-cache's dynamic statistics): `shared_store` is that object, so answers are learned
    once per store."""

    @property
    def shared_store(self) -> object: ...


@runtime_checkable
class GlobalStatistics(Protocol):
    """A drafter with statistics across requests whose size a replica reports (the suffix tree
    over earlier outputs: its node count)."""

    def global_size(self) -> int: ...


def hidden_layers_of(drafter: object) -> tuple[int, ...]:
    """The target layers whose hidden states `drafter` reads (`ReadsHiddenStates`), () when it
    reads none. The engine asks every step: plain attribute reads, not a runtime protocol check
    (~7 us each)."""
    if drafter is None or not getattr(drafter, "needs_hidden_states", False):
        return ()
    return tuple(getattr(drafter, "hidden_layers", ()))


def draft_cost_of(drafter: object) -> float:
    """A drafter's declared cost per draft token (0 for the model-free ones)."""
    return float(drafter.relative_draft_cost or 0.0) if isinstance(drafter, HasDraftCost) else 0.0


DrafterFactory = Callable[..., Drafter]


@dataclass
class DrafterRegistry:
    """Method name -> factory(spec_config, **context) -> Drafter."""

    factories: dict[str, DrafterFactory] = field(default_factory=dict)

    def register(self, name: str, factory: DrafterFactory) -> None:
        self.factories[name] = factory

    def create(self, name: str, config: Any, **context: Any) -> Drafter:
        if name not in self.factories:
            known = ", ".join(sorted(self.factories))
            raise TokenleapError(f"unknown speculative method {name!r}; known: {known}")
        return self.factories[name](config, **context)

    def names(self) -> list[str]:
        return sorted(self.factories)


def check_drafter(obj: Any) -> Drafter:
    """Validate a user-supplied drafter object against the protocol, with a clear error."""
    missing = [m for m in ("begin", "propose", "accept", "end") if not callable(getattr(obj, m, None))]
    if missing:
        raise TokenleapError(
            f"custom drafter {type(obj).__name__} lacks method(s) {', '.join(missing)} of the Drafter protocol"
        )
    return obj


def unsure(logits: torch.Tensor, p_min: float) -> bool:
    """Whether a draft position's top probability (softmax of one row of logits) is below `p_min`
    (never when `p_min` is 0: no softmax is computed)."""
    return p_min > 0.0 and float(torch.softmax(logits.float(), dim=-1).max()) < p_min
