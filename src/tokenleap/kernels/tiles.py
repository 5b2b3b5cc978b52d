"""The AVX2 path's many-row tiles, chosen per host by measurement at load.

Without VNNI the quantized linears have two ways through 4-8 rows that give the same bits
(`quant.h`): the group-major tile, which broadcasts each row's four activations from memory once
per group for every `vpmaddubsw`, and the superblock-major (K-quants) / run-major (Q4_0, Q5_0)
tiles, which broadcast them once per run of groups into an L1 buffer that `vpmaddubsw` reads.
Which is faster depends on the core, not on the model: where a broadcast takes a vector pipe
(AMD Zen 3, modelled by llvm-mca) the buffered tiles are modelled 1.2-1.8x faster at 8 rows;
on Intel a broadcast is a load-port uop, and there they measured 0.90-1.04x the time on Cascade
Lake (s29) but 1.07-1.16x, slower, on a Golden Cove core (s32: a Sapphire Rapids-class Xeon
running the AVX2 variant; the same core as Alder / Raptor Lake's AVX2-only P-cores; 1.07-1.10x
in s34, after their broadcast fill lost its loop overhead). So a build
without VNNI times an 8-row call of one Q4_K weight both ways once per process (interleaved,
fastest of 15 short rounds, ~12 ms) and keeps the buffered tiles unless they are over 3 % slower. The
choice covers every call of 4 rows and more (verification, and since s35 prompt prefill, 8 rows at a
time) and only moves time: every tile gives the same bits (tests/kernels/test_quant.py runs both).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenleap.kernels.formats import QuantWeight

if TYPE_CHECKING:
    from tokenleap.kernels import CpuKernels

XB_FROM = 4  # quant.h's tlq_xb_rows default: the buffered tiles from this many rows (what the choice keeps)
GGML_Q4_K = 12
_Q4K_BLOCK = 144  # bytes per 256 weights: f16 d, f16 dmin, 12 bytes of scales, 128 of nibbles
SHAPE = (1024, 2048)  # [out, in]: 1.2 MB of Q4_K, an L2 or L3 read on every host here
ROWS = 8  # where the tiles differ most (at 4 rows they measured within 6 % of each other)
CALLS = 4  # calls a round, per tile
# rounds: at 5 rounds of 6 calls 2 of 8 fresh processes on a Golden Cove core kept the buffered
# tiles, 5-9 % slower there; at 15 of 4, 0 of 10 (s35)
ROUNDS = 15
MARGIN = 0.03  # the buffered tiles stay unless they take more than 3 % longer


@dataclass(frozen=True)
class TileChoice:
    """One measurement: the fastest call with the buffered tiles and with the group-major one."""

    buffered_ms: float
    group_major_ms: float
    xb_rows: int  # the setting in force afterwards (CpuKernels.quant_xb_rows): 0 = group-major only


def keep_buffered(buffered_ms: float, group_major_ms: float, margin: float = MARGIN) -> bool:
    """Whether the buffered tiles stay: unless they took more than `margin` longer."""
    return buffered_ms <= group_major_ms * (1.0 + margin)


def synthetic_q4k(out_dim: int, in_dim: int, seed: int = 0) -> QuantWeight:
    """A Q4_K weight of random nibbles and scales with small f16 block scales (speed does not
    depend on the values)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(out_dim, in_dim // 256, _Q4K_BLOCK), dtype=np.uint8)
    scale = (rng.random((out_dim, in_dim // 256, 1)) * 0.002).astype(np.float16).view(np.uint8)
    raw[..., 0:2], raw[..., 2:4] = scale, scale
    return QuantWeight.from_blocks(raw.reshape(out_dim, -1), GGML_Q4_K, out_dim, in_dim)


def _fastest_call(kernels: CpuKernels, x: torch.Tensor, weight: QuantWeight, out: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(CALLS):
        start = time.perf_counter()
        kernels.linear(x, weight, out=out)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def choose_tiles(kernels: CpuKernels) -> TileChoice | None:
    """Measure and set the buffered tiles' use (`quant_xb_rows`) for this process; None where the
    build has no such tile or runs VNNI (its tiles are another pair, not timed here)."""
    default = kernels.quant_xb_rows()
    if default == 0 or kernels.quant_vnni():
        return None
    weight = synthetic_q4k(*SHAPE)
    x = torch.randn(ROWS, SHAPE[1], generator=torch.Generator().manual_seed(0))
    out = torch.empty(ROWS, SHAPE[0])
    buffered = group_major = float("inf")
    try:
        kernels.linear(x, weight, out=out)  # first touch: page in the weight, warm the pool
        for _ in range(ROUNDS):
            kernels.quant_xb_rows(default)
            buffered = min(buffered, _fastest_call(kernels, x, weight, out))
            kernels.quant_xb_rows(0)
            group_major = min(group_major, _fastest_call(kernels, x, weight, out))
    finally:
        kernels.quant_xb_rows(default)  # as it was, should the measurement fail
    if not keep_buffered(buffered, group_major):
        kernels.quant_xb_rows(0)
    return TileChoice(buffered, group_major, kernels.quant_xb_rows())
