"""Attention over the slot-blocked KV caches (bf16 and q8_0, attn16.h): a reference, row
invariance (rows of one sequence share K/V reads in the kernel), unused slots never read,
token-tree rows, and q8_0 written by the kernel exactly as by `KVCache.write`."""

from __future__ import annotations

import math

import pytest
import torch

from tokenleap.attention import causal_mask, tree_mask
from tokenleap.attention.ops import RowGroup, plan_rows
from tokenleap.kernels import CpuKernels
from tokenleap.kv.cache import KVCache, q8_dequantize, q8_quantize

DTYPES = [torch.bfloat16, torch.int8]  # bf16 and q8_0 caches


@pytest.fixture(scope="module")
def bf16_kernels(kernels: CpuKernels) -> CpuKernels:
    if not kernels.bf16_attention:
        pytest.skip("no bf16 attention kernels on this machine")
    return kernels


def _cache(
    kv_heads: int, hd: int, keys: torch.Tensor, values: torch.Tensor, capacity: int, dtype: torch.dtype = torch.bfloat16
) -> KVCache:
    kv = KVCache(1, kv_heads, hd, dtype=dtype, max_capacity=capacity, initial_capacity=capacity, blocked=True)
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(9, 3, 64), (4, 1, 256)])
def test_rows_are_invariant_to_the_rows_beside_them(
    bf16_kernels: CpuKernels, heads: int, kv_heads: int, hd: int, dtype: torch.dtype
) -> None:
    """A row gives the same bits alone (decoding), among its draft's rows, in a 25-row chunk
    split across jobs, and beside another sequence's rows (256-wide heads: P.V in two halves)."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(kv_heads, 50, hd, generator=g)
    values = torch.randn(kv_heads, 50, hd, generator=g)
    qkv = torch.randn(25, (heads + 2 * kv_heads) * hd, generator=g)
    other = torch.randn(4, (heads + 2 * kv_heads) * hd, generator=g)

    def cache() -> KVCache:
        return _cache(kv_heads, hd, keys, values, 128, dtype)

    alone = torch.cat([_run(bf16_kernels, [(kv, qkv[i : i + 1], None)], heads) for kv in [cache()] for i in range(25)])
    together = _run(bf16_kernels, [(cache(), qkv, None)], heads)
    assert torch.equal(together, alone)
    few = _run(bf16_kernels, [(cache(), qkv[:3], None)], heads)
    assert torch.equal(few, alone[:3])
    mixed = _run(bf16_kernels, [(cache(), other, None), (cache(), qkv[:5], None)], heads)
    assert torch.equal(mixed[4:], alone[:5])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(4, 2, 32), (4, 1, 256)])
def test_tree_rows_equal_their_paths_decoded_in_order(
    bf16_kernels: CpuKernels, heads: int, kv_heads: int, hd: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(4)
    start = 29  # the tree straddles a 16-slot block boundary
    keys = torch.randn(kv_heads, start, hd, generator=g)
    values = torch.randn(kv_heads, start, hd, generator=g)
    parents = [-1, 0, 0, 1, 2, 3, -1]
    qkv = torch.randn(len(parents), (heads + 2 * kv_heads) * hd, generator=g)
    tree = _run(bf16_kernels, [(_cache(kv_heads, hd, keys, values, 64, dtype), qkv, tree_mask(parents, start))], heads)
    for node in range(len(parents)):
        path, p = [], node
        while p >= 0:
            path.insert(0, p)
            p = parents[p]
        kv = _cache(kv_heads, hd, keys, values, 64, dtype)
        chain = _run(bf16_kernels, [(kv, qkv[path], None)], heads)
        assert torch.equal(tree[node], chain[-1]), f"tree row {node} (path {path})"


@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(4, 4, 32), (9, 3, 64), (8, 2, 128), (4, 1, 256)])
def test_q8_0_matches_reference_and_never_reads_past_the_last_block(
    bf16_kernels: CpuKernels, heads: int, kv_heads: int, hd: int
) -> None:
    """Against a float64 reference over the same q8_0 keys, values and queries (integer sums
    exact, float steps fp32), and within q8_0's error of attention over the unquantized ones."""
    g = torch.Generator().manual_seed(heads * hd + 1)
    start, rows, cap = 37, 7, 96
    keys = torch.randn(kv_heads, start, hd, generator=g)
    values = torch.randn(kv_heads, start, hd, generator=g)
    kv = _cache(kv_heads, hd, keys, values, cap, torch.int8)
    # fp16 NaN scales in the blocks past slot 47 (the last row's block): never read
    for kind in (0, 1):
        kv.storage()[0, kind].view(kv_heads, cap // 16, -1)[:, 3:, 16 * hd :].view(torch.float16).fill_(float("nan"))
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd, generator=g)
    out = _run(bf16_kernels, [(kv, qkv, None)], heads)
    assert torch.isfinite(out).all()
    q = qkv[:, : heads * hd].view(rows, heads, hd)
    k_all = torch.cat([keys, qkv[:, heads * hd : (heads + kv_heads) * hd].view(rows, kv_heads, hd).transpose(0, 1)], 1)
    v_all = torch.cat([values, qkv[:, (heads + kv_heads) * hd :].view(rows, kv_heads, hd).transpose(0, 1)], 1)
    kq, vq, qq = (q8_dequantize(*q8_quantize(t)).double() for t in (k_all, v_all, q))
    torch.testing.assert_close(kv.keys(0, start + rows).double(), kq)  # the kernel wrote what torch would
    torch.testing.assert_close(kv.values(0, start + rows).double(), vq)
    group = heads // kv_heads
    ref = torch.empty(rows, heads, hd, dtype=torch.float64)
    exact = torch.empty(rows, heads, hd, dtype=torch.float64)
    for r in range(rows):
        for h in range(heads):
            n = start + r + 1
            ref[r, h] = ((kq[h // group, :n] @ qq[r, h]) / math.sqrt(hd)).softmax(0) @ vq[h // group, :n]
            p = ((k_all[h // group, :n].double() @ q[r, h].double()) / math.sqrt(hd)).softmax(0)
            exact[r, h] = p @ v_all[h // group, :n].double()
    torch.testing.assert_close(out, ref.reshape(rows, -1).float(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out, exact.reshape(rows, -1).float(), atol=5e-2, rtol=5e-2)


def test_q8_0_kernel_writes_the_bytes_torch_writes(bf16_kernels: CpuKernels) -> None:
    """The kernel's K/V writes (rows attended on the kernel) equal `KVCache.write` of the same
    rotated keys and values, byte for byte, so the torch path and the kernels share caches."""
    heads, kv_heads, hd, rows = 4, 2, 64, 21
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)
    qkv[3, heads * hd : (heads + 1) * hd] = 0.0  # an all-zero block: scale 0
    on_kernel = KVCache(1, kv_heads, hd, dtype=torch.int8, max_capacity=32, initial_capacity=32, blocked=True)
    _run(bf16_kernels, [(on_kernel, qkv, None)], heads)
    by_torch = KVCache(1, kv_heads, hd, dtype=torch.int8, max_capacity=32, initial_capacity=32, blocked=True)
    k = qkv[:, heads * hd : (heads + kv_heads) * hd].view(rows, kv_heads, hd).transpose(0, 1)
    v = qkv[:, (heads + kv_heads) * hd :].view(rows, kv_heads, hd).transpose(0, 1)
    by_torch.write(0, 0, k, v)
    assert torch.equal(on_kernel.storage(), by_torch.storage())
