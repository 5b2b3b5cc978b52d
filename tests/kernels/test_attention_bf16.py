"""bf16 attention over the slot-blocked KV cache: a reference, row invariance (rows of one
sequence share K/V reads in the kernel), unused slots never read, and token-tree rows."""

from __future__ import annotations

import math

import pytest
import torch

from tokenleap.attention import causal_mask, tree_mask
from tokenleap.attention.ops import RowGroup, plan_rows
from tokenleap.kernels import CpuKernels
from tokenleap.kv.cache import KVCache


@pytest.fixture(scope="module")
def bf16_kernels(kernels: CpuKernels) -> CpuKernels:
    if not kernels.bf16_attention:
        pytest.skip("no bf16 attention kernels on this machine")
    return kernels


def _cache(kv_heads: int, hd: int, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> KVCache:
    kv = KVCache(1, kv_heads, hd, dtype=torch.bfloat16, max_capacity=capacity, initial_capacity=capacity, blocked=True)
    kv.reserve(keys.shape[1])
    kv.write(0, 0, keys, values)
    kv.commit(keys.shape[1])
    return kv


def _run(kernels: CpuKernels, groups: list[tuple[KVCache, torch.Tensor, object]], heads: int) -> torch.Tensor:
    """Attention of new rows (q, with their k/v) appended to each cache; identity rotary."""
    rgs, qkvs = [], []
    for kv, qkv, mask in groups:
        n = qkv.shape[0]
        kv.reserve(n)
        rgs.append(RowGroup(kv, kv.length, torch.arange(kv.length, kv.length + n), mask or causal_mask()))
        qkvs.append(qkv)
    plan = plan_rows(rgs)
    kv0 = groups[0][0]
    slots = int(plan.positions.max()) + 1
    cos, sin = torch.ones(slots, kv0.head_dim), torch.zeros(slots, kv0.head_dim)
    out = kernels.attention(torch.cat(qkvs), plan, 0, heads, kv0.num_kv_heads, kv0.head_dim, cos, sin)
    for kv, qkv, _ in groups:
        kv.commit(qkv.shape[0])
    return out


def _bf(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().double()


@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(4, 4, 16), (9, 3, 64), (4, 2, 32), (8, 2, 128), (4, 1, 256)])
def test_matches_reference_and_never_reads_past_the_last_block(
    bf16_kernels: CpuKernels, heads: int, kv_heads: int, hd: int
) -> None:
    g = torch.Generator().manual_seed(heads * hd)
    start, rows, cap = 37, 7, 96
    keys = torch.randn(kv_heads, start, hd, generator=g)
    values = torch.randn(kv_heads, start, hd, generator=g)
    kv = _cache(kv_heads, hd, keys, values, cap)
    kv.storage()[0, :, :, 48:] = float("nan")  # blocks past slot 47 (the last row's block) stay unread
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd, generator=g)
    out = _run(bf16_kernels, [(kv, qkv, None)], heads)
    q = qkv[:, : heads * hd].view(rows, heads, hd)
    k_all = torch.cat([keys, qkv[:, heads * hd : (heads + kv_heads) * hd].view(rows, kv_heads, hd).transpose(0, 1)], 1)
    v_all = torch.cat([values, qkv[:, (heads + kv_heads) * hd :].view(rows, kv_heads, hd).transpose(0, 1)], 1)
    group = heads // kv_heads
    ref = torch.empty(rows, heads, hd, dtype=torch.float64)
    for r in range(rows):
        for h in range(heads):
            s = (_bf(k_all[h // group, : start + r + 1]) @ _bf(q[r, h])) / math.sqrt(hd)
            ref[r, h] = s.softmax(0) @ _bf(v_all[h // group, : start + r + 1])
    assert torch.isfinite(out).all()
    # queries, keys, values and probabilities are bf16 (as transformers' bf16 attention), sums fp32
    torch.testing.assert_close(out, ref.reshape(rows, -1).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(9, 3, 64), (4, 1, 256)])
def test_rows_are_invariant_to_the_rows_beside_them(bf16_kernels: CpuKernels, heads: int, kv_heads: int, hd: int) -> None:
    """A row gives the same bits alone (decoding), among its draft's rows, in a 25-row chunk
    split across jobs, and beside another sequence's rows (256-wide heads: P.V in two halves)."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(kv_heads, 50, hd, generator=g)
    values = torch.randn(kv_heads, 50, hd, generator=g)
    qkv = torch.randn(25, (heads + 2 * kv_heads) * hd, generator=g)
    other = torch.randn(4, (heads + 2 * kv_heads) * hd, generator=g)

    def cache() -> KVCache:
        return _cache(kv_heads, hd, keys, values, 128)

    alone = torch.cat([_run(bf16_kernels, [(kv, qkv[i : i + 1], None)], heads) for kv in [cache()] for i in range(25)])
    together = _run(bf16_kernels, [(cache(), qkv, None)], heads)
    assert torch.equal(together, alone)
    few = _run(bf16_kernels, [(cache(), qkv[:3], None)], heads)
    assert torch.equal(few, alone[:3])
    mixed = _run(bf16_kernels, [(cache(), other, None), (cache(), qkv[:5], None)], heads)
    assert torch.equal(mixed[4:], alone[:5])


@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(4, 2, 32), (4, 1, 256)])
def test_tree_rows_equal_their_paths_decoded_in_order(bf16_kernels: CpuKernels, heads: int, kv_heads: int, hd: int) -> None:
    g = torch.Generator().manual_seed(4)
    start = 29  # the tree straddles a 16-slot block boundary
    keys = torch.randn(kv_heads, start, hd, generator=g)
    values = torch.randn(kv_heads, start, hd, generator=g)
    parents = [-1, 0, 0, 1, 2, 3, -1]
    qkv = torch.randn(len(parents), (heads + 2 * kv_heads) * hd, generator=g)
    tree = _run(bf16_kernels, [(_cache(kv_heads, hd, keys, values, 64), qkv, tree_mask(parents, start))], heads)
    for node in range(len(parents)):
        path, p = [], node
        while p >= 0:
            path.insert(0, p)
            p = parents[p]
        kv = _cache(kv_heads, hd, keys, values, 64)
        chain = _run(bf16_kernels, [(kv, qkv[path], None)], heads)
        assert torch.equal(tree[node], chain[-1]), f"tree row {node} (path {path})"
