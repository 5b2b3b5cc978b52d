"""Compiled CPU kernels: linear and per-row attention against torch references, and row invariance."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from tokenleap.kernels import CpuKernels, PackedWeight, RowPlan
from tokenleap.kv.cache import KVCache


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _has_bf16_dot(kernels: CpuKernels) -> bool:
    """Whether the kernels were built with the AVX512-BF16 path (bf16-rounded activations)."""
    probe = getattr(kernels.lib, "tl_has_bf16_dot", None)
    return bool(probe()) if probe is not None else False


# --------------------------------------------------------------------------- linear


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("rows", "in_dim", "out_dim"), [(1, 32, 4), (3, 64, 37), (5, 576, 195), (9, 1536, 130)])
def test_linear_matches_torch(
    kernels: CpuKernels, wdtype: torch.dtype, bias: bool, rows: int, in_dim: int, out_dim: int
) -> None:
    g = _gen(rows * 1000 + out_dim)
    x = torch.randn(rows, in_dim, generator=g)
    w = (torch.randn(out_dim, in_dim, generator=g) / math.sqrt(in_dim)).to(wdtype)
    b = torch.randn(out_dim, generator=g) if bias else None
    y = kernels.linear(x, w, b)
    assert y.shape == (rows, out_dim) and y.dtype == torch.float32
    # Products are exact and accumulate in fp32. With bf16 weights on a CPU with AVX512-BF16 dot
    # products, the activations are rounded to bf16 (nearest even) once per call first.
    xr = x.bfloat16() if wdtype == torch.bfloat16 and _has_bf16_dot(kernels) else x
    ref = F.linear(xr.double(), w.double(), b.double() if b is not None else None).float()
    torch.testing.assert_close(y, ref, atol=1e-5 * math.sqrt(in_dim), rtol=1e-5)


def test_linear_output_tail_columns(kernels: CpuKernels) -> None:
    """out_dim % 4 != 0: the tail columns (computed outside the blocked loop) are right too."""
    g = _gen(7)
    x = torch.randn(6, 64, generator=g)
    w = torch.randn(7, 64, generator=g)
    y = kernels.linear(x, w)
    torch.testing.assert_close(y[:, 4:], x @ w[4:].T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_row_invariance(kernels: CpuKernels, wdtype: torch.dtype) -> None:
    """Each row of an M-row call is bit-identical to the 1-row call on that row, M = 1..33."""
    g = _gen(11)
    in_dim, out_dim = 576, 195
    x = torch.randn(33, in_dim, generator=g)
    w = torch.randn(out_dim, in_dim, generator=g).to(wdtype)
    b = torch.randn(out_dim, generator=g)
    singles = torch.cat([kernels.linear(x[i : i + 1], w, b) for i in range(33)])
    for m in range(1, 34):
        y = kernels.linear(x[:m], w, b)
        assert torch.equal(y[0], singles[0]), f"row 0 differs at M={m}"
        assert torch.equal(y, singles[:m]), f"some row differs at M={m}"
    # the same row at a different position in the batch
    perm = torch.randperm(33, generator=g)
    assert torch.equal(kernels.linear(x[perm], w, b), singles[perm])


def test_linear_non_contiguous_input(kernels: CpuKernels) -> None:
    g = _gen(12)
    x = torch.randn(64, 5, generator=g).T  # [5, 64], not contiguous
    w = torch.randn(8, 64, generator=g)
    torch.testing.assert_close(kernels.linear(x, w), x @ w.T, atol=1e-4, rtol=1e-5)


# --------------------------------------------------------------------------- attention


def _reference_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: list[torch.Tensor]
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v per row and head, over that row's visible slots, GQA by h // group."""
    rows, heads, hd = q.shape
    group = heads // keys.shape[0]
    out = torch.empty(rows, heads, hd, dtype=torch.float64)
    for r in range(rows):
        for h in range(heads):
            k = keys[h // group, visible[r]].double()
            v = values[h // group, visible[r]].double()
            scores = (k @ q[r, h].double()) / math.sqrt(hd)
            out[r, h] = scores.softmax(0) @ v
    return out.reshape(rows, heads * hd).float()


@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(4, 4, 16), (9, 3, 64), (4, 2, 32)], ids=["mha", "gqa3", "gqa2"])
def test_attention_causal_rows(
    kernel_attention: Callable[..., torch.Tensor], heads: int, kv_heads: int, hd: int
) -> None:
    g = _gen(heads * hd)
    cap, start, rows = 64, 20, 6
    q = torch.randn(rows, heads, hd, generator=g)
    keys = torch.randn(kv_heads, cap, hd, generator=g)
    values = torch.randn(kv_heads, cap, hd, generator=g)
    keys[:, start + rows :] = float("nan")  # slots past the last row must never be read
    values[:, start + rows :] = float("nan")
    slot_end = torch.arange(start + 1, start + rows + 1, dtype=torch.int64)
    out = kernel_attention(q, keys, values, slot_end - 1, slot_end=slot_end)
    ref = _reference_attention(q, keys, values, [torch.arange(int(e)) for e in slot_end])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(9, 3, 64), (4, 2, 32)], ids=["gqa3", "gqa2"])
def test_attention_index_list_rows(
    kernel_attention: Callable[..., torch.Tensor], heads: int, kv_heads: int, hd: int
) -> None:
    g = _gen(5 + hd)
    cap = 48
    q = torch.randn(4, heads, hd, generator=g)
    keys = torch.randn(kv_heads, cap, hd, generator=g) * 2
    values = torch.randn(kv_heads, cap, hd, generator=g)
    visible = [
        torch.tensor([0, 1, 2, 30]),
        torch.tensor([0, 1, 2, 30, 31, 35]),
        torch.tensor([7]),
        torch.arange(0, 40, 3),
    ]
    unseen = torch.ones(cap, dtype=torch.bool)  # poison every slot nobody sees
    unseen[torch.cat(visible)] = False
    keys[:, unseen] = float("nan")
    values[:, unseen] = float("nan")
    counts = torch.tensor([len(v) for v in visible])
    offsets = torch.zeros(5, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    idx = torch.cat(visible).to(torch.int64)
    own = torch.tensor([int(v[-1]) for v in visible])
    out = kernel_attention(q, keys, values, own, slot_off=offsets, slot_idx=idx)
    ref = _reference_attention(q, keys, values, visible)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_attention_row_invariance(kernel_attention: Callable[..., torch.Tensor]) -> None:
    """A row's output does not depend on which other rows share the call."""
    g = _gen(21)
    heads, kv_heads, hd, cap = 9, 3, 64, 80
    q = torch.randn(10, heads, hd, generator=g)
    keys = torch.randn(kv_heads, cap, hd, generator=g)
    values = torch.randn(kv_heads, cap, hd, generator=g)
    ends = torch.arange(41, 51, dtype=torch.int64)
    together = kernel_attention(q, keys, values, ends - 1, slot_end=ends)
    for r in range(10):
        alone = kernel_attention(q[r : r + 1], keys, values, ends[r : r + 1] - 1, slot_end=ends[r : r + 1])
        assert torch.equal(together[r], alone[0])


def test_attention_rotates_and_writes_each_row_to_its_own_cache(kernels: CpuKernels) -> None:
    """Rows of two sequences in one call: each row's rotated key and value land in its own
    cache at its slot, and its output equals a rotary-then-attention reference over that cache."""
    g = _gen(23)
    heads, kv_heads, hd, layers = 4, 2, 32, 2
    half = hd // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    ang = torch.outer(torch.arange(64, dtype=torch.float64), inv)
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()

    def rope(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:  # [n, h, hd]
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos[p].unsqueeze(1) + rot * sin[p].unsqueeze(1)

    caches, starts, news = [], [5, 11], [3, 2]
    for start, cap in zip(starts, (16, 32)):
        kv = KVCache(layers, kv_heads, hd, dtype=torch.float32, max_capacity=64, initial_capacity=cap)
        kv.reserve(start)
        for layer in range(layers):
            kv.write(
                layer, 0, torch.randn(kv_heads, start, hd, generator=g), torch.randn(kv_heads, start, hd, generator=g)
            )
        kv.commit(start)
        caches.append(kv)
    rows = sum(news)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd, generator=g)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, news)])
    plan = RowPlan(
        positions=positions,
        kv_base=torch.tensor([kv.storage().data_ptr() for kv, n in zip(caches, news) for _ in range(n)]),
        capacity=torch.tensor([kv.capacity for kv, n in zip(caches, news) for _ in range(n)]),
        write_slot=positions.clone(),
        slot_end=positions + 1,
        slot_off=None,
        slot_idx=None,
        max_slots=16,
    )
    out = kernels.attention(qkv, plan, 1, heads, kv_heads, hd, cos, sin)
    q = rope(qkv[:, : heads * hd].view(rows, heads, hd), positions)
    k = rope(qkv[:, heads * hd : (heads + kv_heads) * hd].view(rows, kv_heads, hd), positions)
    v = qkv[:, (heads + kv_heads) * hd :].view(rows, kv_heads, hd)
    r = 0
    for kv, start, n in zip(caches, starts, news):
        keys, values = kv.keys(1, start + n), kv.values(1, start + n)
        torch.testing.assert_close(keys[:, start:].transpose(0, 1), k[r : r + n], atol=1e-6, rtol=1e-5)
        assert torch.equal(values[:, start:].transpose(0, 1), v[r : r + n])
        ref = _reference_attention(q[r : r + n], keys, values, [torch.arange(start + i + 1) for i in range(n)])
        torch.testing.assert_close(out[r : r + n], ref, atol=1e-5, rtol=1e-4)
        r += n


def test_rmsnorm_and_silu_mul_match_torch(kernels: CpuKernels) -> None:
    g = _gen(24)
    x = torch.randn(5, 576, generator=g) * 3
    w = torch.randn(576, generator=g)
    torch.testing.assert_close(kernels.rmsnorm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), atol=1e-5, rtol=1e-5)
    gu = torch.randn(3, 2 * 1536, generator=g) * 4
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])  # saturated and zero inputs
    ref = F.silu(gu[:, :1536]) * gu[:, 1536:]
    torch.testing.assert_close(kernels.silu_mul(gu), ref, atol=1e-5, rtol=1e-5)


def test_gelu_mul_matches_torch(kernels: CpuKernels) -> None:
    """GeGLU's gate (Gemma 3) in C: within a few ulp of torch's tanh-approximate GELU, saturated
    inputs included, and each row its own (the same bits alone)."""
    g = _gen(25)
    gu = torch.randn(4, 2 * 1024, generator=g) * 3
    gu[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -9.0, 1e20, -1e20])
    ref = F.gelu(gu[:, :1024], approximate="tanh") * gu[:, 1024:]
    out = kernels.glu_mul(gu, "gelu_tanh")
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=2e-6)
    assert torch.isfinite(out).all()
    assert torch.equal(kernels.glu_mul(gu[2:3], "gelu_tanh"), out[2:3])
    with pytest.raises(ValueError, match="unknown MLP gate"):
        kernels.glu_mul(gu, "relu")


def test_head_norm_and_rmsnorm_add_match_torch(kernels: CpuKernels) -> None:
    """Gemma 3's fused QK-norm (query scale folded in) and post-norm + residual (norms.h)."""
    g = torch.Generator().manual_seed(7)
    rows, nq, nkv, hd = 3, 4, 1, 256
    qkv = torch.randn(rows, (nq + 2 * nkv) * hd, generator=g) * 3
    wq, wk = torch.randn(hd, generator=g), torch.randn(hd, generator=g)
    ref = qkv.clone()
    ref[:, : nq * hd] = F.rms_norm(qkv[:, : nq * hd].view(rows, nq, hd), (hd,), wq, 1e-6).view(rows, -1) * 0.25
    ref[:, nq * hd : (nq + nkv) * hd] = F.rms_norm(
        qkv[:, nq * hd : (nq + nkv) * hd].view(rows, nkv, hd), (hd,), wk, 1e-6
    ).view(rows, -1)
    ours = qkv.clone()
    kernels.head_norm(ours, 0, nq, hd, wq, 1e-6, 0.25)
    kernels.head_norm(ours, nq * hd, nkv, hd, wk, 1e-6)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours[:, (nq + nkv) * hd :], qkv[:, (nq + nkv) * hd :])  # the values are left alone
    x, o, w = (
        torch.randn(rows, 640, generator=g),
        torch.randn(rows, 640, generator=g) * 50,
        torch.randn(640, generator=g),
    )
    expect = x + F.rms_norm(o, (640,), w, 1e-6)
    kernels.rmsnorm_add(x, o, w, 1e-6)
    torch.testing.assert_close(x, expect, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        kernels.head_norm(qkv.t(), 0, 1, hd, wq, 1e-6)


def test_packed_linear_accumulates_and_is_row_invariant(kernels: CpuKernels) -> None:
    if not kernels.packed:
        pytest.skip("no packed kernel on this machine")
    g = _gen(25)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g)
    packed = PackedWeight.pack(w)
    x = torch.randn(11, 64, generator=g)
    # with AVX512-BF16 the kernel rounds activations to bf16; the AVX2 kernel keeps them fp32
    xr = (x.bfloat16() if _has_bf16_dot(kernels) else x).double()
    y = kernels.linear(x, packed, b)
    torch.testing.assert_close(y, (xr @ w.double().T + b.double()).float(), atol=1e-4, rtol=1e-5)
    singles = torch.cat([kernels.linear(x[i : i + 1], packed, b) for i in range(11)])
    assert torch.equal(y, singles)
    base = torch.randn(11, 96, generator=g)
    acc = base.clone()
    assert kernels.linear(x, packed, b, out=acc) is acc
    assert torch.equal(acc, base + y)
    with pytest.raises(ValueError, match="cannot pack"):
        PackedWeight.pack(torch.randn(20, 64).bfloat16())


# --------------------------------------------------------------------------- thread pool


def test_pool_runs_a_job_posted_before_its_worker_started(kernels: CpuKernels) -> None:
    """A fresh process whose pool worker starts 50 ms late, with a kernel call right after
    loading: the call must complete (a worker that read the job generation on its own start
    used to sleep through the first job, and the caller waited forever)."""
    code = (
        "import torch; from tokenleap.kernels import load_kernels\n"
        "k = load_kernels(); x = torch.randn(3, 64)\n"
        "assert k.threads > 1, k.threads\n"
        "print(float(k.rmsnorm(x, torch.ones(64), 1e-5).sum()), float(k.linear(x, torch.randn(40, 64)).sum()))\n"
    )
    env = {**os.environ, "TOKENLEAP_POOL_START_DELAY_US": "50000"}
    env.pop("TOKENLEAP_NO_KERNELS", None)
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the first kernel call hung waiting for a pool worker that started late")
    assert proc.returncode == 0, proc.stderr[-2000:]
