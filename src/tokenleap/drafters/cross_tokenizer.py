"""Drafts from a model with another tokenizer, by string-level re-tokenization: the "string-level
exact match" scheme of Timor et al., "Lossless Speculative Decoding Algorithms for Heterogeneous
Vocabularies" (ICML 2025), the idea behind Hugging Face's universal assisted generation.

Each step: the target context is decoded to text and encoded by the draft's tokenizer; the draft
model (with its own KV cache, kept by longest common prefix like `DraftModelDrafter`) continues it
greedily; the new text is encoded back by the target's tokenizer, anchored on the last few
context tokens so that the proposal extends the context token for token.

Why it is lossless for every request, sampled ones included: the proposal is a deterministic
function of the context, so its draft distribution q is a point mass on the proposed token. The
standard verifier accepts a point-mass draft x with probability min(1, p(x) / 1) = p(x) and on
rejection samples the residual norm(max(0, p - q)) = p without x, renormalised, which gives
exactly p (Leviathan et al., 2023, Theorem 1 holds for any q). Greedy requests accept a token only
when it is the target's argmax. The draft model's own sampling is never used, so no mapping of
probabilities between vocabularies is needed (that is what the paper's token-level schemes add,
at the price of restricting drafts to the vocabularies' intersection).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from tokenleap.drafters.base import Draft, DraftRequest, unsure
from tokenleap.kv.cache import KVCache, resync
from tokenleap.models.base import CausalLM
from tokenleap.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ANCHORS = (8, 4, 2, 1)  # context tokens the re-encoded draft text must reproduce, longest first


@dataclass
class _State:
    request: DraftRequest
    kv: KVCache
    cached: list[int] = field(default_factory=list)  # draft-vocabulary ids whose K/V are in `kv`


class CrossTokenizerDrafter:
    """A draft model whose tokenizer differs from the target's."""

    name: ClassVar[str] = "draft-model"
    needs_hidden_states: ClassVar[bool] = False
    drafts_with_model: ClassVar[bool] = True  # a chain asks draftless members first (base.DraftsWithModel)

    def __init__(
        self, model: CausalLM, draft_tokenizer: Tokenizer, target_tokenizer: Tokenizer, p_min: float = 0.0
    ) -> None:
        self.model = model
        # stop where the draft model's top probability falls below this (draft-model's draft_p_min; 0: never)
        self.p_min = p_min
        self.draft_tok = draft_tokenizer
        self.target_tok = target_tokenizer
        self._states: dict[str, _State] = {}
        bos = target_tokenizer.hf.bos_token_id
        self._target_bos = int(bos) if bos is not None else None
        self._draft_eos = draft_tokenizer.eos_token_ids

    # ------------------------------------------------------------------ text <-> ids

    def draft_context(self, tokens: Sequence[int]) -> list[int]:
        """The target context in the draft's vocabulary (its BOS convention, not the target's)."""
        ids = list(tokens)
        if ids and self._target_bos is not None and ids[0] == self._target_bos:
            ids = ids[1:]
        text = self.target_tok.hf.decode(ids, skip_special_tokens=False)
        return list(self.draft_tok.hf.encode(text, add_special_tokens=True))

    def draft_text(self, context: Sequence[int], drafted: Sequence[int]) -> str:
        """The text the draft tokens add after `context` (decoded with a short tail of context, so
        a tokenizer that strips a leading space at the start of a decode does not lose it)."""
        tail = list(context[-4:])
        head = self.draft_tok.hf.decode(tail, skip_special_tokens=False)
        full = self.draft_tok.hf.decode(tail + list(drafted), skip_special_tokens=False)
        text = (
            full[len(head) :]
            if full.startswith(head)
            else self.draft_tok.hf.decode(list(drafted), skip_special_tokens=False)
        )
        return text.rstrip("\ufffd")  # an incomplete UTF-8 sequence at the end is not text yet

    def to_target(self, tokens: Sequence[int], text: str) -> list[int]:
        """Target ids for `text` following the context `tokens`: the text is encoded after the
        decoded last few context tokens, and kept only when that encoding reproduces them."""
        if not text:
            return []
        hf = self.target_tok.hf
        for w in ANCHORS:
            if len(tokens) < w:
                continue
            tail = list(tokens[-w:])
            ids = list(hf.encode(hf.decode(tail, skip_special_tokens=False) + text, add_special_tokens=False))
            if ids[:w] == tail:
                return ids[w:]
        return []

    # ------------------------------------------------------------------ the Drafter protocol

    def begin(self, request: DraftRequest) -> None:
        self._states[request.request_id] = _State(request, self.model.new_kv_cache())

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        st = self._states[request_id]
        if max_tokens <= 0 or not tokens:
            return Draft()
        context = self.draft_context(tokens)
        if not context:
            return Draft()
        new = resync(st.kv, st.cached, context)
        steps = min(max_tokens, self.model.max_context - len(context))
        if steps <= 0:
            return Draft()
        drafted: list[int] = []
        for _ in range(steps):
            pos = st.kv.length
            out = self.model.forward(torch.tensor(new), torch.arange(pos, pos + len(new)), st.kv)
            st.cached.extend(new)
            logits = self.model.compute_logits(out.hidden, [len(new) - 1])[0]
            if unsure(logits, self.p_min):
                break
            tok = int(logits.argmax())
            if tok in self._draft_eos:
                break
            drafted.append(tok)
            new = [tok]
        proposal = self.to_target(tokens, self.draft_text(context, drafted))
        return Draft(proposal[:max_tokens])

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        return None  # the next propose re-synchronises by common prefix

    def end(self, request_id: str) -> None:
        st = self._states.pop(request_id, None)
        if st is not None:
            st.kv.free()
