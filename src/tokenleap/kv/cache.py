"""Contiguous per-sequence KV cache with O(1) rollback.

One tensor per sequence holds keys and values of every layer, `[layers, 2, kv_heads,
capacity, head_dim]`, so that growing, truncating and compacting are single tensor operations
over all layers. Slots are filled left to right; `length` counts committed slots. Speculative
decoding writes a draft past `length`, then keeps a prefix (`truncate`, O(1): only the length
moves) or a tree path (`compact`, which copies the kept slots only). Capacity grows by
doubling, so appending is amortised O(1) per token.

A *blocked* cache (bf16, for the kernels' bf16 attention) keeps the same tensor shape but lays
each `[capacity, head_dim]` plane out for the kernel: keys in blocks of 16 slots, `[capacity/16,
head_dim/2, 16, 2]`, values in pairs of slots, `[capacity/2, head_dim, 2]` (see `kernels.c`).
`write`, `keys`, `values` and `compact` translate, so the torch path (prefill) reads and writes
it like a plain cache. Its capacity is a multiple of 16 and it starts zeroed.

A blocked *q8_0* cache (`dtype=torch.int8`; llama.cpp's `--cache-type-k/-v q8_0`) holds each
slot of a kv head as ggml's q8_0: per 32 dims, 32 int8 values and one fp16 scale, `head_dim +
head_dim/16` bytes a slot (0.53x bf16), in the tensor `[layers, 2, kv_heads, capacity, head_dim
* 17/16]` int8, in blocks of 16 slots: keys int8 `[head_dim/4, 16, 4]`, values int8 `[16,
head_dim]`, each then fp16 scales `[head_dim/32, 16]`.
`write` quantizes exactly as the kernel does (`q8_quantize` in attn16.h), bit for bit.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
from collections.abc import Sequence
from functools import lru_cache

import torch

from tokenleap.errors import TokenleapError
from tokenleap.kernels import KV_BF16, KV_Q8_0, kv_slot_bytes
from tokenleap.kernels.memory import huge_page_tensor

KV_CACHE_TYPES = {"bf16": torch.bfloat16, "q8_0": torch.int8}  # llama.cpp's names of the blocked formats


def q8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's q8_0 of `x` (`[..., n]`, n a multiple of 32) as the kernel computes it: per 32
    values d = fp16(max |x| / 127), q = round-half-even(x / d) in [-127, 127] (0 where d is 0).
    Returns (q int8 `[..., n]`, d float16 `[..., n/32]`)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    d = (blocks.abs().amax(-1) / 127.0).to(torch.float16)
    df = d.float().unsqueeze(-1)
    q = torch.where(df == 0, torch.zeros_like(blocks), torch.round(blocks / df)).clamp(-127, 127)
    return q.to(torch.int8).reshape(x.shape), d


def q8_dequantize(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """float32 values of q8_0 blocks (`q8_quantize`'s inverse up to rounding)."""
    return (q.float().reshape(*q.shape[:-1], -1, 32) * d.float().unsqueeze(-1)).reshape(q.shape)


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
        blocked: bool = False,
    ) -> None:
        if blocked and not (
            (dtype == torch.bfloat16 and head_dim % 2 == 0) or (dtype == torch.int8 and head_dim % 32 == 0)
        ):
            raise ValueError(
                "a blocked KV cache is bfloat16 with an even head_dim, or int8 (q8_0) with head_dim a multiple of 32"
            )
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_capacity = max_capacity
        self.blocked = blocked
        self.length = 0
        self._data = self._alloc(min(initial_capacity, max_capacity))

    @property
    def kv_type(self) -> int:
        """The blocked format (`tokenleap.kernels.KV_BF16` or `KV_Q8_0`)."""
        return KV_Q8_0 if self.dtype == torch.int8 else KV_BF16

    def _alloc(self, capacity: int) -> torch.Tensor:
        if self.blocked:
            capacity = -(-capacity // 16) * 16
        width = kv_slot_bytes(KV_Q8_0, self.head_dim) if self.dtype == torch.int8 else self.head_dim
        shape = (self.num_layers, 2, self.num_kv_heads, capacity, width)
        if self.device.type == "cpu":  # on huge pages from 2 MB on: a decode streams the cache (kernels/memory.py)
            data = huge_page_tensor(shape, self.dtype)
            if data is not None:
                return data  # zero-filled, its pages committed as they are written
        if self.blocked:  # the kernel multiplies unused slots by probability 0: no NaN garbage
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _q8(self, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q8_0 keys (kind 0) or values (1) as slot-major views: int8 `[layers, kv_heads,
        capacity/16, 16, head_dim]` (keys `[..., head_dim/4, 4]`) and fp16 scales `[layers,
        kv_heads, capacity/16, 16, head_dim/32]`."""
        L, H, C, D = self.num_layers, self.num_kv_heads, self.capacity, self.head_dim
        blocks = self._data[:, kind].view(L, H, C // 16, 16 * (D + D // 16))
        if kind == 0:
            q = blocks[..., : 16 * D].view(L, H, C // 16, D // 4, 16, 4).permute(0, 1, 2, 4, 3, 5)
        else:
            q = blocks[..., : 16 * D].view(L, H, C // 16, 16, D)
        d = blocks[..., 16 * D :].view(torch.float16).view(L, H, C // 16, D // 32, 16).permute(0, 1, 2, 4, 3)
        return q, d

    def _k_slots(self) -> torch.Tensor:
        """Blocked keys as a `[layers, kv_heads, capacity/16, 16, head_dim/2, 2]` view."""
        L, H, C, D = self.num_layers, self.num_kv_heads, self.capacity, self.head_dim
        return self._data[:, 0].view(L, H, C // 16, D // 2, 16, 2).permute(0, 1, 2, 4, 3, 5)

    def _v_slots(self) -> torch.Tensor:
        """Blocked values as a `[layers, kv_heads, capacity/2, 2, head_dim]` view."""
        L, H, C, D = self.num_layers, self.num_kv_heads, self.capacity, self.head_dim
        return self._data[:, 1].view(L, H, C // 2, D, 2).permute(0, 1, 2, 4, 3)

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
        # blocked or not, a plane's first `capacity * head_dim` values are slots 0..capacity-1
        data[:, :, :, : self.capacity] = self._data
        self._data = data

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k`, `v` (`[kv_heads, n, head_dim]`) at slots `start .. start+n`."""
        n = k.shape[1]
        if self.blocked and self.kv_type == KV_Q8_0:
            slots = torch.arange(start, start + n)
            for kind, x in enumerate((k, v)):
                q, d = q8_quantize(x)
                q_view, d_view = self._q8(kind)
                q_view[layer, :, slots // 16, slots % 16] = q.reshape(self.num_kv_heads, n, *q_view.shape[4:])
                d_view[layer, :, slots // 16, slots % 16] = d
            return
        if self.blocked:
            slots = torch.arange(start, start + n)
            H, D = self.num_kv_heads, self.head_dim
            self._k_slots()[layer, :, slots // 16, slots % 16] = k.reshape(H, n, D // 2, 2).to(self.dtype)
            self._v_slots()[layer, :, slots // 2, slots % 2] = v.to(self.dtype)
            return
        self._data[layer, 0, :, start : start + n] = k
        self._data[layer, 1, :, start : start + n] = v

    def keys(self, layer: int, end: int) -> torch.Tensor:
        """`[kv_heads, end, head_dim]`: a view, or for a blocked cache a float32 copy."""
        if self.blocked and self.kv_type == KV_Q8_0:
            return self._q8_read(0, layer, end)
        if self.blocked:
            H, D = self.num_kv_heads, self.head_dim
            blocks = -(-end // 16)
            return self._k_slots()[layer, :, :blocks].reshape(H, blocks * 16, D)[:, :end].float()
        return self._data[layer, 0, :, :end]

    def values(self, layer: int, end: int) -> torch.Tensor:
        """`[kv_heads, end, head_dim]`: a view, or for a blocked cache a float32 copy."""
        if self.blocked and self.kv_type == KV_Q8_0:
            return self._q8_read(1, layer, end)
        if self.blocked:
            H, D = self.num_kv_heads, self.head_dim
            pairs = -(-end // 2)
            return self._v_slots()[layer, :, :pairs].reshape(H, pairs * 2, D)[:, :end].float()
        return self._data[layer, 1, :, :end]

    def _q8_read(self, kind: int, layer: int, end: int) -> torch.Tensor:
        H, D = self.num_kv_heads, self.head_dim
        blocks = -(-end // 16)
        q, d = self._q8(kind)
        return q8_dequantize(
            q[layer, :, :blocks].reshape(H, blocks * 16, D), d[layer, :, :blocks].reshape(H, blocks * 16, D // 32)
        )[:, :end]

    def storage(self) -> torch.Tensor:
        """The whole `[layers, 2, kv_heads, capacity, head_dim]` tensor (q8_0: `head_dim * 17/16`
        bytes a slot) for the kernels; its address changes when the cache grows."""
        return self._data

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

    @torch.inference_mode()
    def compact(self, start: int, keep: Sequence[int]) -> None:
        """Keep slots `keep` (ascending absolute indices >= `start`), moved to `start..`; drop
        everything else after `start`. Copies only the kept slots (a tree path). In inference
        mode: the storage may have been (re)allocated inside a forward's inference mode, and
        inference tensors can only be updated in place there."""
        keep = list(keep)
        if not 0 <= start <= self.length:
            raise ValueError(f"compact: start {start} outside [0, {self.length}]")
        if any(b <= a for a, b in zip(keep, keep[1:])):
            raise ValueError("compact: keep must be strictly increasing")
        if keep and (keep[0] < start or keep[-1] >= self.length):
            raise ValueError(f"compact: slots {keep} outside [{start}, {self.length})")
        if keep != list(range(start, start + len(keep))):
            index = torch.tensor(keep, device=self.device)
            if self.blocked and self.kv_type == KV_Q8_0:
                dest = torch.arange(start, start + len(keep), device=self.device)
                for part in (*self._q8(0), *self._q8(1)):
                    part[:, :, dest // 16, dest % 16] = part[:, :, index // 16, index % 16].clone()
            elif self.blocked:
                dest = torch.arange(start, start + len(keep), device=self.device)
                ks, vs = self._k_slots(), self._v_slots()
                ks[:, :, dest // 16, dest % 16] = ks[:, :, index // 16, index % 16].clone()
                vs[:, :, dest // 2, dest % 2] = vs[:, :, index // 2, index % 2].clone()
            else:
                self._data[:, :, :, start : start + len(keep)] = self._data.index_select(3, index)
        self.length = start + len(keep)

    @torch.inference_mode()
    def fork(self) -> KVCache:
        """An independent copy holding the same slots (parallel sampling shares a prompt's prefill)."""
        twin = copy.copy(self)
        twin._data = self._alloc(self.capacity)
        twin._data.copy_(self._data)
        return twin

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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case, compared at C speed
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def resync(kv: KVCache, cached: list[int], context: Sequence[int]) -> list[int]:
    """Roll a draft model's cache (holding `cached`) back to its longest common prefix with
    `context` (O(1): rejected drafts are just cut), always re-feeding at least the last token;
    returns the tokens still to feed."""
    common = max(0, min(common_prefix(cached, context), len(context) - 1))
    kv.truncate(common)
    del cached[common:]
    return list(context[common:])
