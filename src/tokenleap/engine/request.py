"""Per-request decoding state: tokens, KV cache, generator, stop conditions, streamed text.

Stop handling follows vLLM's semantics: generation ends at an EOS token (unless
`ignore_eos`), a `stop_token_ids` token, `max_tokens`, a full context, or a stop string, which
is cut from the returned text. While streaming, text that could still become the beginning of
a stop string is held back, so the concatenated deltas always equal the final text. The held-back
length is kept incrementally (`StopHoldback`: Knuth-Morris-Pratt matching, one automaton per stop
string), so a step reads its new characters once, however many and however long the stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenleap.drafters.base import Drafter
from tokenleap.drafters.spec import SpecConfig
from tokenleap.engine.speculation import DraftController
from tokenleap.kv.cache import KVCache
from tokenleap.sampling import SamplingParams
from tokenleap.structured import GrammarState
from tokenleap.tokenizer import IncrementalDetokenizer
from tokenleap.types import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def _prefix_function(s: str) -> list[int]:
    """KMP failure function: pi[i] = length of the longest proper prefix of s[:i+1] that is also its suffix."""
    pi = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return pi


class StopHoldback:
    """The longest suffix of a growing text that is a proper prefix of one of `stops` (the text
    a stream must hold back), updated from the new characters only. Per stop string, the state is
    the longest prefix of it that ends the text; each character moves it as in Knuth-Morris-Pratt,
    amortised O(1) per stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._pi = [_prefix_function(s) for s in self._stops]
        self._state = [0] * len(self._stops)

    def feed(self, text: str) -> StopHoldback:
        for i, (stop, pi) in enumerate(zip(self._stops, self._pi)):
            q, n = self._state[i], len(stop)
            for c in text:
                if q == n:  # the whole stop string ended the text: continue from its border
                    q = pi[q - 1]
                while q and stop[q] != c:
                    q = pi[q - 1]
                if stop[q] == c:
                    q += 1
            self._state[i] = q
        return self

    @property
    def held(self) -> int:
        """Characters at the end of the text fed so far that could begin a stop string."""
        return max((q if q < len(s) else pi[-1] for q, s, pi in zip(self._state, self._stops, self._pi)), default=0)


def _stop_prefix_holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    return StopHoldback(stops).feed(text).held


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detok: IncrementalDetokenizer
    kv: KVCache
    eos_token_ids: frozenset[int]
    max_context: int
    metrics: RequestMetrics
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted_chars: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    controller: DraftController | None = None  # adaptive draft length (speculation only)
    spec: SpecConfig | None = None  # this request's speculative config (None: plain decoding)
    drafter: Drafter | None = None
    released: bool = False  # cache freed and drafter released (Engine.finish)
    logprobs: list[dict[int, Logprob]] | None = None  # per output token, when params.logprobs is set
    sample_index: int = 0  # which of the prompt's `params.n` samples this is
    grammar: GrammarState | None = None  # structured output: the matcher at the committed state
    # raw logits of the last prompt row (kept for n > 1 forks)
    prompt_logits: torch.Tensor | None = field(default=None, repr=False)
    # the prompt's target features per prefill chunk (start, ids, hidden states), kept for n > 1
    # forks when the drafter reads hidden states
    prompt_features: list[tuple[int, list[int], dict[int, torch.Tensor]]] = field(default_factory=list, repr=False)
    _holdback: StopHoldback | None = field(default=None, repr=False, compare=False)  # over text[:_scanned]
    _scanned: int = field(default=0, repr=False, compare=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def append_tokens(self, tokens: Sequence[int]) -> int:
        """Add sampled tokens in order, stopping at the first stop condition.

        Returns how many of `tokens` were kept (the rest come after a stop).
        """
        p = self.params
        kept = 0
        for tok in tokens:
            if self.finished:
                break
            kept += 1
            if not p.ignore_eos and tok in self.eos_token_ids:
                self.finish_reason, self.stop_reason = "stop", None
                break
            if tok in p.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", tok
                break
            self.output_ids.append(tok)
            before = len(self.text)
            self.text += self.detok.push([tok])
            if len(self.output_ids) >= p.max_tokens or self.num_tokens >= self.max_context:
                self.finish_reason = "length"
                self.text += self.detok.flush()
            if p.stop and len(self.output_ids) >= p.min_tokens and self._check_stop_strings(before):
                break
        if self.finish_reason == "stop" and not isinstance(self.stop_reason, str):
            self.text += self.detok.flush()
        self.metrics.num_generation_tokens = len(self.output_ids)
        return kept

    def _check_stop_strings(self, new_from: int) -> bool:
        """Look for a stop string overlapping text added at or after `new_from`."""
        longest = max(len(s) for s in self.params.stop)
        window_start = max(0, new_from - longest + 1)
        hits = [(self.text.find(s, window_start), s) for s in self.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[: index + len(stop)] if self.params.include_stop_str_in_output else self.text[:index]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def take_delta(self) -> str:
        """New text safe to show now (everything, once finished)."""
        end = len(self.text)
        if not self.finished and self.params.stop:
            if self._holdback is None or self._scanned > end:  # (text only grows until a stop cuts it)
                self._holdback, self._scanned = StopHoldback(self.params.stop), 0
            self._holdback.feed(self.text[self._scanned :])
            self._scanned = end
            end -= self._holdback.held
        if end <= self.emitted_chars:
            return ""
        delta = self.text[self.emitted_chars : end]
        self.emitted_chars = end
        return delta

    def add_logprobs(self, entries: Sequence[dict[int, Logprob]]) -> None:
        """Entries for the tokens just appended (those of the committed tokens that were kept)."""
        if self.logprobs is None:
            self.logprobs = []
        need = len(self.output_ids) - len(self.logprobs)
        self.logprobs.extend(entries[: max(0, need)])

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            self.sample_index, self.text, list(self.output_ids), self.finish_reason, self.stop_reason
        )
        if self.logprobs is not None:
            completion.logprobs = list(self.logprobs)
            completion.cumulative_logprob = sum(e[t].logprob for e, t in zip(self.logprobs, self.output_ids))
        return RequestOutput(
            self.request_id, self.prompt, list(self.prompt_ids), [completion], self.finished, self.metrics
        )
