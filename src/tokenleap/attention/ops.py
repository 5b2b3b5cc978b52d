"""Scaled dot-product attention (Vaswani et al., 2017) over a KV cache, with explicit masks.

Two paths compute the same function:

* the *batch* path (long prefills): one `scaled_dot_product_attention` call over all new rows;
* the *row* path (decoding and verification, few new rows): each query row attends, on its own,
  to exactly the cache slots it may see, in slot order. A row's result then depends only on
  its own query and keys, never on how many other rows share the forward or how long the cache
  is past it. That is what makes verifying k+1 draft rows numerically identical to k+1
  single-token decode steps (losslessness in floating point, ARCHITECTURE.md). With the compiled
  kernels the row path is `CpuKernels.attention`, driven by a `RowPlan` (`plan_rows`) that may
  mix rows of several sequences (a batched decode step); without them, `attend` below.

Masks are boolean `[n_new, n_cached + n_new]`, True where a new row may attend to a slot; `None`
means causal (row i sees every cached slot and new rows 0..i). Tree verification passes the
ancestor mask of a token tree (`tree_mask`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenleap.kernels import RowPlan
from tokenleap.kv.cache import KVCache


@dataclass(frozen=True)
class AttentionMask:
    """Which cache slots each new row may attend to. `mask is None` means causal."""

    mask: torch.Tensor | None = None  # [n_new, n_cached + n_new] bool

    def row_slots(self, row: int, start: int) -> torch.Tensor | int:
        """Slots row `row` sees: an int `end` (slots 0..end-1) for causal, else an index tensor."""
        if self.mask is None:
            return start + row + 1
        return self.mask[row].nonzero().squeeze(1)


def causal_mask() -> AttentionMask:
    return AttentionMask(None)


def tree_mask(parents: Sequence[int], num_cached: int) -> AttentionMask:
    """Mask for new rows forming a tree: row i sees all cached slots, itself and its ancestors.

    `parents[i]` is the index of row i's parent among the new rows, or -1 for a root (a child of
    the last cached token).
    """
    n = len(parents)
    mask = torch.zeros(n, num_cached + n, dtype=torch.bool)
    mask[:, :num_cached] = True
    for i, parent in enumerate(parents):
        if parent >= i:
            raise ValueError(f"tree parents must precede their children (row {i}, parent {parent})")
        mask[i, num_cached + i] = True
        if parent >= 0:
            mask[i, num_cached : num_cached + n] |= mask[parent, num_cached : num_cached + n]
    return AttentionMask(mask)


@dataclass(frozen=True)
class RowGroup:
    """New rows of one sequence in a forward: `n` tokens written from slot `start` of `kv`."""

    kv: KVCache
    start: int
    positions: torch.Tensor  # [n] int64
    mask: AttentionMask
    window: int | None = None  # blocked caches, chains only: a row at position p sees positions > p - window


def plan_rows(groups: Sequence[RowGroup]) -> RowPlan:
    """The attention kernel's per-row plan for `groups`, concatenated in order. The caches must
    already have room for the new rows (`KVCache.reserve`) and be all blocked or all plain."""
    blocked, dtype = groups[0].kv.blocked, groups[0].kv.dtype
    if any(g.kv.blocked != blocked or g.kv.dtype != dtype for g in groups):
        raise ValueError("plan_rows: caches of one forward must share a layout")
    positions = torch.cat([g.positions for g in groups]).to(torch.int64)
    counts = [int(g.positions.shape[0]) for g in groups]
    # per row, from Python lists (a decode step's few rows: cheaper than repeat_interleave)
    kv_base = torch.tensor(
        [g.kv.storage().data_ptr() for g, n in zip(groups, counts) for _ in range(n)], dtype=torch.int64
    )
    capacity = torch.tensor([g.kv.capacity for g, n in zip(groups, counts) for _ in range(n)], dtype=torch.int64)
    write_slot = torch.tensor(
        [s for g, n in zip(groups, counts) for s in range(g.start, g.start + n)], dtype=torch.int64
    )
    slot_end: torch.Tensor | None  # None below for fp32 caches' trees (slot lists instead)
    slot_end = write_slot + 1  # a row's own slot is the last it sees (tree: ancestors precede it)
    slot_off = slot_idx = mask_start = mask = None
    max_slots = int(slot_end.max())
    trees = any(g.mask.mask is not None for g in groups)
    if trees and blocked:
        # blocked caches: a tree row sees the cached slots, then its path (ancestors and itself),
        # which the kernel lays out as if decoded in order (mask_start = tree start, -1 = chain)
        width = max(counts)
        mask = torch.zeros(len(positions), width, dtype=torch.uint8)
        mask_start = torch.full((len(positions),), -1, dtype=torch.int64)
        row = 0
        for g, n in zip(groups, counts):
            if g.mask.mask is not None:
                path = g.mask.mask[:, g.start : g.start + n]
                mask[row : row + n, :n] = path
                mask_start[row : row + n] = g.start
                slot_end[row : row + n] = g.start + path.sum(1)
            row += n
    elif trees:
        lists = []
        for g, n in zip(groups, counts):
            for i in range(n):
                slots = g.mask.row_slots(i, g.start)
                lists.append(torch.arange(slots) if isinstance(slots, int) else slots)
        sizes = torch.tensor([len(x) for x in lists], dtype=torch.int64)
        slot_off = torch.zeros(len(lists) + 1, dtype=torch.int64)
        slot_off[1:] = sizes.cumsum(0)
        slot_idx = torch.cat(lists).to(torch.int64).contiguous()
        slot_end = None
        max_slots = int(sizes.max())
    slot_lo = None
    if any(g.window is not None for g in groups):
        if not blocked or trees:
            raise ValueError("plan_rows: a window bound is for chains over blocked caches (else pass a window mask)")
        lo = [
            (g.positions - g.window + 1).clamp(min=0) if g.window is not None else torch.zeros_like(g.positions)
            for g in groups
        ]
        slot_lo = torch.cat(lo).to(torch.int64)  # cached slot i holds position i
    return RowPlan(positions, kv_base, capacity, write_slot, slot_end, slot_off, slot_idx, -(-max_slots // 16) * 16,
                   blocked=blocked, mask_start=mask_start, mask=mask, slot_lo=slot_lo,
                   kv_type=groups[0].kv.kv_type if blocked else 0)


def attend(
    q: torch.Tensor,  # [n, heads, head_dim] fp32
    kv: KVCache,
    layer: int,
    start: int,
    mask: AttentionMask,
    *,
    row_path: bool,
) -> torch.Tensor:  # [n, heads * head_dim] fp32
    """Attention of `n` new rows (their K/V already written at slots `start..`) over the cache,
    in torch: SDPA over all rows (batch path) or one SDPA per row (row path, no kernels)."""
    n, heads, head_dim = q.shape
    end = start + n
    keys, values = kv.keys(layer, end), kv.values(layer, end)
    if not row_path:
        # [1, heads, n, d] against [1, kv_heads, end, d]
        qb = q.transpose(0, 1).unsqueeze(0)
        kb, vb = keys.unsqueeze(0), values.unsqueeze(0)
        if mask.mask is None and start == 0:
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        else:
            m = mask.mask
            if m is None:
                m = torch.ones(n, end, dtype=torch.bool).tril(start)
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=m, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(n, heads * head_dim)
    # Row path without compiled kernels: one call per row over exactly the slots it sees.
    rows = []
    for i in range(n):
        slots = mask.row_slots(i, start)
        if isinstance(slots, int):
            k_i, v_i = keys[:, :slots], values[:, :slots]
        else:
            k_i, v_i = keys.index_select(1, slots), values.index_select(1, slots)
        rows.append(
            F.scaled_dot_product_attention(
                q[i].unsqueeze(1).unsqueeze(0), k_i.unsqueeze(0), v_i.unsqueeze(0), enable_gqa=True
            )  # [1, heads, 1, d]
        )
    out = torch.cat(rows, dim=2) if n > 1 else rows[0]
    return out[0].transpose(0, 1).reshape(n, heads * head_dim)
