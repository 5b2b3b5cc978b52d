"""llama.cpp's `ngram-mod`: a constant-size pool of n-gram hash -> next token, shared by all
requests of an engine.

Every n-gram of every request (prompt and output) is hashed with a multiplicative (LCG-style)
hash, reduced modulo the pool size, and its slot in a fixed array remembers the token that
followed it, last writer wins. Drafting hashes the context's last n tokens, reads the next token,
appends it and repeats, so draft length varies with how far the stored continuation goes. Memory
and time per token are constant (collisions only cost rejected drafts; verification keeps the
output exact).

The pool (`HashPool`, int32 slots, `DEFAULT_POOL_SIZE` = 1M slots = 4 MiB; llama.cpp uses 4M)
is allocated on first write. Drafters made by one registry share one pool per (n, size)
through a `PoolStore`, as llama.cpp's server shares one instance between all slots, so several
speculative configs differing only in other knobs do not each hold a copy.

A seeded sampled request (`DraftRequest.request_local`) drafts from a pool of its own: a dict
holding only the slots its history wrote, with the same hash and collisions, so its text does
not depend on other requests. Its n-grams still go into the shared pool (see
`tokenleap.drafters.base`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from tokenleap.drafters.base import Draft, DraftRequest
from tokenleap.drafters.methods import MethodRecord, option, options_of
from tokenleap.drafters.ngram_map import ngram_size_n_option
from tokenleap.errors import TokenleapError

if TYPE_CHECKING:
    from tokenleap.drafters.spec import SpecConfig

_MULT = 6364136223846793005  # Knuth's MMIX LCG multiplier
_MASK = (1 << 64) - 1
_EMPTY = -1
DEFAULT_POOL_SIZE = 1 << 20  # slots (4 bytes each)


class HashPool:
    """`size` int32 slots, each -1 (empty) or the token last seen after an n-gram hashing there;
    the array is allocated on the first write."""

    def __init__(self, size: int = DEFAULT_POOL_SIZE) -> None:
        if size < 1:
            raise TokenleapError(f"ngram-mod pool size must be >= 1, got {size}")
        self.size = size
        self._slots: np.ndarray | None = None  # [size] int32

    @property
    def nbytes(self) -> int:
        """Bytes allocated so far (0 until the first write)."""
        return 0 if self._slots is None else int(self._slots.nbytes)

    def get(self, slot: int) -> int:
        return _EMPTY if self._slots is None else int(self._slots[slot])

    def put(self, slot: int, token: int) -> None:
        if self._slots is None:
            self._slots = np.full(self.size, _EMPTY, dtype=np.int32)
        self._slots[slot] = token


class PoolStore:
    """The pools of one owner (a drafter registry), one per (n-gram length, size)."""

    def __init__(self) -> None:
        self._pools: dict[tuple[int, int], HashPool] = {}

    def get(self, size_n: int, size: int = DEFAULT_POOL_SIZE) -> HashPool:
        key = (size_n, size)
        if key not in self._pools:
            self._pools[key] = HashPool(size)
        return self._pools[key]

    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._pools.values())


def ngram_slot(ngram: Sequence[int], size: int) -> int:
    """The pool slot of an n-gram: an LCG-style multiplicative hash, high bits modulo `size`."""
    h = 0
    for tok in ngram:
        h = ((h + int(tok) + 1) * _MULT) & _MASK
    return (h >> 20) % size


class NgramModDrafter:
    name: ClassVar[str] = "ngram-mod"
    needs_hidden_states: ClassVar[bool] = False

    def __init__(self, size_n: int = 4, pool_size: int = DEFAULT_POOL_SIZE, pool: HashPool | None = None) -> None:
        if size_n < 1:
            raise TokenleapError(f"ngram-mod n-gram length must be >= 1, got {size_n}")
        if pool is not None and pool.size != pool_size:
            raise TokenleapError(f"ngram-mod pool has {pool.size} slots, expected {pool_size}")
        self.size_n = size_n
        self.pool = pool if pool is not None else HashPool(pool_size)
        self._indexed: dict[str, int] = {}
        self._local: dict[str, dict[int, int]] = {}  # request-local pools (seeded sampled requests)

    def _index(self, request_id: str, tokens: Sequence[int]) -> None:
        n, size = self.size_n, self.pool.size
        done = self._indexed.get(request_id, 0)
        local = self._local.get(request_id)
        for end in range(max(done, n), len(tokens)):
            slot, token = ngram_slot(tokens[end - n : end], size), int(tokens[end])
            self.pool.put(slot, token)
            if local is not None:
                local[slot] = token
        self._indexed[request_id] = max(done, len(tokens))

    def begin(self, request: DraftRequest) -> None:
        self._indexed[request.request_id] = 0
        if request.request_local:
            self._local[request.request_id] = {}
        self._index(request.request_id, request.prompt_ids)

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        self._index(request_id, tokens)
        if len(tokens) < self.size_n:
            return Draft()
        local = self._local.get(request_id)
        lookup = self.pool.get if local is None else (lambda slot: local.get(slot, _EMPTY))
        window = list(tokens[-self.size_n :])
        draft: list[int] = []
        while len(draft) < max_tokens:
            nxt = lookup(ngram_slot(window, self.pool.size))
            if nxt == _EMPTY:
                break
            draft.append(nxt)
            window = window[1:] + [nxt]
        return Draft(draft)

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        return None

    @property
    def shared_store(self) -> object:
        """What `learn` writes to: the pool, shared by the engine's ngram-mod drafters of one size."""
        return self.pool

    def learn(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Write the n-grams of an answer produced elsewhere (another replica) into the pool."""
        tokens = [int(t) for t in (*prompt_ids, *output_ids)]
        n, size = self.size_n, self.pool.size
        for end in range(n, len(tokens)):
            self.pool.put(ngram_slot(tokens[end - n : end], size), tokens[end])

    def end(self, request_id: str) -> None:
        self._indexed.pop(request_id, None)  # its n-grams stay in the shared pool
        self._local.pop(request_id, None)


def pools_shared(registry: Any) -> dict[str, Any]:
    """What ngram-mod drafters of one registry share: one pool per (n, size)."""
    return {"pools": PoolStore()}


@dataclass(frozen=True)
class NgramModOptions:
    """ngram-mod's options: the key length (current llama.cpp's `--spec-ngram-mod-n-match`) and the shared
    pool's size."""

    ngram_size_n: int = ngram_size_n_option(("--spec-ngram-mod-n-match",))
    ngram_mod_pool_size: int = option(DEFAULT_POOL_SIZE, help="hash pool slots (4 bytes each, allocated on first use)",
                                      flags=("--spec-ngram-mod-pool-size",), per_request=False)

    def __post_init__(self) -> None:
        if self.ngram_size_n < 1 or self.ngram_mod_pool_size < 1:
            raise TokenleapError(
                f"ngram_size_n and ngram_mod_pool_size must be >= 1, "
                f"got {self.ngram_size_n} and {self.ngram_mod_pool_size}"
            )


# one pool per (n, size) for every drafter of a registry
def _build(config: SpecConfig, *, pools: PoolStore, **_: Any) -> NgramModDrafter:
    opts = options_of(config, "ngram-mod", NgramModOptions)
    n, size = opts.ngram_size_n, opts.ngram_mod_pool_size
    return NgramModDrafter(n, size, pool=pools.get(n, size))


METHOD = MethodRecord(
    "ngram-mod",
    _build,
    "llama.cpp's ngram-mod: a constant-size rolling-hash pool shared by all requests",
    options=NgramModOptions,
    shared=pools_shared,
)
