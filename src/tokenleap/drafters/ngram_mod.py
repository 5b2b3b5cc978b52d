"""llama.cpp's `ngram-mod`: a constant-size pool of n-gram hash -> next token, shared by all
requests of an engine.

Every n-gram of every request (prompt and output) is hashed with a multiplicative (LCG-style)
hash and its slot in a fixed array remembers the token that followed it, last writer wins.
Drafting hashes the context's last n tokens, reads the next token, appends it and repeats, so
draft length varies with how far the stored continuation goes. Memory and time per token are
constant (collisions only cost rejected drafts; verification keeps the output exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from tokenleap.drafters.base import Draft, DraftRequest

_MULT = 6364136223846793005  # Knuth's MMIX LCG multiplier
_MASK = (1 << 64) - 1
_EMPTY = -1


class NgramModDrafter:
    name: ClassVar[str] = "ngram-mod"
    needs_hidden_states: ClassVar[bool] = False

    def __init__(self, size_n: int = 4, pool_bits: int = 22) -> None:
        self.size_n = size_n
        self.pool = np.full(1 << pool_bits, _EMPTY, dtype=np.int32)  # 4M slots, 16 MiB
        self._mask = (1 << pool_bits) - 1
        self._indexed: dict[str, int] = {}

    def _slot(self, ngram: Sequence[int]) -> int:
        h = 0
        for tok in ngram:
            h = ((h + int(tok) + 1) * _MULT) & _MASK
        return (h >> 20) & self._mask

    def _index(self, request_id: str, tokens: Sequence[int]) -> None:
        n = self.size_n
        done = self._indexed.get(request_id, 0)
        for end in range(max(done, n), len(tokens)):
            self.pool[self._slot(tokens[end - n : end])] = tokens[end]
        self._indexed[request_id] = max(done, len(tokens))

    def begin(self, request: DraftRequest) -> None:
        self._indexed[request.request_id] = 0
        self._index(request.request_id, request.prompt_ids)

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        self._index(request_id, tokens)
        if len(tokens) < self.size_n:
            return Draft()
        window = list(tokens[-self.size_n :])
        draft: list[int] = []
        while len(draft) < max_tokens:
            nxt = int(self.pool[self._slot(window)])
            if nxt == _EMPTY:
                break
            draft.append(nxt)
            window = window[1:] + [nxt]
        return Draft(draft)

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        return None

    def end(self, request_id: str) -> None:
        self._indexed.pop(request_id, None)  # its n-grams stay in the shared pool
