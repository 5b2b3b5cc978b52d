"""Row-invariant CPU kernels (linear and per-row attention), compiled on first use.

Measured on the project machine, torch's own bf16 `linear` streams weights at ~10 GB/s of the
~31 GB/s the memory gives, and its fp32 GEMM rounds a row differently depending on how many
rows share the call. `kernels.c` computes each output element with one fixed instruction
sequence (AVX-512, fp32 accumulation), streams the weights once for all rows, and so is both
faster and exact for speculative verification. They run on their own small thread pool (spin,
then yield, then sleep: an OpenMP runtime either pays a wake-up per call or hogs the cores from
other processes). Two instruction-set variants keep the same contract: `kernels.c` (AVX-512, with
AVX512-BF16 dot products, packed weights and a blocked bf16 KV cache where the CPU has them) and
`kernels_avx2.c` (AVX2 + FMA: packed weights and the blocked bf16 KV cache widened to fp32 in
registers); the CPU's flags pick one at run time. It is compiled with the system C compiler (`-march=native`) into the
user cache, keyed by the sources, flags and the CPU's feature flags, and loaded with ctypes;
when no compiler or neither instruction set is present the model falls back to torch ops
(correct, slower, and not row-invariant: greedy speculation may then drift from plain decoding).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from tokenleap.paths import cache_dir

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
_SOURCES = {"avx512": _DIR / "kernels.c", "avx2": _DIR / "kernels_avx2.c"}
_HEADERS = sorted(_DIR.glob("*.h"))  # every header is part of every build
# -ffp-contract=off: a scalar a*b+c must not become an FMA in one inlined tile and stay a
# multiply-add in another (the row-invariance contract); FMAs are written as intrinsics.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-pthread", "-shared", "-fPIC", "-std=gnu11"]
_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (from /proc/cpuinfo; empty when unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def kernel_variant(flags: frozenset[str]) -> str | None:
    """Which kernel source fits a CPU with these flags: "avx512", "avx2" or None (torch)."""
    if os.environ.get("TOKENLEAP_KERNELS") in _SOURCES:  # tests and benchmarks: force a variant
        return os.environ["TOKENLEAP_KERNELS"]
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return None


def _compile(compiler: str, variant: str, flags: frozenset[str]) -> Path:
    source = _SOURCES[variant]
    parts = [source.read_bytes(), *(h.read_bytes() for h in _HEADERS), " ".join(_FLAGS).encode(), compiler.encode()]
    parts.append(" ".join(sorted(flags)).encode())  # -march=native: a build for one CPU is no build for another
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"tokenleap_kernels_{variant}_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_out = Path(tmp) / target.name
        subprocess.run(
            [compiler, *_FLAGS, str(source), "-o", str(tmp_out), "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(tmp_out, target)  # atomic: concurrent processes never see half a file
    return target


@dataclass(frozen=True)
class PackedWeight:
    """A bf16 `[out, in]` weight in the kernels' output-interleaved layout `[out/16, in/2, 16, 2]`.

    One 64-byte load holds two inputs for 16 outputs, so the kernel needs no horizontal sums and
    streams the weight front to back once per call, whatever the number of rows.
    """

    data: torch.Tensor
    out_dim: int
    in_dim: int

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        out_dim, in_dim = weight.shape
        return weight.dtype == torch.bfloat16 and out_dim % 16 == 0 and in_dim % 32 == 0

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight:
        if not cls.fits(weight):
            raise ValueError(f"cannot pack weight {tuple(weight.shape)} {weight.dtype}: needs bf16, out % 16 == 0, in % 32 == 0")
        out_dim, in_dim = weight.shape
        data = weight.reshape(out_dim // 16, 16, in_dim // 2, 2).permute(0, 2, 1, 3).contiguous()
        return cls(data=data, out_dim=out_dim, in_dim=in_dim)


# GGML quantization types the kernels read: type id -> (name, bytes per block of 32 in the file);
# the K-quants' superblocks hold 256 inputs (144 / 210 bytes), listed here per 32
QUANT_TYPES: dict[int, tuple[str, int]] = {
    2: ("Q4_0", 18), 3: ("Q4_1", 20), 6: ("Q5_0", 22), 8: ("Q8_0", 34), 12: ("Q4_K", 18), 13: ("Q5_K", 22), 14: ("Q6_K", 26)
}
_SUPERBLOCK = {12: (256, 144), 13: (256, 176), 14: (256, 210)}  # inputs and bytes per superblock
_Q4X8, _Q8X8, _Q40X8, _Q4K, _Q6K, _Q5K = 1, 2, 3, 5, 6, 7  # the kernels' interleaved formats (quant.h)
_FORMAT = {2: _Q40X8, 3: _Q4X8, 6: _Q8X8, 8: _Q8X8, 12: _Q4K, 13: _Q5K, 14: _Q6K}
# per 8 outputs x 32 inputs (the superblock formats: on average; 8 x 144 / 176 / 210 per superblock)
_GROUP_BYTES = {_Q4X8: 160, _Q8X8: 272, _Q40X8: 144, _Q4K: 144, _Q5K: 176, _Q6K: 210}


def _decode(raw: np.ndarray, qtype: int, out_dim: int, in_dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A 32-block GGUF tensor's blocks as integer weights and per-block scales: (q `[out, nb, 32]`
    (uint8 0..15 for the Q4 formats, int8 otherwise), d `[out, nb]` f16, m `[out, nb]` f16 or None)
    with w = d q + m (Q4_0: m None, the kernel forms -8 d)."""
    nb = in_dim // 32
    blocks = raw.reshape(out_dim, nb, QUANT_TYPES[qtype][1])
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]  # [out, nb]
    if qtype == 8:
        return blocks[..., 2:34].view(np.int8), d, None
    if qtype == 6:  # Q5_0: u32 high bits, 16 bytes of nibbles; w = d (q - 16)
        qh = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [out, nb, 1]
        qs = blocks[..., 6:22]
        low = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int16)
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
        return (low | (high << 4)) - 16, d, None
    if qtype == 3:
        m, qs = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0], blocks[..., 4:20]
    else:  # Q4_0: d (q - 8) = d q + m with m = -8 d, formed by the kernel in fp32 (no m stored)
        m, qs = None, blocks[..., 2:18]
    return np.concatenate([qs & 15, qs >> 4], axis=-1), d, m


def _nibbles(q: np.ndarray, groups: int) -> np.ndarray:
    """uint8 `[out, nb, 32]` values 0..15 -> Q4X8's nibble bytes `[G, nb, 128]`: byte (t, o, i)
    holds q[o][4t + i] low and q[o][16 + 4t + i] high."""
    nb = q.shape[1]
    lo, hi = q[..., :16].reshape(groups, 8, nb, 4, 4), q[..., 16:].reshape(groups, 8, nb, 4, 4)  # [G, o, nb, t, i]
    return (lo | (hi << 4)).transpose(0, 2, 3, 1, 4).reshape(groups, nb, 128)


def _by_output(a: np.ndarray, groups: int) -> np.ndarray:
    """`[out, nsb, k]` bytes -> `[G, nsb, 8 k]`: a group's eight outputs side by side."""
    nsb, k = a.shape[1], a.shape[2]
    return a.reshape(groups, 8, nsb, k).transpose(0, 2, 1, 3).reshape(groups, nsb, 8 * k)


def _repack_k(raw: np.ndarray, qtype: int, out_dim: int, in_dim: int) -> np.ndarray:
    """Q4_K / Q5_K / Q6_K superblocks -> quant.h's Q4K / Q5K / Q6K groups (the file's bytes,
    interleaved; the reference `tl_repack` is tested against)."""
    groups, nsb, nb = out_dim // 8, in_dim // 256, in_dim // 32
    blk = raw.reshape(out_dim, nsb, _SUPERBLOCK[qtype][1])
    if qtype in (12, 13):
        sc8 = blk[..., 4:16]
        sc = np.concatenate([sc8[..., 0:4] & 63, (sc8[..., 8:12] & 15) | ((sc8[..., 0:4] >> 6) << 4)], axis=-1)
        mn = np.concatenate([sc8[..., 4:8] & 63, (sc8[..., 8:12] >> 4) | ((sc8[..., 4:8] >> 6) << 4)], axis=-1)
        by_j = lambda a: a.reshape(groups, 8, nsb, 8).transpose(0, 2, 3, 1).reshape(groups, nsb, 64)  # noqa: E731
        sc, mn = by_j(sc), by_j(mn)
        hi = (sc >> 4) | ((mn >> 4) << 2)
        q5 = qtype == 13
        qs = blk[..., 48 if q5 else 16 :].reshape(out_dim, nsb, 4, 32)  # 4 chunks of 64 inputs: low nibbles, then high
        q = np.stack([qs & 15, qs >> 4], axis=3).reshape(out_dim, nsb, 8, 32)  # [out, nsb, j, l]
        head = [_by_output(blk[..., 0:2], groups), _by_output(blk[..., 2:4], groups), (sc & 15) | ((mn & 15) << 4),
                hi[..., :32] | (hi[..., 32:] << 4)]
        if not q5:
            return np.concatenate([*head, _nibbles(q.reshape(out_dim, nb, 32), groups).reshape(groups, nsb, 1024)], axis=-1).reshape(groups, -1)
        qh = blk[..., 16:48]  # [out, nsb, l]: bit j is sub-block j's 5th bit
        h5 = ((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1)  # [out, nsb, j, l]
        nib = _nibbles(q.reshape(out_dim, nb, 32), groups)  # [G, nb, 128]
        h = h5.reshape(groups, 8, nb, 2, 4, 4)  # [G, o, nb, half, t, i]
        bits = sum((h[..., 0, t, :] << t) | (h[..., 1, t, :] << (4 + t)) for t in range(4))  # [G, o, nb, i]
        hbytes = bits.astype(np.uint8).transpose(0, 2, 1, 3).reshape(groups, nb, 32)
        body = np.concatenate([nib, hbytes], axis=-1).reshape(groups, nsb, 1280)
        return np.concatenate([*head, body], axis=-1).reshape(groups, -1)
    ql, qh = blk[..., 0:128].reshape(out_dim, nsb, 2, 64), blk[..., 128:192].reshape(out_dim, nsb, 2, 32)
    q = np.stack([(ql[..., 0:32] & 15) | ((qh & 3) << 4), (ql[..., 32:64] & 15) | (((qh >> 2) & 3) << 4),
                  (ql[..., 0:32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:64] >> 4) | (((qh >> 6) & 3) << 4)],
                 axis=3).reshape(out_dim, nb, 32)  # unsigned 0..63; w = d sc (q - 32)
    h2 = (q >> 4).reshape(groups, 8, nb, 2, 4, 4)  # [G, o, nb, u, s, i]: input 4 (4 u + s) + i
    hb = (h2[..., 0, :] | (h2[..., 1, :] << 2) | (h2[..., 2, :] << 4) | (h2[..., 3, :] << 6)).transpose(0, 2, 3, 1, 4)
    body = np.concatenate([_nibbles(q & 15, groups), hb.reshape(groups, nb, 64)], axis=-1).reshape(groups, nsb, 1536)
    scales = blk[..., 192:208].reshape(groups, 8, nsb, 16).transpose(0, 2, 3, 1).reshape(groups, nsb, 128)
    return np.concatenate([_by_output(blk[..., 208:210], groups), scales, body], axis=-1).reshape(groups, -1)


def _dequantize_k(g: np.ndarray, fmt: int, out_dim: int, in_dim: int) -> np.ndarray:
    """quant.h's Q4K / Q5K / Q6K groups `[G, in/32 * group bytes]` -> float32 `[out, in]`."""
    groups, nsb = out_dim // 8, in_dim // 256
    g = g.reshape(groups, nsb, -1)
    d = np.ascontiguousarray(g[..., 0:16]).view(np.float16).astype(np.float32)  # [G, nsb, o]

    def unnibble(nib: np.ndarray) -> np.ndarray:  # [G, nsb, j, 128] -> [G, o, nsb, j, 32]
        p = nib.reshape(groups, nsb, 8, 4, 8, 4).transpose(0, 4, 1, 2, 3, 5).reshape(groups, 8, nsb, 8, 16)
        return np.concatenate([p & 15, p >> 4], axis=-1)

    if fmt in (_Q4K, _Q5K):
        dmin = np.ascontiguousarray(g[..., 16:32]).view(np.float16).astype(np.float32)
        low, h = g[..., 32:96], g[..., 96:128]
        hi = np.concatenate([h & 15, h >> 4], axis=-1)
        sc = ((low & 15) | ((hi & 3) << 4)).reshape(groups, nsb, 8, 8).astype(np.float32)  # [G, nsb, j, o]
        mn = ((low >> 4) | ((hi >> 2) << 4)).reshape(groups, nsb, 8, 8).astype(np.float32)
        if fmt == _Q4K:
            q = unnibble(g[..., 128:].reshape(groups, nsb, 8, 128)).astype(np.float32)
        else:
            body = g[..., 128:].reshape(groups, nsb, 8, 160)
            hb = body[..., 128:].reshape(groups, nsb, 8, 8, 4)  # [G, nsb, j, o, i]
            h = np.concatenate([np.stack([(hb >> t) & 1 for t in range(4)], axis=-2),
                                np.stack([(hb >> (4 + t)) & 1 for t in range(4)], axis=-2)], axis=-2)  # [G, nsb, j, o, 8, i]
            h = h.reshape(groups, nsb, 8, 8, 32).transpose(0, 3, 1, 2, 4)  # [G, o, nsb, j, 32]
            q = (unnibble(body[..., :128]) | (h << 4)).astype(np.float32)
        scale = (d[:, :, None, :] * sc).transpose(0, 3, 1, 2)[..., None]  # [G, o, nsb, j, 1]
        shift = -(dmin[:, :, None, :] * mn).transpose(0, 3, 1, 2)[..., None]
        w = q * scale + shift
    else:
        sc = g[..., 16:144].view(np.int8).reshape(groups, nsb, 16, 8).astype(np.float32)  # [G, nsb, k, o]
        body = g[..., 144:].reshape(groups, nsb, 8, 192)
        low = unnibble(body[..., :128])  # [G, o, nsb, j, 32]
        hb = body[..., 128:].reshape(groups, nsb, 8, 2, 8, 4)  # [G, nsb, j, u, o, i]
        h2 = np.stack([(hb >> (2 * s)) & 3 for s in range(4)], axis=4)  # [G, nsb, j, u, s, o, i]
        h2 = h2.transpose(0, 5, 1, 2, 3, 4, 6).reshape(groups, 8, nsb, 8, 32)
        q = (low | (h2 << 4)).astype(np.float32) - 32.0
        scale = (d[:, :, None, :] * sc).transpose(0, 3, 1, 2).reshape(groups, 8, nsb, 8, 2, 1)
        w = (q.reshape(groups, 8, nsb, 8, 2, 16) * scale)
    return np.ascontiguousarray(w.reshape(out_dim, in_dim), dtype=np.float32)


def _repack(raw: np.ndarray, qtype: int, out_dim: int, in_dim: int) -> np.ndarray:
    """GGUF blocks `[out, in/32 * block bytes]` -> quant.h's interleaved groups
    `[out/8, in/32 * group bytes]` (eight outputs' blocks of 32 inputs, four inputs at a time)."""
    nb, groups, fmt = in_dim // 32, out_dim // 8, _FORMAT[qtype]
    if fmt in (_Q4K, _Q5K, _Q6K):
        return _repack_k(raw, qtype, out_dim, in_dim)
    q, d, m = _decode(raw, qtype, out_dim, in_dim)
    out = np.empty((groups, nb, _GROUP_BYTES[fmt]), dtype=np.uint8)

    def by_group(a: np.ndarray) -> np.ndarray:  # [out, nb] -> [G, nb, 8 * itemsize] bytes
        return np.ascontiguousarray(a.reshape(groups, 8, nb).transpose(0, 2, 1)).view(np.uint8)

    out[..., 0:16] = by_group(d.astype(np.float16))
    if fmt == _Q8X8:  # byte (g, o, i) = q[o][4g + i]
        qq = np.ascontiguousarray(q.astype(np.int8)).view(np.uint8).reshape(groups, 8, nb, 8, 4)
        out[..., 16:] = qq.transpose(0, 2, 3, 1, 4).reshape(groups, nb, 256)
        return out.reshape(groups, -1)
    if fmt == _Q4X8:
        assert m is not None
        out[..., 16:32] = by_group(m.astype(np.float16))
    out[..., -128:] = _nibbles(q.astype(np.uint8), groups)
    return out.reshape(groups, -1)


def _weight_buffer(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised uint8 tensor for weights, from numpy's allocator: it asks the kernel for
    transparent huge pages on buffers of 4 MB and more (`madvise(MADV_HUGEPAGE)`; torch's does
    not), and streaming a weight through 2 MB pages instead of 4 KB ones spares the TLB misses
    (measured: the default model's step 3.1-3.4 ms with its 30 MB LM head on huge pages, 3.5-4.0 ms
    without)."""
    return torch.from_numpy(np.empty(shape, dtype=np.uint8))


def _distinct(types: tuple[int, ...]) -> tuple[int, ...]:
    """A stack's part types, kept only when they differ (QuantWeight.types)."""
    return types if len(set(types)) > 1 else ()


@dataclass(frozen=True)
class QuantWeight:
    """A GGUF-quantized `[out, in]` weight (GGML type `qtype`, `QUANT_TYPES`) in the kernels'
    interleaved groups (`data` uint8 `[out/8, in/32 * group bytes]`, see quant.h): the file's
    exact values and bytes per weight, laid out so a vector lane is an output."""

    data: torch.Tensor
    qtype: int
    out_dim: int
    in_dim: int
    types: tuple[int, ...] = ()  # a fused stack's parts' types when they differ
    # a stack of two kernel formats (a Q4_K QK with a Q6_K V): outputs [0, split) in qtype's
    # format, then [split, out) in qtype2's, its bytes after the first's (`data` is then flat)
    split: int = 0
    qtype2: int = 0

    def __post_init__(self) -> None:
        if self.qtype not in QUANT_TYPES or (self.split and self.qtype2 not in QUANT_TYPES):
            raise ValueError(f"unsupported GGML quantization type {self.qtype if self.qtype not in QUANT_TYPES else self.qtype2}")
        nb = self.in_dim // 32
        if self.split:
            if self.split % 8 or not 0 < self.split < self.out_dim or _FORMAT[self.qtype] == _FORMAT[self.qtype2]:
                raise ValueError(f"bad stack split {self.split} of {self.out_dim} outputs ({self.name})")
            fit = self.data.dim() == 1 and self.data.numel() == nb * (
                self.split // 8 * _GROUP_BYTES[_FORMAT[self.qtype]] + (self.out_dim - self.split) // 8 * _GROUP_BYTES[_FORMAT[self.qtype2]])
        else:
            fit = tuple(self.data.shape) == (self.out_dim // 8, nb * _GROUP_BYTES[self.format])
        if self.in_dim % 32 or self.out_dim % 8 or self.data.dtype != torch.uint8 or not fit:
            raise ValueError(f"quantized weight data {tuple(self.data.shape)} {self.data.dtype} does not fit [{self.out_dim}, {self.in_dim}] {self.name}")

    @classmethod
    def fits(cls, qtype: int, out_dim: int, in_dim: int) -> bool:
        block = _SUPERBLOCK.get(qtype, (32, 0))[0]
        return qtype in QUANT_TYPES and out_dim % 8 == 0 and in_dim % block == 0

    @classmethod
    def from_blocks(cls, raw: np.ndarray | torch.Tensor, qtype: int, out_dim: int, in_dim: int) -> QuantWeight:
        """From a GGUF tensor's bytes, `[out, in/32 * block bytes]` uint8 (rows = outputs)."""
        if not cls.fits(qtype, out_dim, in_dim):
            raise ValueError(f"cannot keep [{out_dim}, {in_dim}] of GGML type {qtype} quantized ({'/'.join(n for n, _ in QUANT_TYPES.values())}, out % 8, in % 32 (256 for K-quants))")
        raw = np.ascontiguousarray(raw.numpy() if isinstance(raw, torch.Tensor) else raw, dtype=np.uint8)
        block, block_bytes = _SUPERBLOCK.get(qtype, (32, QUANT_TYPES[qtype][1]))
        if raw.size != out_dim * in_dim // block * block_bytes:
            raise ValueError(f"{raw.size} bytes are not a [{out_dim}, {in_dim}] {QUANT_TYPES[qtype][0]} tensor")
        kernels = load_kernels()
        if kernels is None:
            return cls(torch.from_numpy(_repack(raw, qtype, out_dim, in_dim)), qtype, out_dim, in_dim)
        data = _weight_buffer((out_dim // 8, in_dim // 32 * _GROUP_BYTES[_FORMAT[qtype]]))
        if kernels.lib.tl_repack(raw.ctypes.data, data.data_ptr(), qtype, out_dim, in_dim) != 0:
            raise ValueError(f"tl_repack refused [{out_dim}, {in_dim}] {QUANT_TYPES[qtype][0]}")
        return cls(data, qtype, out_dim, in_dim)

    @classmethod
    def from_blocks_numpy(cls, raw: np.ndarray, qtype: int, out_dim: int, in_dim: int) -> QuantWeight:
        """`from_blocks` through numpy (the reference the C repack is tested against)."""
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        return cls(torch.from_numpy(_repack(raw, qtype, out_dim, in_dim)), qtype, out_dim, in_dim)

    @property
    def name(self) -> str:
        return "+".join(dict.fromkeys(QUANT_TYPES[t][0] for t in self.types or (self.qtype,)))

    @property
    def format(self) -> int:
        """The kernels' format (quant.h), a TLQ_STACK of two for a stack."""
        if self.split:
            return _FORMAT[self.qtype] | _FORMAT[self.qtype2] << 4 | (self.split // 8) << 8
        return _FORMAT[self.qtype]

    def parts(self) -> list[QuantWeight]:
        """A stack's two single-format weights (views of `data`); [self] otherwise."""
        if not self.split:
            return [self]
        head = self.split // 8 * (self.in_dim // 32) * _GROUP_BYTES[_FORMAT[self.qtype]]
        a, b = self.data[:head], self.data[head:]
        types = self.types or (self.qtype, self.qtype2)
        n_a = next(i for i, t in enumerate(types) if _FORMAT[t] != _FORMAT[self.qtype])
        return [QuantWeight(a.view(self.split // 8, -1), self.qtype, self.split, self.in_dim, _distinct(types[:n_a])),
                QuantWeight(b.view((self.out_dim - self.split) // 8, -1), self.qtype2, self.out_dim - self.split, self.in_dim,
                            _distinct(types[n_a:]))]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Stack weights of one input width along the outputs (a fused QKV, gate+up) in one or two
        runs of a kernel format: Q5_0 with Q8_0 (Gemma 3's Q4_K_M files mix them in QKV) is one
        format; a Q4_K Q and K with a Q6_K V (Llama's Q4_K_M files) are a stack of two."""
        if len({w.in_dim for w in parts}) != 1 or any(w.split for w in parts):
            raise ValueError("only single-format weights of one input width can be fused")
        runs = [i for i in range(1, len(parts)) if parts[i].format != parts[i - 1].format]
        if len(runs) > 1:
            raise ValueError("only weights in at most two runs of one quantization format can be fused")
        types = tuple(t for w in parts for t in (w.types or (w.qtype,)))
        out_dim, in_dim = sum(w.out_dim for w in parts), parts[0].in_dim
        if not runs:
            data = _weight_buffer((sum(w.data.shape[0] for w in parts), parts[0].data.shape[1]))
            torch.cat([w.data for w in parts], out=data)
            return QuantWeight(data, parts[0].qtype, out_dim, in_dim, _distinct(types))
        data = _weight_buffer((sum(w.nbytes for w in parts),))
        torch.cat([w.data.reshape(-1) for w in parts], out=data)
        split = sum(w.out_dim for w in parts[: runs[0]])
        return QuantWeight(data, parts[0].qtype, out_dim, in_dim, _distinct(types), split=split, qtype2=parts[runs[0]].qtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 `[n, in]`: the dequantized rows `ids` (an embedding lookup in a quantized token
        table, as llama.cpp's get_rows: only the groups of 8 rows that hold them are decoded)."""
        if self.split:
            raise ValueError("row lookups read single-format weights")
        ids = ids.reshape(-1).long().contiguous()
        if int(ids.min()) < 0 or int(ids.max()) >= self.out_dim:
            raise IndexError(f"row ids must be in [0, {self.out_dim})")
        kernels = load_kernels()
        if kernels is not None:
            out = torch.empty(ids.numel(), self.in_dim, dtype=torch.float32)
            kernels.lib.tl_quant_rows(self.data.data_ptr(), self.format, self.in_dim, ids.data_ptr(), ids.numel(), out.data_ptr())
            return out
        groups, inverse = torch.unique(torch.div(ids, 8, rounding_mode="floor"), return_inverse=True)
        sub = QuantWeight(self.data[groups].contiguous(), self.qtype, 8 * int(groups.numel()), self.in_dim, self.types)
        return sub.dequantize().view(-1, 8, self.in_dim)[inverse, ids % 8]

    def dequantize(self) -> torch.Tensor:
        """float32 `[out, in]`: the values the kernels multiply by (the file's, exactly)."""
        if self.split:
            return torch.cat([part.dequantize() for part in self.parts()])
        groups, nb, fmt = self.out_dim // 8, self.in_dim // 32, self.format
        if fmt in (_Q4K, _Q5K, _Q6K):
            return torch.from_numpy(_dequantize_k(self.data.numpy(), fmt, self.out_dim, self.in_dim))
        g = self.data.numpy().reshape(groups, nb, -1)

        def scales(lo: int, hi: int) -> np.ndarray:  # [G, nb, 8] f16 -> [G, 8, nb, 1] fp32
            return np.ascontiguousarray(g[..., lo:hi]).view(np.float16).astype(np.float32).transpose(0, 2, 1)[..., None]

        if fmt == _Q8X8:
            q = g[..., 16:].view(np.int8).reshape(groups, nb, 8, 8, 4).transpose(0, 3, 1, 2, 4).reshape(groups, 8, nb, 32)
            w = q.astype(np.float32) * scales(0, 16)
        else:
            p = g[..., -128:].reshape(groups, nb, 4, 8, 4).transpose(0, 3, 1, 2, 4).reshape(groups, 8, nb, 16)
            q = np.concatenate([p & 15, p >> 4], axis=-1).astype(np.float32)  # [G, o, nb, 32]
            d = scales(0, 16)
            w = q * d + (scales(16, 32) if fmt == _Q4X8 else d * np.float32(-8))
        return torch.from_numpy(np.ascontiguousarray(w.reshape(self.out_dim, self.in_dim)))


@dataclass(frozen=True)
class CpuKernels:
    lib: ctypes.CDLL
    threads: int
    packed: bool = True  # whether tl_linear_packed (packed bf16 weights) is available
    bf16_attention: bool = True  # whether tl_attention_bf16 (blocked bf16 KV cache) is available
    variant: str = "avx512"  # which source: "avx512" (kernels.c) or "avx2" (kernels_avx2.c)
    # each calling thread's scratch buffer for the linears (int8 / bf16 copies of the input),
    # reused across calls: a fresh torch.empty per call cost ~2.7 us of a ~12 us small linear
    _local: threading.local = field(default_factory=threading.local, repr=False, compare=False)

    def _scratch(self, nbytes: int) -> int:
        """The address of this thread's scratch buffer, at least `nbytes` long (grown as needed).
        Only the C call in progress on this thread reads or writes it."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.buf = torch.empty(max(nbytes, 1 << 16, 2 * (buf.numel() if buf is not None else 0)), dtype=torch.uint8)
        return buf.data_ptr()

    @staticmethod
    def supports(*widths_then_head_dim: int) -> bool:
        """Whether linear input widths (multiples of 32) and head_dim (16, 32, 64 or 128) fit every
        kernel path (the bf16 attention also serves 256: `attention_head_dims`)."""
        *widths, head_dim = widths_then_head_dim
        return all(w % 32 == 0 for w in widths) and head_dim in (16, 32, 64, 128)

    def pack(self, weight: torch.Tensor) -> PackedWeight | None:
        """The packed form of `weight` when the packed kernel can use it, else None."""
        return PackedWeight.pack(weight) if self.packed and PackedWeight.fits(weight) else None

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | PackedWeight,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        *,
        norm: tuple[torch.Tensor, float] | None = None,
        glu: bool = False,
    ) -> torch.Tensor:
        """`x @ weight.T + bias` with x fp32 `[rows, in]`, weight bf16/fp32 `[out, in]`, packed or
        quantized. With `out` (contiguous fp32 `[rows, out]`), the result is added to it in place.
        The input may be formed first, the same bits either way (quantized weights fuse it into
        their call): `norm=(w, eps)` RMSNorms x; `glu` takes x = (gate | up) `[rows, 2 in]` and
        uses `silu(gate) * up`."""
        if isinstance(weight, QuantWeight):
            return self._linear_quant(x, weight, bias, out, norm, glu)
        if glu:
            x = self.silu_mul(x)
        elif norm is not None:
            x = self.rmsnorm(x, norm[0], norm[1])
        if isinstance(weight, PackedWeight):
            return self._linear_packed(x, weight, bias, out)
        if out is not None:
            return out.add_(self.linear(x, weight, bias))
        rows, in_dim = x.shape
        out_dim = weight.shape[0]
        if in_dim % 32 or weight.shape[1] != in_dim or weight.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"kernel linear: unsupported shapes/dtype x {tuple(x.shape)}, w {tuple(weight.shape)} {weight.dtype}")
        if x.dtype != torch.float32 or not weight.is_contiguous():
            raise ValueError("kernel linear: x must be float32 and the weight contiguous")
        if bias is not None:
            bias = bias.float().contiguous()
        x = x.contiguous()
        y = torch.empty(rows, out_dim, dtype=torch.float32)
        self.lib.tl_linear(
            x.data_ptr(),
            weight.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            y.data_ptr(),
            self._scratch(4 * rows * in_dim if weight.dtype == torch.bfloat16 else 0),
            rows,
            in_dim,
            out_dim,
            16 if weight.dtype == torch.bfloat16 else 32,
        )
        return y

    def _linear_packed(
        self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor | None
    ) -> torch.Tensor:
        rows, in_dim = x.shape
        if in_dim != weight.in_dim or x.dtype != torch.float32:
            raise ValueError(f"kernel linear: x {tuple(x.shape)} {x.dtype} does not fit packed weight [{weight.out_dim}, {weight.in_dim}]")
        if out is not None and (out.shape != (rows, weight.out_dim) or out.dtype != torch.float32 or not out.is_contiguous()):
            raise ValueError(f"kernel linear: out {tuple(out.shape)} must be contiguous float32 [{rows}, {weight.out_dim}]")
        if bias is not None:
            bias = bias.float().contiguous()
        x = x.contiguous()
        y = out if out is not None else torch.empty(rows, weight.out_dim, dtype=torch.float32)
        self.lib.tl_linear_packed(
            x.data_ptr(),
            weight.data.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            y.data_ptr(),
            self._scratch(2 * rows * in_dim),  # the input rounded to bf16
            rows,
            in_dim,
            weight.out_dim,
            int(out is not None),
        )
        return y

    def quant_vnni(self, enable: bool | None = None) -> bool:
        """Whether the quantized linears' integer sums run on AVX-512 VNNI (`vpdpbusd`) rather
        than AVX2 `vpmaddubsw` + `vpmaddwd` (the same exact sums, so the same bits): with `enable`,
        switch (None: as cpuid says); True only on the AVX-512 variant of a CPU with VNNI."""
        return bool(self.lib.tl_quant_vnni(-1 if enable is None else int(enable)))

    def _linear_quant(
        self,
        x: torch.Tensor,
        weight: QuantWeight,
        bias: torch.Tensor | None,
        out: torch.Tensor | None,
        norm: tuple[torch.Tensor, float] | None = None,
        glu: bool = False,
    ) -> torch.Tensor:
        """`tl_linear_q`: each row of x (RMSNormed or gated first when asked) quantized to int8
        blocks of 32 with its own scale, then exact integer block dot products with the weight's
        blocks (see quant.h)."""
        rows, in_dim = x.shape
        if glu:
            in_dim //= 2
        if in_dim != weight.in_dim or x.dtype != torch.float32:
            raise ValueError(f"kernel linear: x {tuple(x.shape)} {x.dtype} does not fit {weight.name} weight [{weight.out_dim}, {weight.in_dim}]")
        if out is not None and (out.shape != (rows, weight.out_dim) or out.dtype != torch.float32 or not out.is_contiguous()):
            raise ValueError(f"kernel linear: out {tuple(out.shape)} must be contiguous float32 [{rows}, {weight.out_dim}]")
        if bias is not None:
            bias = bias.float().contiguous()
        x = x.contiguous()
        # int8 rows, block scales and sums, the formed fp32 input when fusing, a second int8 copy
        # for a stack of two formats, Q6K's half-block sums (see tl_linear_q)
        scratch = self._scratch(rows * in_dim * 7 + 8 * rows * (in_dim // 32))
        y = out if out is not None else torch.empty(rows, weight.out_dim, dtype=torch.float32)
        norm_w = norm[0].contiguous() if norm is not None and not glu else None
        self.lib.tl_linear_q(
            x.data_ptr(), norm_w.data_ptr() if norm_w is not None else None, float(norm[1]) if norm_w is not None else 0.0,
            int(glu), scratch, weight.data.data_ptr(), weight.format,
            bias.data_ptr() if bias is not None else None, y.data_ptr(), rows, in_dim, weight.out_dim, int(out is not None),
        )
        return y

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row of fp32 `x` `[rows, dim]` (dim a multiple of 16), fp32 weight."""
        x = x.contiguous()
        y = torch.empty_like(x)
        self.lib.tl_rmsnorm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
        return y

    def head_norm(self, qkv: torch.Tensor, offset: int, heads: int, head_dim: int, weight: torch.Tensor, eps: float,
                  mult: float = 1.0) -> None:
        """In place on contiguous fp32 `qkv` `[rows, width]`: RMSNorm of the `heads` head vectors
        from column `offset` with `weight` `[head_dim]`, times `mult` (QK-norm, norms.h)."""
        if not qkv.is_contiguous() or qkv.dtype != torch.float32 or offset + heads * head_dim > qkv.shape[1]:
            raise ValueError("head_norm: needs a contiguous fp32 [rows, width] tensor holding the heads")
        self.lib.tl_head_norm(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], offset, heads, head_dim,
                              weight.contiguous().data_ptr(), eps, mult)

    def rmsnorm_add(self, x: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """`x += RMSNorm(o) * weight` in place, fp32 `[rows, dim]` (a post-norm and its residual)."""
        if not x.is_contiguous() or x.dtype != torch.float32 or x.shape != o.shape:
            raise ValueError("rmsnorm_add: x must be contiguous fp32 of o's shape")
        o = o.contiguous()
        self.lib.tl_rmsnorm_add(x.data_ptr(), o.data_ptr(), weight.contiguous().data_ptr(), x.shape[0], x.shape[1], eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` for fp32 `[rows, 2f]` = (gate | up), f a multiple of 16."""
        rows, width = gate_up.shape
        y = torch.empty(rows, width // 2, dtype=torch.float32)
        self.lib.tl_silu_mul(gate_up.contiguous().data_ptr(), y.data_ptr(), rows, width // 2)
        return y

    def attention_head_dims(self, blocked: bool) -> tuple[int, ...]:
        """Head dims the fused attention serves: 16..128 over fp32 caches; with blocked bf16
        caches also 256 (Gemma 3), whose P.V runs in two 128-wide halves."""
        return (16, 32, 64, 128, 256) if blocked and self.bf16_attention else (16, 32, 64, 128)

    def attention(
        self,
        qkv: torch.Tensor,  # [rows, (heads + 2 kv_heads) * hd] fp32, bias added
        plan: RowPlan,
        layer: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        cos: torch.Tensor,  # [positions, hd] fp32
        sin: torch.Tensor,
    ) -> torch.Tensor:  # [rows, heads * hd]
        """Rotary embedding, K/V write to each row's cache slot and attention, for one layer."""
        rows = qkv.shape[0]
        if qkv.dtype != torch.float32:
            raise ValueError(f"kernel attention: qkv must be float32, got {qkv.dtype}")
        if qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or rows != plan.rows:
            raise ValueError(f"kernel attention: qkv {tuple(qkv.shape)} does not fit the plan ({plan.rows} rows)")
        qkv = qkv.contiguous()
        out = torch.empty(rows, heads * head_dim, dtype=torch.float32)
        work = self.attention_work(plan, heads, kv_heads, head_dim)
        # arguments both kernels take first: rows, their caches, the layer, output and query buffers
        lead = (
            qkv.data_ptr(), plan.positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), plan.kv_base.data_ptr(),
            plan.capacity.data_ptr(), plan.write_slot.data_ptr(), layer, out.data_ptr(), work.q.data_ptr(),
            rows, heads, kv_heads, head_dim,
        )
        if plan.blocked:
            mask = work.mask
            self.lib.tl_attention_bf16(
                *lead,
                plan.slot_end.data_ptr(),
                plan.slot_lo.data_ptr() if plan.slot_lo is not None else None,
                plan.mask_start.data_ptr() if mask is not None else None,
                mask.data_ptr() if mask is not None else None,
                mask.shape[1] if mask is not None else 0,
                work.tail.data_ptr() if work.tail is not None else None,
                work.tail_slots,
                work.chunk.data_ptr(),
                work.scratch.data_ptr(),
                plan.max_slots,
            )
            return out
        self.lib.tl_attention(
            *lead,
            plan.slot_end.data_ptr() if plan.slot_end is not None else None,
            plan.slot_off.data_ptr() if plan.slot_off is not None else None,
            plan.slot_idx.data_ptr() if plan.slot_idx is not None else None,
            work.scratch.data_ptr(),
            plan.max_slots,
        )
        return out

    def attention_work(self, plan: RowPlan, heads: int, kv_heads: int, head_dim: int) -> AttentionWork:
        """The attention kernel's buffers for a forward over `plan`, made by its first layer and
        kept in `plan.work` for the others. Over blocked bf16 caches (`tl_attention_bf16`) the
        queries are rounded to bf16 pairs into the query buffer, rows of one sequence attend
        together (`chunk`), and tree rows read their own path from `tail`."""
        if head_dim not in self.attention_head_dims(plan.blocked) or heads % kv_heads:
            raise ValueError(f"kernel attention: unsupported heads {heads}/{kv_heads} x {head_dim}")
        if plan.blocked and (not self.bf16_attention or plan.slot_end is None):
            raise ValueError("kernel attention: blocked bf16 caches need tl_attention_bf16 and slot_end")
        work, rows = plan.work, plan.rows
        if "q" not in work:  # the layers of one forward share the scratch buffers
            work["q"] = torch.empty(rows * heads * head_dim // (2 if plan.blocked else 1), dtype=torch.int32 if plan.blocked else torch.float32)
            work["scratch"] = torch.empty(self.threads * (32 if plan.blocked else 4) * plan.max_slots, dtype=torch.float32)
        if not plan.blocked:
            return AttentionWork(work["q"], work["scratch"])
        if "chunk" not in work:
            work["chunk"] = torch.empty(rows + 1, dtype=torch.int64)
        mask = plan.mask.contiguous() if plan.mask is not None else None
        if mask is None:
            return AttentionWork(work["q"], work["scratch"], work["chunk"])
        tail_slots = -(-(15 + mask.shape[1]) // 16) * 16
        if "tail" not in work:  # zeroed once: slots past a path are read with probability 0
            work["tail"] = torch.zeros(rows * kv_heads * 2 * tail_slots * head_dim, dtype=torch.bfloat16)
        return AttentionWork(work["q"], work["scratch"], work["chunk"], mask, work["tail"], tail_slots)


@dataclass(frozen=True)
class AttentionWork:
    """A forward's buffers for the attention kernel (`CpuKernels.attention_work`)."""

    q: torch.Tensor  # rotated queries (fp32, or bf16 pairs over blocked caches)
    scratch: torch.Tensor  # per-thread scores
    chunk: torch.Tensor | None = None  # blocked caches: row runs attended together
    mask: torch.Tensor | None = None  # blocked caches, token trees: the plan's mask, contiguous
    tail: torch.Tensor | None = None  # and each tree row's own path of K/V
    tail_slots: int = 0


@dataclass(frozen=True)
class RowPlan:
    """Where each new row of a forward lives, for the attention kernel (built once per forward).

    Row r is position `positions[r]` of a sequence whose KV cache tensor `[layers, 2, kv_heads,
    capacity[r], hd]` starts at address `kv_base[r]`; its key and value go to slot `write_slot[r]`;
    it attends to slots `0 .. slot_end[r]-1`, or, for an fp32 cache when `slot_idx` is set, to
    `slot_idx[slot_off[r] : slot_off[r+1]]` (token trees). All int64. `work` holds the kernel's
    scratch buffers, made by the first layer's call and reused by the others.
    """

    positions: torch.Tensor
    kv_base: torch.Tensor
    capacity: torch.Tensor
    write_slot: torch.Tensor
    slot_end: torch.Tensor | None
    slot_off: torch.Tensor | None
    slot_idx: torch.Tensor | None
    max_slots: int  # a multiple of 16
    # bf16 blocked caches (`KVCache(blocked=True)`): rows attend to slots 0 .. slot_end[r]-1;
    # a token-tree row (mask_start[r] >= 0) sees slots 0 .. mask_start[r]-1, then the tree
    # slots mask_start[r] + j with mask[r, j] != 0 (its path), and slot_end[r] is their count
    blocked: bool = False
    mask_start: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [rows, width] uint8
    slot_lo: torch.Tensor | None = None  # bf16 blocked caches: row r sees no slot below slot_lo[r] (sliding window)
    work: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rows(self) -> int:
        return int(self.positions.shape[0])


@lru_cache(maxsize=1)
def load_kernels() -> CpuKernels | None:
    """Compile (once, cached on disk) and load the kernels; None when this machine can't."""
    if os.environ.get("TOKENLEAP_NO_KERNELS"):
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    flags = cpu_flags()
    variant = kernel_variant(flags)
    if not compiler or variant is None:
        logger.warning("no C compiler, or a CPU without AVX-512 or AVX2+FMA: using torch kernels (slower, not row-invariant)")
        return None
    try:
        lib = ctypes.CDLL(str(_compile(compiler, variant, flags)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        logger.warning("could not build tokenleap kernels, using torch: %s", detail.strip()[:500])
        return None
    lib.tl_linear.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int]
    lib.tl_linear.restype = None
    lib.tl_attention.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64]
    lib.tl_attention.restype = None
    lib.tl_rmsnorm.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float]
    lib.tl_rmsnorm.restype = None
    lib.tl_silu_mul.argtypes = [_ptr, _ptr, _i64, _i64]
    lib.tl_silu_mul.restype = None
    lib.tl_head_norm.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, ctypes.c_float, ctypes.c_float]
    lib.tl_head_norm.restype = None
    lib.tl_rmsnorm_add.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float]
    lib.tl_rmsnorm_add.restype = None
    lib.tl_init.argtypes = [ctypes.c_int]
    lib.tl_init.restype = ctypes.c_int
    threads = lib.tl_init(torch.get_num_threads())  # the kernels' own thread pool (see pool.h)
    lib.tl_linear_q.argtypes = [_ptr, _ptr, ctypes.c_float, ctypes.c_int, _ptr, _ptr, ctypes.c_int, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int]
    lib.tl_linear_q.restype = None
    lib.tl_quant_vnni.argtypes = [ctypes.c_int]
    lib.tl_quant_vnni.restype = ctypes.c_int
    lib.tl_repack.argtypes = [_ptr, _ptr, ctypes.c_int, _i64, _i64]
    lib.tl_repack.restype = ctypes.c_int
    lib.tl_quant_rows.argtypes = [_ptr, ctypes.c_int, _i64, _ptr, _i64, _ptr]
    lib.tl_quant_rows.restype = None
    lib.tl_forward_layers.argtypes = [_ptr]
    lib.tl_forward_layers.restype = ctypes.c_int
    features = int(lib.tl_features())
    packed, bf16_attention = bool(features & 1), bool(features & 2)
    if packed:
        lib.tl_linear_packed.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int]
        lib.tl_linear_packed.restype = None
    if bf16_attention:
        lib.tl_attention_bf16.argtypes = [
            _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64,
            _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64,
        ]
        lib.tl_attention_bf16.restype = None
    logger.info("tokenleap kernels: %s variant, %d threads", variant, threads)
    return CpuKernels(lib=lib, threads=threads, packed=packed, bf16_attention=bf16_attention, variant=variant)
