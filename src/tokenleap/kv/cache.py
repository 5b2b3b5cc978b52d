"""Contiguous per-sequence KV cache with O(1) rollback.

One tensor per sequence holds keys and values of every layer, `[layers, 2, kv_heads,
capacity, head_dim]`, so that growing, truncating and compacting are single tensor operations
over all layers. Slots are filled left to right; `length` counts committed slots. Speculative
decoding writes a draft past `length`, then keeps a prefix (`truncate`, O(1): only the length
moves) or a tree path (`compact`, which copies the kept slots only). Capacity grows by
doubling, so appending is amortised O(1) per token.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Sequence
from functools import lru_cache

import torch

from tokenleap.errors import TokenleapError


class KVCache:
    """Keys and values of one sequence, for every layer."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        max_capacity: int,
        initial_capacity: int = 256,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_capacity = max_capacity
        self.length = 0
        self._data = self._alloc(min(initial_capacity, max_capacity))

    def _alloc(self, capacity: int) -> torch.Tensor:
        shape = (self.num_layers, 2, self.num_kv_heads, capacity, self.head_dim)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self._data.shape[3]

    def nbytes(self) -> int:
        return self._data.numel() * self._data.element_size()

    def reserve(self, n: int) -> None:
        """Make room for `n` more slots after `length` (grows by doubling)."""
        need = self.length + n
        if need > self.max_capacity:
            raise TokenleapError(
                f"sequence of {need} tokens exceeds the context length ({self.max_capacity})"
            )
        if need <= self.capacity:
            return
        new_cap = min(self.max_capacity, max(need, 2 * self.capacity))
        data = self._alloc(new_cap)
        data[:, :, :, : self.length] = self._data[:, :, :, : self.length]
        self._data = data

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k`, `v` (`[kv_heads, n, head_dim]`) at slots `start .. start+n`."""
        n = k.shape[1]
        self._data[layer, 0, :, start : start + n] = k
        self._data[layer, 1, :, start : start + n] = v

    def keys(self, layer: int, end: int) -> torch.Tensor:
        return self._data[layer, 0, :, :end]  # [kv_heads, end, head_dim] (a view)

    def values(self, layer: int, end: int) -> torch.Tensor:
        return self._data[layer, 1, :, :end]  # [kv_heads, end, head_dim] (a view)

    def storage(self) -> torch.Tensor:
        """The whole `[layers, 2, kv_heads, capacity, head_dim]` tensor (for the kernels; its
        address changes when the cache grows)."""
        return self._data

    def layer_keys(self, layer: int) -> torch.Tensor:
        return self._data[layer, 0]  # [kv_heads, capacity, head_dim] (slot stride head_dim)

    def layer_values(self, layer: int) -> torch.Tensor:
        return self._data[layer, 1]

    def commit(self, n: int) -> None:
        """Mark `n` slots after `length` (already written) as part of the sequence."""
        if self.length + n > self.capacity:
            raise ValueError(f"commit of {n} slots past capacity {self.capacity}")
        self.length += n

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` slots. O(1)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {length}")
        self.length = length

    def compact(self, start: int, keep: Sequence[int]) -> None:
        """Keep slots `keep` (ascending absolute indices >= `start`), moved to `start..`; drop
        everything else after `start`. Copies only the kept slots (a tree path)."""
        keep = list(keep)
        if not 0 <= start <= self.length:
            raise ValueError(f"compact: start {start} outside [0, {self.length}]")
        if any(b <= a for a, b in zip(keep, keep[1:])):
            raise ValueError("compact: keep must be strictly increasing")
        if keep and (keep[0] < start or keep[-1] >= self.length):
            raise ValueError(f"compact: slots {keep} outside [{start}, {self.length})")
        if keep != list(range(start, start + len(keep))):
            index = torch.tensor(keep, device=self.device)
            self._data[:, :, :, start : start + len(keep)] = self._data.index_select(3, index)
        self.length = start + len(keep)

    def free(self) -> None:
        """Release the storage; the cache can be reused and regrows on demand."""
        self.length = 0
        self._data = self._alloc(0)


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def trim_free_memory() -> bool:
    """Give freed heap memory back to the OS (glibc `malloc_trim`). Caches of a few MB to a few
    tens of MB come from the heap, and glibc keeps what they leave behind, so a server that
    served a burst of requests would otherwise stay at its high-water mark. False when the C
    library has no `malloc_trim`."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim(0)
    return True
