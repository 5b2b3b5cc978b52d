"""Drafter chaining: several drafters behind one, the first that proposes wins.

Mirrors llama.cpp's precedence of draftless methods over a draft model: cheap lookups first
(suffix trees, n-grams), a costlier drafter only when they have nothing. Every drafter sees
every request's lifecycle (begin / accept / end), so each keeps its own state current whether
or not its draft was used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from tokenleap.drafters.base import Draft, Drafter, DraftRequest


class ChainDrafter:
    name: ClassVar[str] = "chain"
    needs_hidden_states: bool = False  # per chain: whether a member reads target hidden states

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        if not drafters:
            raise ValueError("a drafter chain needs at least one drafter")
        self.drafters = list(drafters)
        self._readers = [d for d in self.drafters if getattr(d, "needs_hidden_states", False)]
        self.needs_hidden_states = bool(self._readers)
        self.hidden_layers = tuple(sorted({l for d in self._readers for l in getattr(d, "hidden_layers", ())}))
        self.wins = [0] * len(self.drafters)  # how often each drafter's proposal was used

    def begin(self, request: DraftRequest) -> None:
        for d in self.drafters:
            d.begin(request)

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        for i, d in enumerate(self.drafters):
            draft = d.propose(request_id, tokens, max_tokens)
            if len(draft):
                self.wins[i] += 1
                return draft
        return Draft()

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        for d in self.drafters:
            d.accept(request_id, tokens, num_accepted)

    def observe(self, request_id: str, start: int, token_ids: Sequence[int], hidden: dict[int, Any]) -> None:
        """Target hidden states for the members that read them (`needs_hidden_states`)."""
        for d in self._readers:
            d.observe(request_id, start, token_ids, {l: hidden[l] for l in d.hidden_layers})  # type: ignore[attr-defined]

    def end(self, request_id: str) -> None:
        for d in self.drafters:
            d.end(request_id)

    def learn(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Pass an answer produced elsewhere to every drafter of the chain that learns from answers."""
        for d in self.drafters:
            learn = getattr(d, "learn", None)
            if learn is not None:
                learn(prompt_ids, output_ids)
