"""Quantized linears on GGUF blocks (quant.h): results against a slow reference that dequantizes
the weights and quantizes the activations as the kernel does, and row invariance."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tokenleap.kernels import QUANT_TYPES, CpuKernels, QuantWeight

TYPES = sorted(QUANT_TYPES)


def _quant_weight(qtype: int, out_dim: int, in_dim: int, seed: int) -> QuantWeight:
    rng = np.random.default_rng(seed)
    dense = (rng.standard_normal((out_dim, in_dim)) * 0.05).astype(np.float32)
    blocks = gguf.quants.quantize(dense, gguf.GGMLQuantizationType(qtype))
    w = QuantWeight.from_blocks(blocks, qtype, out_dim, in_dim)
    # the repacked weight holds exactly the file's values (gguf's reference dequantizer)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)).reshape(out_dim, in_dim)
    assert torch.equal(w.dequantize(), torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))
    return w


def _reference(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """float64: activations quantized per row in blocks of 32 (d = max|x|/127, round half even),
    times the dequantized weights."""
    xb = x.double().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1)), 0)
    xq = (q * d).reshape(x.shape)
    y = xq @ w.dequantize().double().T
    return (y + bias.double() if bias is not None else y).float()


@pytest.mark.parametrize("qtype", TYPES, ids=[QUANT_TYPES[t][0] for t in TYPES])
@pytest.mark.parametrize(("rows", "in_dim", "out_dim"), [(1, 32, 8), (2, 64, 40), (3, 576, 48), (9, 1536, 72)])
def test_quant_linear_matches_reference(kernels: CpuKernels, qtype: int, rows: int, in_dim: int, out_dim: int) -> None:
    w = _quant_weight(qtype, out_dim, in_dim, seed=rows + qtype)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_dim, generator=g)
    x[0, :32] = 0.0  # an all-zero activation block
    b = torch.randn(out_dim, generator=g)
    y = kernels.linear(x, w, b)
    torch.testing.assert_close(y, _reference(x, w, b), atol=2e-5 * in_dim**0.5, rtol=1e-5)


@pytest.mark.parametrize("qtype", TYPES, ids=[QUANT_TYPES[t][0] for t in TYPES])
def test_quant_linear_row_invariant_and_accumulates(kernels: CpuKernels, qtype: int) -> None:
    w = _quant_weight(qtype, 72, 128, seed=qtype)
    g = torch.Generator().manual_seed(qtype)
    x = torch.randn(23, 128, generator=g) * 3
    y = kernels.linear(x, w)
    for rows in (1, 2, 3, 4, 5, 8):
        parts = torch.cat([kernels.linear(x[i : i + rows], w) for i in range(0, 23, rows)])
        assert torch.equal(parts, y), rows
    base = torch.randn(23, 72, generator=g)
    acc = base.clone()
    kernels.linear(x, w, out=acc)
    assert torch.equal(acc, base + y)


def test_quant_weight_validates_and_fuses() -> None:
    a, b = _quant_weight(3, 16, 64, 0), _quant_weight(3, 8, 64, 1)
    fused = QuantWeight.cat([a, b])
    assert (fused.out_dim, fused.in_dim, fused.name) == (24, 64, "Q4_1")
    torch.testing.assert_close(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="one quantization type"):
        QuantWeight.cat([a, _quant_weight(8, 8, 64, 2)])
    with pytest.raises(ValueError, match="does not fit"):
        QuantWeight(a.data[:, :-1].contiguous(), 3, 16, 64)
    with pytest.raises(ValueError, match="unsupported"):
        QuantWeight(a.data, 12, 16, 64)
    with pytest.raises(ValueError, match="cannot keep"):
        QuantWeight.from_blocks(np.zeros(20 * 12, np.uint8), 3, 12, 32)  # 12 outputs: not a multiple of 8


@pytest.mark.parametrize("qtype", TYPES, ids=[QUANT_TYPES[t][0] for t in TYPES])
def test_fused_norm_and_gate_give_the_same_bits(kernels: CpuKernels, qtype: int) -> None:
    w = _quant_weight(qtype, 48, 64, seed=qtype + 7)
    g = torch.Generator().manual_seed(9)
    x, nw, gu = torch.randn(5, 64, generator=g), torch.rand(64, generator=g) + 0.5, torch.randn(5, 128, generator=g) * 3
    assert torch.equal(kernels.linear(x, w, norm=(nw, 1e-5)), kernels.linear(kernels.rmsnorm(x, nw, 1e-5), w))
    assert torch.equal(kernels.linear(gu, w, glu=True), kernels.linear(kernels.silu_mul(gu), w))
    base = torch.randn(5, 48, generator=g)
    acc = base.clone()
    kernels.linear(gu, w, out=acc, glu=True)
    assert torch.equal(acc, base + kernels.linear(kernels.silu_mul(gu), w))
