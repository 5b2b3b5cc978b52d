"""Attention masks (causal, token tree) and the three attention paths (batch, torch rows, kernels) over a KV cache."""

from __future__ import annotations

import math

import pytest
import torch

from tokenleap.attention import AttentionMask, attend, causal_mask, tree_mask
from tokenleap.attention.ops import RowGroup, plan_rows
from tokenleap.kernels import load_kernels
from tokenleap.kv.cache import KVCache


def test_tree_mask_structure() -> None:
    parents = [-1, 0, 0, 1, -1]
    m = tree_mask(parents, num_cached=3).mask
    assert m is not None and m.shape == (5, 8) and m.dtype == torch.bool
    assert m[:, :3].all()  # every row sees the whole cache
    expected_new = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [1, 1, 0, 1, 0],  # row 3: itself, parent 1, grandparent 0
            [0, 0, 0, 0, 1],  # a second root
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m[:, 3:], expected_new)


def test_tree_mask_chain_is_causal() -> None:
    m = tree_mask([-1, 0, 1, 2], num_cached=6).mask
    assert torch.equal(m, torch.ones(4, 10, dtype=torch.bool).tril(6))


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 0, 3, 1]])
def test_tree_mask_rejects_parent_after_child(parents: list[int]) -> None:
    with pytest.raises(ValueError, match="parents must precede"):
        tree_mask(parents, 2)


def test_row_slots() -> None:
    assert causal_mask().mask is None
    assert causal_mask().row_slots(2, start=10) == 13
    tree = tree_mask([-1, 0, 0], num_cached=2)
    assert tree.row_slots(2, start=2).tolist() == [0, 1, 2, 4]


def _cache_with(keys: torch.Tensor, values: torch.Tensor) -> KVCache:
    kv_heads, n, hd = keys.shape
    kv = KVCache(1, kv_heads, hd, dtype=torch.float32, max_capacity=128, initial_capacity=16)
    kv.reserve(n)
    kv.write(0, 0, keys, values)
    return kv


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Straightforward masked softmax(q k^T / sqrt(d)) v in float64, GQA by repeating KV heads."""
    n, heads, hd = q.shape
    group = heads // keys.shape[0]
    k = keys.double().repeat_interleave(group, 0)  # [heads, S, hd]
    v = values.double().repeat_interleave(group, 0)
    scores = torch.einsum("nhd,hsd->hns", q.double(), k) / math.sqrt(hd)
    scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    out = torch.einsum("hns,hsd->nhd", scores.softmax(-1), v)
    return out.reshape(n, heads * hd).float()


PATHS = ["batch", "rows-torch", "rows-kernels"]


def _attend(path: str, q: torch.Tensor, kv: KVCache, start: int, mask: AttentionMask) -> torch.Tensor:
    if path == "rows-kernels":
        kernels = load_kernels()
        if kernels is None:
            pytest.skip("kernels unavailable")
        n, heads, hd = q.shape
        positions = torch.arange(start, start + n)
        plan = plan_rows([RowGroup(kv, start, positions, mask)])
        keys, values = kv.keys(0, start + n)[:, start:], kv.values(0, start + n)[:, start:]
        qkv = torch.cat(
            [q.reshape(n, -1), keys.transpose(0, 1).reshape(n, -1), values.transpose(0, 1).reshape(n, -1)], 1
        )
        cos, sin = torch.ones(start + n, hd), torch.zeros(start + n, hd)  # identity rotary
        return kernels.attention(qkv, plan, 0, heads, kv.num_kv_heads, hd, cos, sin)
    return attend(q, kv, 0, start, mask, row_path=(path == "rows-torch"))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("start", [0, 9])
def test_attend_causal(path: str, start: int) -> None:
    g = torch.Generator().manual_seed(start)
    heads, kv_heads, hd, n = 6, 2, 32, 5
    keys = torch.randn(kv_heads, start + n, hd, generator=g)
    values = torch.randn(kv_heads, start + n, hd, generator=g)
    q = torch.randn(n, heads, hd, generator=g)
    kv = _cache_with(keys, values)
    out = _attend(path, q, kv, start, causal_mask())
    visible = torch.ones(n, start + n, dtype=torch.bool).tril(start)
    torch.testing.assert_close(out, _reference(q, keys, values, visible), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_attend_tree(path: str) -> None:
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, hd, start = 4, 4, 16, 7
    parents = [-1, 0, 0, 2, -1, 4]
    n = len(parents)
    keys = torch.randn(kv_heads, start + n, hd, generator=g)
    values = torch.randn(kv_heads, start + n, hd, generator=g)
    q = torch.randn(n, heads, hd, generator=g)
    kv = _cache_with(keys, values)
    mask = tree_mask(parents, start)
    out = _attend(path, q, kv, start, mask)
    torch.testing.assert_close(out, _reference(q, keys, values, mask.mask), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("path", ["rows-torch", "rows-kernels"])
def test_row_path_ignores_stale_slots_past_the_rows(path: str) -> None:
    """Slots past start + n (e.g. a rejected draft before truncation) are never attended to."""
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(2, 20, 16, generator=g)
    values = torch.randn(2, 20, 16, generator=g)
    q = torch.randn(3, 2, 16, generator=g)
    clean = _cache_with(keys[:, :13], values[:, :13])
    dirty = _cache_with(keys, values)  # 7 more slots of garbage after the rows
    assert torch.equal(_attend(path, q, clean, 10, causal_mask()), _attend(path, q, dirty, 10, causal_mask()))
