"""Quantized linears on GGUF blocks (quant.h): results against a slow reference that dequantizes
the weights and quantizes the activations as the kernel does, and row invariance."""

from __future__ import annotations

import threading

import gguf
import numpy as np
import pytest
import torch

from tokenleap.kernels import FORMATS, CpuKernels, QuantWeight

TYPES = sorted(f.ggml_id for f in FORMATS)
NAMES = {f.ggml_id: f.name for f in FORMATS}
K_TYPES = (12, 13, 14)  # Q4_K, Q5_K, Q6_K: superblocks of 256 inputs, random blocks (gguf-py cannot quantize them)
RANDOM_TYPES = (*K_TYPES, 20, 23, 11, 10)  # and IQ4_NL, IQ4_XS, Q3_K, Q2_K: random blocks too


def _random_blocks(qtype: int, out_dim: int, in_dim: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant superblocks (or IQ4_NL blocks) with small f16 scales (every sub-scale / min /
    quant bit random)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    raw = rng.integers(0, 256, size=(out_dim, in_dim // block, nbytes), dtype=np.uint8)
    scale = lambda hi: (rng.random((out_dim, in_dim // block, 1)) * hi).astype(np.float16).view(np.uint8)  # noqa: E731
    if qtype in (12, 13):  # Q4_K, Q5_K: d, dmin first
        raw[..., 0:2], raw[..., 2:4] = scale(0.002), scale(0.004)
    elif qtype == 11:  # Q3_K: d last (its scales reach +-32, its values +-4)
        raw[..., 108:110] = scale(0.0002)
    elif qtype == 10:  # Q2_K: d, dmin last
        raw[..., 80:82], raw[..., 82:84] = scale(0.002), scale(0.002)
    elif qtype in (20, 23):  # IQ4_NL, IQ4_XS: d first (the grid reaches +-127; IQ4_XS's block scales +-32)
        raw[..., 0:2] = scale(0.0005 if qtype == 20 else 0.00002)
    else:  # Q6_K: d last
        raw[..., 208:210] = scale(0.0005)
    return raw.reshape(out_dim, -1)


def _quant_weight(qtype: int, out_dim: int, in_dim: int, seed: int) -> QuantWeight:
    rng = np.random.default_rng(seed)
    if qtype in RANDOM_TYPES:
        if qtype in (*K_TYPES, 23, 11, 10):
            in_dim = in_dim if in_dim % 256 == 0 else 256 * (in_dim // 256 + 1)
        blocks = _random_blocks(qtype, out_dim, in_dim, rng)
    else:
        dense = (rng.standard_normal((out_dim, in_dim)) * 0.05).astype(np.float32)
        blocks = gguf.quants.quantize(dense, gguf.GGMLQuantizationType(qtype))
    w = QuantWeight.from_blocks(blocks, qtype, out_dim, in_dim)
    # the C repack writes the numpy reference's bytes, and they hold exactly the file's values
    # (gguf's reference dequantizer)
    assert torch.equal(w.data, QuantWeight.from_blocks_numpy(blocks, qtype, out_dim, in_dim).data)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)).reshape(out_dim, in_dim)
    assert torch.equal(w.dequantize(), torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))
    return w


def _reference(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """float64: activations quantized per row in blocks of 32 (d = max|x|/127, round half even;
    the K-quants: blocks of 256, as ggml's Q8_K), times the dequantized weights."""
    xb = x.double().reshape(x.shape[0], -1, 256 if w.name in ("Q4_K", "Q5_K", "Q6_K") else 32)  # IQ4_XS: blocks of 32
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1)), 0)
    xq = (q * d).reshape(x.shape)
    y = xq @ w.dequantize().double().T
    return (y + bias.double() if bias is not None else y).float()


@pytest.mark.parametrize("qtype", TYPES, ids=[NAMES[t] for t in TYPES])
@pytest.mark.parametrize(("rows", "in_dim", "out_dim"), [(1, 32, 8), (2, 64, 40), (3, 576, 48), (9, 1536, 72)])
def test_quant_linear_matches_reference(kernels: CpuKernels, qtype: int, rows: int, in_dim: int, out_dim: int) -> None:
    w = _quant_weight(qtype, out_dim, in_dim, seed=rows + qtype)
    in_dim = w.in_dim  # K-quants: a multiple of 256
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_dim, generator=g)
    x[0, :32] = 0.0  # an all-zero activation block
    b = torch.randn(out_dim, generator=g)
    y = kernels.linear(x, w, b)
    torch.testing.assert_close(y, _reference(x, w, b), atol=2e-5 * in_dim**0.5, rtol=1e-5)


@pytest.mark.parametrize("qtype", TYPES, ids=[NAMES[t] for t in TYPES])
def test_quant_linear_row_invariant_and_accumulates(kernels: CpuKernels, qtype: int) -> None:
    w = _quant_weight(qtype, 72, 128, seed=qtype)
    g = torch.Generator().manual_seed(qtype)
    x = torch.randn(23, w.in_dim, generator=g) * 3
    y = kernels.linear(x, w)
    for rows in (1, 2, 3, 4, 5, 8):
        parts = torch.cat([kernels.linear(x[i : i + rows], w) for i in range(0, 23, rows)])
        assert torch.equal(parts, y), rows
    base = torch.randn(23, 72, generator=g)
    acc = base.clone()
    kernels.linear(x, w, out=acc)
    assert torch.equal(acc, base + y)


def test_reused_scratch_gives_the_same_bits_across_sizes_and_threads(kernels: CpuKernels) -> None:
    """The linears reuse a per-thread scratch buffer: a small call after a large one (stale
    bytes past its end), the buffer's growth, and a call from another thread give the bits of
    a fresh buffer."""
    w = _quant_weight(3, 64, 1536, seed=11)
    g = torch.Generator().manual_seed(11)
    big, small, norm = (
        torch.randn(40, 1536, generator=g),
        torch.randn(2, 1536, generator=g),
        torch.rand(1536, generator=g) + 0.5,
    )
    fresh_small = kernels.linear(small, w)  # before the big call grows this thread's buffer
    fresh_big = kernels.linear(big, w, norm=(norm, 1e-5))
    assert torch.equal(kernels.linear(small, w), fresh_small)
    assert torch.equal(kernels.linear(big, w, norm=(norm, 1e-5)), fresh_big)
    seen: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: seen.append(kernels.linear(big, w, norm=(norm, 1e-5))))
    worker.start()
    worker.join()
    assert torch.equal(seen[0], fresh_big)
    assert torch.equal(kernels.linear(big[:1], w, norm=(norm, 1e-5)), fresh_big[:1])


def test_quant_weight_validates_and_fuses() -> None:
    a, b = _quant_weight(3, 16, 64, 0), _quant_weight(3, 8, 64, 1)
    fused = QuantWeight.cat([a, b])
    assert (fused.out_dim, fused.in_dim, fused.name) == (24, 64, "Q4_1")
    torch.testing.assert_close(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="one input width"):
        QuantWeight.cat([a, _quant_weight(8, 8, 96, 2)])
    with pytest.raises(ValueError, match="does not fit"):
        QuantWeight(a.data[:, :-1].contiguous(), 3, 16, 64)
    with pytest.raises(ValueError, match="unsupported"):
        QuantWeight(a.data, 16, 16, 64)  # IQ2_XXS: not read
    with pytest.raises(ValueError, match="cannot keep"):
        QuantWeight.from_blocks(np.zeros(20 * 12, np.uint8), 3, 12, 32)  # 12 outputs: not a multiple of 8


@pytest.mark.parametrize("qtype", TYPES, ids=[NAMES[t] for t in TYPES])
def test_fused_norm_and_gate_give_the_same_bits(kernels: CpuKernels, qtype: int) -> None:
    w = _quant_weight(qtype, 48, 64, seed=qtype + 7)
    n = w.in_dim
    g = torch.Generator().manual_seed(9)
    x, nw, gu = torch.randn(5, n, generator=g), torch.rand(n, generator=g) + 0.5, torch.randn(5, 2 * n, generator=g) * 3
    assert torch.equal(kernels.linear(x, w, norm=(nw, 1e-5)), kernels.linear(kernels.rmsnorm(x, nw, 1e-5), w))
    base = torch.randn(5, 48, generator=g)
    for act in ("silu", "gelu_tanh"):
        assert torch.equal(kernels.linear(gu, w, glu=act), kernels.linear(kernels.glu_mul(gu, act), w))
        acc = base.clone()
        kernels.linear(gu, w, out=acc, glu=act)
        assert torch.equal(acc, base + kernels.linear(kernels.glu_mul(gu, act), w))


def test_activation_preparation_split_over_threads_gives_one_rows_bits(kernels: CpuKernels) -> None:
    """From 8,192 activations (rows x inputs) a linear's preparation (RMSNorm / GLU, int8 blocks,
    the Q5_0 + Q8_0 stack's second buffer and VNNI flip, Q8_K blocks) is split over the pool's
    threads by rows: 12 rows of 1,024 inputs equal 12 one-row calls (prepared on one thread),
    bit for bit, with and without VNNI."""
    g = torch.Generator().manual_seed(19)
    stack = QuantWeight.cat([_quant_weight(6, 24, 1024, 41), _quant_weight(8, 32, 1024, 42)])
    weights = [_quant_weight(12, 40, 1024, 43), _quant_weight(14, 40, 1024, 44), _quant_weight(2, 40, 1024, 45), stack]
    x, nw = torch.randn(12, 1024, generator=g), torch.rand(1024, generator=g) + 0.5
    gu = torch.randn(12, 2048, generator=g) * 3
    vnni = kernels.quant_vnni()
    try:
        for use_vnni in (False, True):
            kernels.quant_vnni(use_vnni)
            for w in weights:
                for kw in ({}, {"norm": (nw, 1e-5)}, {"glu": "silu"}):
                    inp = gu if "glu" in kw else x
                    whole = kernels.linear(inp, w, **kw)
                    rows = torch.cat([kernels.linear(inp[i : i + 1], w, **kw) for i in range(12)])
                    assert torch.equal(whole, rows), (w.name, kw.keys(), use_vnni)
    finally:
        kernels.quant_vnni(vnni)


def test_mixed_type_stacks_fuse_by_kernel_format(kernels: CpuKernels) -> None:
    """Gemma 3's and Qwen2.5-0.5B's Q4_K_M files stack Q5_0 Q/K with a Q8_0 V (a stack of two
    formats, Q5_0 in its own bytes); three runs of formats are refused (the model then keeps them
    dense)."""
    q, k, v = _quant_weight(6, 32, 256, 1), _quant_weight(6, 16, 256, 2), _quant_weight(8, 16, 256, 3)
    qkv = QuantWeight.cat([q, k, v])
    assert qkv.name == "Q5_0+Q8_0" and qkv.out_dim == 64 and qkv.split == 48
    assert torch.equal(qkv.dequantize(), torch.cat([q.dequantize(), k.dequantize(), v.dequantize()]))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    assert torch.equal(kernels.linear(x, qkv), torch.cat([kernels.linear(x, p) for p in (q, k, v)], dim=1))
    with pytest.raises(ValueError, match="two runs"):
        QuantWeight.cat([_quant_weight(12, 8, 256, 6), _quant_weight(14, 8, 256, 7), _quant_weight(12, 8, 256, 8)])
    with pytest.raises(ValueError, match="cannot keep"):
        QuantWeight.from_blocks(np.zeros(8 * 144, np.uint8), 12, 8, 128)  # Q4_K needs in % 256


@pytest.mark.parametrize(
    ("first", "second"),
    [(12, 14), (14, 12), (12, 8), (2, 3), (8, 12), (11, 12), (23, 13), (20, 8), (10, 11), (6, 8), (7, 6)],
    ids=[
        "Q4_K+Q6_K", "Q6_K+Q4_K", "Q4_K+Q8_0", "Q4_0+Q4_1", "Q8_0+Q4_K", "Q3_K+Q4_K", "IQ4_XS+Q5_K", "IQ4_NL+Q8_0",
        "Q2_K+Q3_K", "Q5_0+Q8_0", "Q5_1+Q5_0"
    ],
)
def test_two_format_stacks_equal_their_parts(kernels: CpuKernels, first: int, second: int) -> None:
    """A stack of two kernel formats (Llama Q4_K_M's Q4_K Q/K with a Q6_K V) is one call whose
    outputs are each part's alone, bit for bit, with and without VNNI (whose int8 forms differ
    between the parts), fused norms included; dequantized it is the parts'."""
    q, k, v = _quant_weight(first, 48, 512, 1), _quant_weight(first, 16, 512, 2), _quant_weight(second, 24, 512, 3)
    qkv = QuantWeight.cat([q, k, v])
    assert (qkv.split, qkv.out_dim, qkv.nbytes) == (64, 88, q.nbytes + k.nbytes + v.nbytes)
    assert torch.equal(qkv.dequantize(), torch.cat([q.dequantize(), k.dequantize(), v.dequantize()]))
    g = torch.Generator().manual_seed(5)
    x, nw = torch.randn(9, 512, generator=g) * 2, torch.rand(512, generator=g) + 0.5
    default = kernels.quant_vnni()
    try:
        for vnni in (False, True):
            if kernels.quant_vnni(vnni) != vnni:
                continue
            for rows in (1, 4, 9):
                y = kernels.linear(x[:rows], qkv, norm=(nw, 1e-5))
                parts = torch.cat([kernels.linear(x[:rows], p, norm=(nw, 1e-5)) for p in (q, k, v)], dim=1)
                assert torch.equal(y, parts), (vnni, rows)
    finally:
        kernels.quant_vnni(default)


_AVX2_SCRIPT = r"""
import sys
import torch
sys.path.insert(0, "tests/kernels")
from test_quant import TYPES, _quant_weight, _reference
from tokenleap.kernels import load_kernels

k = load_kernels()
assert k is not None and k.variant == "avx2", k
k.quant_xb_rows(4)  # the buffered tiles from 4 rows, whatever this host's measurement chose (kernels/tiles.py)
for qtype in TYPES:
    w = _quant_weight(qtype, 40, 512, seed=qtype)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(qtype)) * 2
    y = k.linear(x, w)
    torch.testing.assert_close(y, _reference(x, w, None), atol=2e-5 * 512**0.5, rtol=1e-5)
    for rows in (1, 2, 3, 4, 8):
        assert torch.equal(torch.cat([k.linear(x[i : i + rows], w) for i in range(0, 11, rows)]), y), (qtype, rows)
    if k.quant_vnni():  # AVX-VNNI (Intel's AVX2 client cores; this host when it has it): the same bits without
        k.quant_vnni(False)
        for rows in (1, 4, 8, 11):
            assert torch.equal(torch.cat([k.linear(x[i : i + rows], w) for i in range(0, 11, rows)]), y), (qtype, rows)
        k.quant_vnni(True)
# without VNNI, 4, 8 and 11 rows above took the K-quants' run-major tile (8 and 11 rows Q4_0 / Q5_0's;
# 11 as 8 rows, then 3 group-major); with AVX-VNNI the first loop took the VNNI tiles and the second
# one the run-major
assert k.quant_xb_rows() == 4
print("vnni" if k.quant_vnni() else "no vnni", "ok")
"""


def test_avx2_variant_quant_linears(kernels: CpuKernels) -> None:
    """Every type on the AVX2 variant too (a subprocess forcing it): reference and row invariance."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TOKENLEAP_KERNELS": "avx2"}
    run = subprocess.run([sys.executable, "-c", _AVX2_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


def test_vnni_and_avx2_integer_sums_give_the_same_bits(kernels: CpuKernels) -> None:
    """The AVX-512 variant's vpdpbusd path (when the CPU has VNNI) against its AVX2 integer path:
    the same exact block sums, so every type's output is bit-identical, at 1 to 9 rows."""
    default = kernels.quant_vnni()
    try:
        if not kernels.quant_vnni(True):
            pytest.skip("no AVX-512 VNNI path on this CPU / kernel variant")
        g = torch.Generator().manual_seed(11)
        for qtype in TYPES:
            w = _quant_weight(qtype, 40, 512, seed=qtype + 3)
            x = torch.randn(9, 512, generator=g) * 2
            y_vnni = kernels.linear(x, w)
            singles = torch.cat([kernels.linear(x[i : i + 1], w) for i in range(9)])
            kernels.quant_vnni(False)
            y_avx2 = kernels.linear(x, w)
            kernels.quant_vnni(True)
            assert torch.equal(y_vnni, y_avx2), NAMES[qtype]
            assert torch.equal(singles, y_vnni), NAMES[qtype]
    finally:
        kernels.quant_vnni(default)


def test_two_group_tile_gives_the_one_group_tiles_bits(kernels: CpuKernels) -> None:
    """The two-group tiles (16 outputs a 512-bit vector, AVX-512 VNNI: the K-quants' and the
    32-input Q4_0 / Q4_1 / Q5_0 / Q5_1's) against the 8-output tiles: each of those types, 1 to
    17 rows (a second tile of rows), bias, accumulation, an odd number of groups (a leftover
    group), a Q4_K + Q6_K and a Q5_0 + Q8_0 stack whose splits are odd, and 8,192 inputs (where
    the default takes the K tile at any row count): the same bits."""
    default, vnni = kernels.quant_pair_rows(), kernels.quant_vnni()
    try:
        if not kernels.quant_vnni(True) or kernels.quant_pair_rows(1) != 1:
            pytest.skip("no two-group tile on this CPU / kernel variant")
        g = torch.Generator().manual_seed(13)
        stacks = [
            QuantWeight.cat([_quant_weight(12, 24, 512, 21), _quant_weight(14, 32, 512, 22)]),
            QuantWeight.cat([_quant_weight(6, 24, 512, 24), _quant_weight(8, 32, 512, 25)]),
        ]
        singles = [_quant_weight(t, 56, 512, seed=t + 9) for t in (*K_TYPES, 2, 3, 6, 7)]
        for w in [*singles, *stacks, _quant_weight(12, 24, 8192, 23)]:
            x, b = torch.randn(17, w.in_dim, generator=g) * 2, torch.randn(w.out_dim, generator=g)
            base = torch.randn(17, w.out_dim, generator=g)
            for rows in (*range(1, 10), 16, 17):
                got = {}
                for pair in (default, 1, 0):
                    kernels.quant_pair_rows(pair)
                    acc = base[:rows].clone()
                    got[pair] = (kernels.linear(x[:rows], w, b), kernels.linear(x[:rows], w, out=acc), acc)
                assert all(torch.equal(a, c) for a, c in zip(got[0], got[1], strict=True)), (w.name, rows)
                assert all(torch.equal(a, c) for a, c in zip(got[0], got[default], strict=True)), (w.name, rows)
    finally:
        kernels.quant_pair_rows(default)
        kernels.quant_vnni(vnni)


def _check_run_major_tiles(kernels: CpuKernels, weights: list[QuantWeight]) -> None:
    """Each weight at 1 to 9, 13, 17 and 22 rows (bias, and accumulating onto y; over 8 rows the
    tile takes 8 at a time and a last few rows under its threshold go group-major) with the
    run-major tile from 2 rows up against it switched off (every row count group-major): the same
    bits, and near the reference. The caller switches VNNI off where the build has it."""
    g, more = torch.Generator().manual_seed(17), torch.Generator().manual_seed(23)
    default = kernels.quant_xb_rows()  # 0 where kernels/tiles.py measured the group-major tile faster
    assert hasattr(kernels.lib, "tl_quant_xb"), "no run-major tile in this build"
    try:
        for w in weights:
            x, b = torch.randn(9, w.in_dim, generator=g) * 2, torch.randn(w.out_dim, generator=g)
            base = torch.randn(9, w.out_dim, generator=g)
            x = torch.cat([x, torch.randn(13, w.in_dim, generator=more) * 2])  # (the first 9 rows' draws as before)
            base = torch.cat([base, torch.randn(13, w.out_dim, generator=more)])
            for rows in (*range(1, 10), 13, 17, 22):  # over 8: tiles of 8, then 5 / 1 / 6 rows
                got = {}
                for xb in (2, 0):
                    kernels.quant_xb_rows(xb)
                    acc = base[:rows].clone()
                    got[xb] = (kernels.linear(x[:rows], w, b), kernels.linear(x[:rows], w, out=acc), acc)
                assert all(torch.equal(a, c) for a, c in zip(got[0], got[2], strict=True)), (w.name, rows)
                if not w.split:  # (_reference takes one format)
                    ref = _reference(x[:rows], w, b)
                    torch.testing.assert_close(got[2][0], ref, atol=2e-5 * w.in_dim**0.5, rtol=1e-5)
    finally:
        kernels.quant_xb_rows(default)


def _run_major_weights(k_only: bool) -> list[QuantWeight]:
    """37 groups (runs of 16 and a short one, on each thread's share); the K-quants at 512 inputs
    and a Q4_K + Q6_K stack with an odd split; the 32-input formats with a tile (Q4_0, Q5_0) at
    896 inputs (three runs of 8 blocks and one of 4) and a Q5_0 + Q8_0 stack."""
    ks = [_quant_weight(t, 296, 512, seed=t + 40) for t in K_TYPES]
    ks.append(QuantWeight.cat([_quant_weight(12, 24, 512, 31), _quant_weight(14, 40, 512, 32)]))
    if k_only:
        return ks
    q32 = [_quant_weight(t, 296, 896, seed=t + 50) for t in (2, 6)]
    q32.append(QuantWeight.cat([_quant_weight(6, 24, 896, 33), _quant_weight(8, 40, 896, 34)]))
    return ks + q32


def test_superblock_major_tile_gives_the_group_major_tiles_bits(kernels: CpuKernels) -> None:
    """The K-quants' superblock-major tile without VNNI (from 2 rows here, 4 by default; over 8
    rows, 8 at a time: each row's activations broadcast once per superblock for a run of up to 16
    groups) against the group-major tile: Q4_K / Q5_K / Q6_K and a stack, 1 to 22 rows, the same
    bits. Here the host variant with VNNI switched off; the AVX2 variant, where verification and
    prefill take these tiles, in test_avx2_variant_run_major_tiles."""
    default, vnni = kernels.quant_xb_rows(), kernels.quant_vnni()
    try:
        kernels.quant_vnni(False)
        if not hasattr(kernels.lib, "tl_quant_xb"):
            pytest.skip("no superblock-major tile in this build")
        _check_run_major_tiles(kernels, _run_major_weights(k_only=True))
    finally:
        kernels.quant_xb_rows(default)
        kernels.quant_vnni(vnni)


_AVX2_RUN_MAJOR_SCRIPT = r"""
import sys
sys.path.insert(0, "tests/kernels")
from test_quant import _check_run_major_tiles, _run_major_weights
from tokenleap.kernels import load_kernels

k = load_kernels()
assert k is not None and k.variant == "avx2", k
k.quant_vnni(False)  # the run-major tiles are the sums without VNNI (a host with AVX-VNNI has both)
_check_run_major_tiles(k, _run_major_weights(k_only=False))
print("ok")
"""


def test_avx2_variant_run_major_tiles(kernels: CpuKernels) -> None:
    """On the AVX2 variant (a subprocess forcing it), the run-major tiles, the K-quants' (from 2
    rows here) and the 32-input formats' (Q4_0, Q5_0: from 6 rows; runs of 8 blocks, the last
    one short), against the group-major tiles: the same bits (_check_run_major_tiles)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TOKENLEAP_KERNELS": "avx2"}
    script = _AVX2_RUN_MAJOR_SCRIPT
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_integer_sums_at_their_bounds(kernels: CpuKernels, sign: float) -> None:
    """Every Q4_K weight at q = 15 with sub-scales and mins at 63, every activation at |q| = 127
    of one sign: the largest block sums the kernels form (a half block's 16 * 15 * 127 = 30480,
    which the two-group tile scales as int16 pairs). 17 rows (a second tile of rows), against
    the float64 reference and, where the CPU has it, the one-group tile's bits."""
    out_dim, in_dim = 24, 512
    raw = np.full((out_dim, in_dim // 256, 144), 0xFF, dtype=np.uint8)
    raw[..., 0:2] = np.full((out_dim, in_dim // 256, 1), 0.001, dtype=np.float16).view(np.uint8)  # d
    raw[..., 2:4] = np.full((out_dim, in_dim // 256, 1), 0.0005, dtype=np.float16).view(np.uint8)  # dmin
    w = QuantWeight.from_blocks(raw.reshape(out_dim, -1), 12, out_dim, in_dim)
    x = torch.full((17, in_dim), sign) * torch.linspace(1.0, 2.0, 17)[:, None]
    y = kernels.linear(x, w)
    torch.testing.assert_close(y, _reference(x, w, None), atol=0, rtol=1e-6)
    default, vnni = kernels.quant_pair_rows(), kernels.quant_vnni()
    try:
        kernels.quant_vnni(True)
        kernels.quant_pair_rows(0)
        assert torch.equal(kernels.linear(x, w), y)
    finally:
        kernels.quant_pair_rows(default)
        kernels.quant_vnni(vnni)


@pytest.mark.parametrize("qtype", TYPES, ids=[NAMES[t] for t in TYPES])
def test_weights_keep_the_files_bytes(qtype: int) -> None:
    """One row streams the file's bytes per weight: every type is repacked into exactly as many
    bytes as the file holds (gguf-py's sizes)."""
    w = _quant_weight(qtype, 16, 512, seed=qtype)
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    file_bytes = w.out_dim * w.in_dim // block[0] * block[1]
    assert w.nbytes == file_bytes, (w.nbytes, file_bytes)


@pytest.mark.parametrize("qtype", TYPES, ids=[NAMES[t] for t in TYPES])
def test_rows_are_the_dequantized_rows(kernels: CpuKernels, qtype: int) -> None:
    """A token-table lookup (tl_quant_rows) gives the dequantized weight's rows, bit for bit."""
    w = _quant_weight(qtype, 40, 512, seed=qtype + 5)
    ids = torch.tensor([0, 7, 8, 39, 7, 21])
    assert torch.equal(w.rows(ids), w.dequantize()[ids])
    with pytest.raises(IndexError):
        w.rows(torch.tensor([40]))
