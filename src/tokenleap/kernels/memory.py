"""Buffers on transparent huge pages for the memory a decode streams (weights, the KV cache).

A decode step reads every weight, and at long context the whole KV cache, once per token. On
4 KiB pages each core's stream crosses a page every 4 KiB (a TLB miss each time; the hardware
prefetchers stop at page ends); on 2 MB pages it crosses one every 2 MB. Linux gives an anonymous
mapping huge pages where it is asked (`madvise(MADV_HUGEPAGE)`, the `madvise` THP setting most
distributions ship) and where a whole 2 MB page fits, aligned, inside the mapping. Allocators do
neither (torch's never madvises, numpy's only from 4 MB and unaligned), so a buffer of 2 MB or
more here is its own private anonymous mapping that starts on a 2 MB boundary, madvised over its
whole pages, and over the last, partly used one only when at least half of it is used (no more
than 1 MB per buffer resident beyond its bytes). Fresh anonymous pages are zero, and untouched
ones cost no memory. Measured (`benchmarks/quant_stream.py --pages both`, `benchmarks/weight_pages.py`):
one row of a 1B model's Q4_K linears reads 7-18 % faster on huge pages, and decoding runs 1.04x.
A model's weights under 2 MB (a 1.5B's QKV and output projections, every matrix of a 135M) would
each sit on 4 KiB pages; `gather_on_huge_pages` moves them onto one shared mapping at load.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable

import numpy as np
import torch

HUGE_PAGE = 2 << 20


def huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor | None:
    """A zero-filled tensor of `shape` and `dtype` on its own huge-page mapping, or None when it
    is under 2 MB or this system has no `madvise` (the caller then allocates as it would)."""
    n = int(np.prod(shape)) * dtype.itemsize
    if n < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    region = mmap.mmap(-1, n + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    whole = np.frombuffer(region, dtype=np.uint8)
    lead = -whole.ctypes.data % HUGE_PAGE
    tail = n % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, lead, n - tail + (HUGE_PAGE if 2 * tail >= HUGE_PAGE else 0))
    except OSError:  # a kernel built without transparent huge pages: the aligned buffer still serves
        pass
    # the view keeps the mapping alive; it is unmapped when the last tensor over it goes
    return torch.from_numpy(whole[lead : lead + n]).view(dtype).reshape(shape)


def copy_to_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `t`, on its own huge-page mapping from 2 MB on (`huge_page_tensor`),
    else from torch's allocator: for weights made at run time (a reduced draft vocabulary's head)."""
    out = huge_page_tensor(tuple(t.shape), t.dtype)
    if out is None:
        return t.clone(memory_format=torch.contiguous_format)
    out.copy_(t)
    return out


def gather_on_huge_pages(tensors: Iterable[torch.Tensor], align: int = 64) -> int:
    """Move the contiguous tensors under 2 MB among `tensors` (a model's small weights: a 1.5B's
    QKV and output projections, every matrix of a 135M) into one shared huge-page mapping, in the
    order given, each `align`-byte aligned; in place (`Tensor.set_`: every holder of a tensor
    object sees its new storage; views made of it before keep the old bytes). Decoding the
    Qwen2.5-Coder-1.5B then runs 1.023x (AVX2: 1.033x), against a noise of ~1.016x in a control
    where nothing moves (`benchmarks/weight_pages.py MODEL --against no-gather`). Returns the
    bytes moved (0 when fewer than 2 MB would move, or without `madvise`)."""
    small, seen = [], set()
    for t in tensors:
        n = t.numel() * t.element_size()
        if 0 < n < HUGE_PAGE and t.is_contiguous() and t.device.type == "cpu" and id(t) not in seen:
            seen.add(id(t))
            small.append((t, n))
    offsets, total = [], 0
    for _, n in small:
        offsets.append(total)
        total += -(-n // align) * align
    arena = huge_page_tensor((total,)) if small else None
    if arena is None:
        return 0
    for (t, n), off in zip(small, offsets):
        view = arena[off : off + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        with torch.no_grad():
            t.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    return sum(n for _, n in small)
