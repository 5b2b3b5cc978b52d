"""Scaled dot-product attention (Vaswani et al., 2017) over a KV cache, with explicit masks.

Two paths compute the same function:

* the *batch* path (long prefills): one `scaled_dot_product_attention` call over all new rows;
* the *row* path (decoding and verification, few new rows): each query row attends, in its own
  call, to exactly the cache slots it may see, gathered in slot order. A row's result then
  depends only on its own query and keys, never on how many other rows share the forward or
  how long the cache is past it. That is what makes verifying k+1 draft rows numerically
  identical to k+1 single-token decode steps (losslessness in floating point, DESIGN.md §6).

Masks are boolean `[n_new, n_cached + n_new]`, True where a new row may attend to a slot; `None`
means causal (row i sees every cached slot and new rows 0..i). Tree verification passes the
ancestor mask of a token tree (`tree_mask`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenleap.kernels import CpuKernels
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


def _row_slots(mask: AttentionMask, n: int, start: int) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, int]:
    """Per-row visible slots for the kernel: (slot_end, slot_off, slot_idx, max_slots)."""
    if mask.mask is None:
        return torch.arange(start + 1, start + n + 1, dtype=torch.int64), None, None, start + n
    counts = mask.mask.sum(dim=1)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    idx = mask.mask.nonzero()[:, 1].contiguous()  # row-major: each row's slots ascending
    return None, offsets, idx, int(counts.max())


def attend(
    q: torch.Tensor,  # [n, heads, head_dim] fp32
    kv: KVCache,
    layer: int,
    start: int,
    mask: AttentionMask,
    *,
    row_path: bool,
    kernels: CpuKernels | None,
) -> torch.Tensor:  # [n, heads * head_dim] fp32
    """Attention of `n` new rows (their K/V already written at slots `start..`) over the cache."""
    n, heads, head_dim = q.shape
    end = start + n
    if row_path and kernels is not None:
        slot_end, slot_off, slot_idx, max_slots = _row_slots(mask, n, start)
        return kernels.attention(
            q, kv.layer_keys(layer), kv.layer_values(layer), slot_end, slot_off, slot_idx, max_slots
        )
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
