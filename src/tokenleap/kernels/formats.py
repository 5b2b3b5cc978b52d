"""The weight formats the kernels read: `PackedWeight` (bf16 in an output-interleaved layout) and
`QuantWeight` (GGUF blocks repacked for 8 outputs at a time, each format in its file's own bytes
per weight). The GGUF formats are one table, `FORMATS`, one `Format` row each, as ggml's
`type_traits[]`: ids, block sizes, the kernel's format and the numpy reference of the repack and
of the dequantization the tests check the C code against (quant.h's TLQ_FORMATS holds the same rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import cast

import numpy as np
import torch

from tokenleap.kernels.build import load_library
from tokenleap.kernels.memory import huge_page_tensor


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
            raise ValueError(
                f"cannot pack weight {tuple(weight.shape)} {weight.dtype}: needs bf16, out % 16 == 0, in % 32 == 0"
            )
        out_dim, in_dim = weight.shape
        data = weight.reshape(out_dim // 16, 16, in_dim // 2, 2).permute(0, 2, 1, 3).contiguous()
        return cls(data=data, out_dim=out_dim, in_dim=in_dim)

    def unpack(self) -> torch.Tensor:
        """The bf16 `[out, in]` weight it was packed from (a permutation back: exactly it)."""
        return self.data.permute(0, 2, 1, 3).reshape(self.out_dim, self.in_dim)


# quant.h's TLQ_* (the table below)
_Q4X8, _Q8X8, _Q40X8, _IQ4NL, _Q4K, _Q6K, _Q5K, _IQ4XS, _Q3K, _Q2K, _Q50X8, _Q51X8 = range(1, 13)
# IQ4_NL's non-linear grid: w = d IQ4NL_VALUES[q] (ggml's kvalues_iq4nl; quant.h's tlq_iq4nl)
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _decode(raw: np.ndarray, qtype: int, out_dim: int, in_dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A 32-block GGUF tensor's blocks as integer weights and per-block scales: (q `[out, nb, 32]`
    (unsigned 0..15 / 0..31 for the Q4 / Q5 formats, int8 for Q8_0), d `[out, nb]` f16, m `[out, nb]`
    f16 or None) with w = d q + m (Q4_0 / Q5_0: m None, the kernel forms -8 d / -16 d; IQ4_NL: q the
    grid's indices, m None)."""
    nb = in_dim // 32
    blocks = raw.reshape(out_dim, nb, BY_GGML[qtype].file_bytes)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]  # [out, nb]
    if qtype == 8:
        return blocks[..., 2:34].view(np.int8), d, None
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0] if qtype in (3, 7) else None  # Q4_1 / Q5_1
    at = 2 if m is None else 4
    if qtype in (6, 7):  # Q5_0 / Q5_1: u32 high bits, then 16 bytes of nibbles
        qh = np.ascontiguousarray(blocks[..., at : at + 4]).view(np.uint32)  # [out, nb, 1]
        qs = blocks[..., at + 4 : at + 20]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        return np.concatenate([qs & 15, qs >> 4], axis=-1) | (high << 4), d, m
    qs = blocks[..., at : at + 16]
    return np.concatenate([qs & 15, qs >> 4], axis=-1), d, m


def _high_bits(h: np.ndarray, groups: int) -> np.ndarray:
    """Fifth bits `[out, nb, 32]` (0 / 1) -> Q5K's / Q50X8's 32 bytes a block `[G, nb, 32]`: byte
    (o, i) holds input 4 t + i's bit at bit t and input 16 + 4 t + i's at bit 4 + t."""
    nb = h.shape[1]
    by_bit = h.astype(np.uint8).reshape(groups, 8, nb, 8, 4)  # [G, o, nb, bit, i]: input 4 bit + i
    bits = cast(np.ndarray, sum(by_bit[..., b, :] << b for b in range(8)))  # [G, o, nb, i]
    return bits.astype(np.uint8).transpose(0, 2, 1, 3).reshape(groups, nb, 32)


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


def _repack_k(qtype: int, raw: np.ndarray, out_dim: int, in_dim: int) -> np.ndarray:
    """Q4_K / Q5_K / Q6_K superblocks -> quant.h's Q4K / Q5K / Q6K groups (the file's bytes,
    interleaved; the reference `tl_repack` is tested against)."""
    groups, nsb, nb = out_dim // 8, in_dim // 256, in_dim // 32
    blk = raw.reshape(out_dim, nsb, BY_GGML[qtype].file_bytes)
    if qtype in (12, 13):
        sc8 = blk[..., 4:16]
        sc = np.concatenate([sc8[..., 0:4] & 63, (sc8[..., 8:12] & 15) | ((sc8[..., 0:4] >> 6) << 4)], axis=-1)
        mn = np.concatenate([sc8[..., 4:8] & 63, (sc8[..., 8:12] >> 4) | ((sc8[..., 4:8] >> 6) << 4)], axis=-1)
        by_j = lambda a: a.reshape(groups, 8, nsb, 8).transpose(0, 2, 3, 1).reshape(groups, nsb, 64)  # noqa: E731
        sc, mn = by_j(sc), by_j(mn)
        hi = (sc >> 4) | ((mn >> 4) << 2)
        q5 = qtype == 13
        qs = blk[..., 48 if q5 else 16 :].reshape(out_dim, nsb, 4, 32)  # 4 chunks of 64 inputs: low nibbles, then high
        q: np.ndarray = np.stack([qs & 15, qs >> 4], axis=3).reshape(out_dim, nsb, 8, 32)  # [out, nsb, j, l]
        head = [_by_output(blk[..., 0:2], groups), _by_output(blk[..., 2:4], groups), (sc & 15) | ((mn & 15) << 4),
                hi[..., :32] | (hi[..., 32:] << 4)]
        if not q5:
            return np.concatenate(
                [*head, _nibbles(q.reshape(out_dim, nb, 32), groups).reshape(groups, nsb, 1024)], axis=-1
            ).reshape(groups, -1)
        qh = blk[..., 16:48]  # [out, nsb, l]: bit j is sub-block j's 5th bit
        h5 = ((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1)  # [out, nsb, j, l]
        nib = _nibbles(q.reshape(out_dim, nb, 32), groups)  # [G, nb, 128]
        body = (
            np.concatenate([nib, _high_bits(h5.reshape(out_dim, nb, 32), groups)], axis=-1).reshape(groups, nsb, 1280)
        )
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


def _repack_iq4xs(raw: np.ndarray, out_dim: int, in_dim: int) -> np.ndarray:
    """IQ4_XS superblocks (f16 d, u16 scales_h, u8 scales_l[4], 128 nibble bytes) -> quant.h's
    IQ4XS groups: d[8], scales_l[8][4], scales_h[8][2], then 8 blocks of Q4X8's nibble bytes."""
    groups, nsb = out_dim // 8, in_dim // 256
    blk = raw.reshape(out_dim, nsb, 136)
    qs = blk[..., 8:].reshape(out_dim, nsb * 8, 16)  # [out, nb, 16]: byte l holds input l low, l + 16 high
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [out, nb, 32]
    nib = _nibbles(q, groups).reshape(groups, nsb, 1024)
    head = [_by_output(blk[..., 0:2], groups), _by_output(blk[..., 4:8], groups), _by_output(blk[..., 2:4], groups)]
    return np.concatenate([*head, nib], axis=-1).reshape(groups, -1)


def _q3k_values(raw: np.ndarray, out_dim: int, in_dim: int) -> np.ndarray:
    """Q3_K superblocks (hmask[32], qs[64], scales[12], f16 d) -> unsigned q `[out, in]` in 0..7
    (w = d (sc - 32) (q - 4)), in ggml's value order."""
    nsb = in_dim // 256
    blk = raw.reshape(out_dim, nsb, 110)
    x = np.arange(256)
    n, j, lane = x // 128, (x % 128) // 32, x % 32
    low = (blk[..., 32 + 32 * n + lane] >> (2 * j).astype(np.uint8)) & 3
    third = (blk[..., lane] >> (4 * n + j).astype(np.uint8)) & 1
    return (low | (third << 2)).reshape(out_dim, in_dim)


def _crumbs(q: np.ndarray, groups: int) -> np.ndarray:
    """Values' low 2 bits `[G, o, nb, u, s, i]` (input 4 (4 u + s) + i of a block) -> the
    Q3K / Q2K crumb bytes `[G, nb, 64]`: in vector u, byte (o, i) holds inputs 4 (4 u + s) + i at bits 2 s."""
    nb = q.shape[2]
    crumbs = ((q & 3) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=4, dtype=np.uint8)  # [G, o, nb, u, i]
    return crumbs.transpose(0, 2, 3, 1, 4).reshape(groups, nb, 64)


def _q2k_values(raw: np.ndarray, out_dim: int, in_dim: int) -> np.ndarray:
    """Q2_K superblocks (scales[16], qs[64], f16 d, f16 dmin) -> q `[out, in]` in 0..3
    (w = d sc q - dmin m), in ggml's value order."""
    blk = raw.reshape(out_dim, in_dim // 256, 84)
    x = np.arange(256)
    n, j, lane = x // 128, (x % 128) // 32, x % 32
    return ((blk[..., 16 + 32 * n + lane] >> (2 * j).astype(np.uint8)) & 3).reshape(out_dim, in_dim)


def _repack_q2k(raw: np.ndarray, out_dim: int, in_dim: int) -> np.ndarray:
    """Q2_K superblocks -> quant.h's Q2K groups: d[8], dmin[8], the scale bytes 0-3 / ... / 12-15
    as four 8 x 4 runs, then per block of 32 the values' crumbs (64 bytes)."""
    groups, nsb, nb = out_dim // 8, in_dim // 256, in_dim // 32
    blk = raw.reshape(out_dim, nsb, 84)
    body = _crumbs(_q2k_values(raw, out_dim, in_dim).reshape(groups, 8, nb, 2, 4, 4), groups).reshape(groups, nsb, 512)
    head = [_by_output(blk[..., 80:82], groups), _by_output(blk[..., 82:84], groups),
            *(_by_output(blk[..., 4 * v : 4 * v + 4], groups) for v in range(4))]
    return np.concatenate([*head, body], axis=-1).reshape(groups, -1)


def _dequantize_q2k(g: np.ndarray, out_dim: int, in_dim: int) -> np.ndarray:
    """quant.h's Q2K groups -> float32 `[out, in]`: (d sc) q - dmin m per 16 inputs."""
    groups, nsb, nb = out_dim // 8, in_dim // 256, in_dim // 32
    g = g.reshape(groups, nsb, -1)
    # [G, nsb, o]
    d, dmin = (np.ascontiguousarray(g[..., a : a + 16]).view(np.float16).astype(np.float32) for a in (0, 16))
    # [G, nsb, o, k]
    scm = g[..., 32:160].reshape(groups, nsb, 4, 8, 4).transpose(0, 1, 3, 2, 4).reshape(groups, nsb, 8, 16)
    dl = d[..., None] * (scm & 15).astype(np.float32)
    ml = dmin[..., None] * (scm >> 4).astype(np.float32)
    crumbs = g[..., 160:].reshape(groups, nb, 2, 8, 4)  # [G, nb, u, o, i]
    s = np.arange(4, dtype=np.uint8)
    q = (crumbs[:, :, :, None] >> (2 * s)[None, None, None, :, None, None]) & 3  # [G, nb, u, s, o, i]
    qf = q.reshape(groups, nb, 8, 8, 4).transpose(0, 3, 1, 2, 4).reshape(groups, 8, nsb, 16, 16).astype(np.float32)
    w = dl.transpose(0, 2, 1, 3)[..., None] * qf - ml.transpose(0, 2, 1, 3)[..., None]
    return np.ascontiguousarray(w.reshape(out_dim, in_dim))


def _repack_q3k(raw: np.ndarray, out_dim: int, in_dim: int) -> np.ndarray:
    """Q3_K superblocks -> quant.h's Q3K groups: d[8], the scales' bytes 0-3 / 4-7 / 8-11 as three
    8 x 4 runs, then per block of 32 the low 2 bits (2 x 32 bytes) and third bits (32 bytes)."""
    groups, nsb, nb = out_dim // 8, in_dim // 256, in_dim // 32
    blk = raw.reshape(out_dim, nsb, 110)
    q = _q3k_values(raw, out_dim, in_dim).reshape(groups, 8, nb, 2, 4, 4)  # [G, o, nb, u, s, i]: input 4 (4 u + s) + i
    thirds = (((q >> 2) & 1).reshape(groups, 8, nb, 8, 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(
        axis=3, dtype=np.uint8
    )  # [G, o, nb, i]
    body = np.concatenate([_crumbs(q, groups), thirds.transpose(0, 2, 1, 3).reshape(groups, nb, 32)], axis=-1).reshape(
        groups, nsb, 768
    )
    head = [
        _by_output(blk[..., 108:110], groups),
        *(_by_output(blk[..., 96 + 4 * v : 100 + 4 * v], groups) for v in range(3)),
    ]
    return np.concatenate([*head, body], axis=-1).reshape(groups, -1)


def _dequantize_q3k(g: np.ndarray, out_dim: int, in_dim: int) -> np.ndarray:
    """quant.h's Q3K groups -> float32 `[out, in]`: d (sc - 32) (q - 4) per 16 inputs."""
    groups, nsb, nb = out_dim // 8, in_dim // 256, in_dim // 32
    g = g.reshape(groups, nsb, -1)
    d = np.ascontiguousarray(g[..., 0:16]).view(np.float16).astype(np.float32)  # [G, nsb, o]
    words = [np.ascontiguousarray(g[..., 16 + 32 * v : 48 + 32 * v]).view(np.uint32) for v in range(3)]  # [G, nsb, o]
    k = np.arange(16, dtype=np.uint32)
    low = np.where((k % 8) < 4, words[0][..., None] >> (8 * (k % 4) + 4 * (k // 8)),
                   words[1][..., None] >> (8 * (k % 4) + 4 * (k // 8))) & 15
    high = (words[2][..., None] >> (8 * (k % 4) + 2 * (k // 4))) & 3
    dl = d[..., None] * ((low | (high << 4)).astype(np.float32) - np.float32(32))  # [G, nsb, o, k]
    body = g[..., 112:].reshape(groups, nb, 96)
    crumbs = body[..., :64].reshape(groups, nb, 2, 8, 4)  # [G, nb, u, o, i]
    thirds = body[..., 64:].reshape(groups, nb, 8, 4)  # [G, nb, o, i]
    s = np.arange(4, dtype=np.uint8)
    low2 = (crumbs[:, :, :, None] >> (2 * s)[None, None, None, :, None, None]) & 3  # [G, nb, u, s, o, i]
    third = (thirds[:, :, None] >> np.arange(8, dtype=np.uint8)[None, None, :, None, None]) & 1  # [G, nb, g, o, i]
    q = low2.reshape(groups, nb, 8, 8, 4) | (third << 2)  # [G, nb, g, o, i]
    # [G, o, nsb, k, 16]
    qf = q.transpose(0, 3, 1, 2, 4).reshape(groups, 8, nsb, 16, 16).astype(np.float32) - np.float32(4)
    w = dl.transpose(0, 2, 1, 3)[..., None] * qf
    return np.ascontiguousarray(w.reshape(out_dim, in_dim))


def _dequantize_iq4xs(g: np.ndarray, out_dim: int, in_dim: int) -> np.ndarray:
    """quant.h's IQ4XS groups -> float32 `[out, in]`: d (ls - 32) v[q] per block of 32."""
    groups, nsb = out_dim // 8, in_dim // 256
    g = g.reshape(groups, nsb, -1)
    d = np.ascontiguousarray(g[..., 0:16]).view(np.float16).astype(np.float32)  # [G, nsb, o]
    sl = np.ascontiguousarray(g[..., 16:48]).view(np.uint32)  # [G, nsb, o]
    sh = np.ascontiguousarray(g[..., 48:64]).view(np.uint16).astype(np.uint32)
    j = np.arange(8, dtype=np.uint32)
    ls = ((sl[..., None] >> (4 * j)) & 15) | (((sh[..., None] >> (2 * j)) & 3) << 4)  # [G, nsb, o, j]
    dl = d[..., None] * (ls.astype(np.float32) - np.float32(32))
    p = g[..., 64:].reshape(groups, nsb, 8, 4, 8, 4).transpose(0, 4, 1, 2, 3, 5).reshape(groups, 8, nsb, 8, 16)
    v = IQ4NL_VALUES[np.concatenate([p & 15, p >> 4], axis=-1)].astype(np.float32)  # [G, o, nsb, j, 32]
    w = v * dl.transpose(0, 2, 1, 3)[..., None]
    return np.ascontiguousarray(w.reshape(out_dim, in_dim))


def _dequantize_k(fmt: int, g: np.ndarray, out_dim: int, in_dim: int) -> np.ndarray:
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
            # [G, nsb, j, o, 8, i]
            h = np.concatenate([np.stack([(hb >> t) & 1 for t in range(4)], axis=-2),
                                np.stack([(hb >> (4 + t)) & 1 for t in range(4)], axis=-2)], axis=-2)
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


def _repack_blocks(qtype: int, raw: np.ndarray, out_dim: int, in_dim: int) -> np.ndarray:
    """A 32-block format's GGUF blocks `[out, in/32 * block bytes]` -> quant.h's interleaved groups
    `[out/8, in/32 * group bytes]`: per group of eight outputs and block of 32 inputs, f16 d[8]
    (f16 m[8] for Q4_1 / Q5_1), then Q8_0's int8 values four inputs at a time (byte (g, o, i) =
    q[o][4 g + i]) or the Q4X8 nibble bytes, then for Q5_0 / Q5_1 the fifth bits (`_high_bits`)."""
    nb, groups = in_dim // 32, out_dim // 8
    q, d, m = _decode(raw, qtype, out_dim, in_dim)

    def by_group(a: np.ndarray) -> np.ndarray:  # [out, nb] -> [G, nb, 8 * itemsize] bytes
        return np.ascontiguousarray(a.reshape(groups, 8, nb).transpose(0, 2, 1)).view(np.uint8)

    parts = [by_group(d.astype(np.float16))]
    if qtype == 8:
        qq = np.ascontiguousarray(q.astype(np.int8)).view(np.uint8).reshape(groups, 8, nb, 8, 4)
        parts.append(qq.transpose(0, 2, 3, 1, 4).reshape(groups, nb, 256))
    else:
        if m is not None:
            parts.append(by_group(m.astype(np.float16)))
        parts.append(_nibbles(q.astype(np.uint8) & 15, groups))
        if qtype in (6, 7):
            parts.append(_high_bits(q >> 4, groups))
    return np.concatenate(parts, axis=-1).reshape(groups, -1)


def _dequantize_blocks(qtype: int, g: np.ndarray, out_dim: int, in_dim: int) -> np.ndarray:
    """quant.h's 32-input groups (`_repack_blocks`) -> float32 `[out, in]`: Q8_0 d q; Q4_0 / Q5_0
    d q - 8 d / - 16 d; Q4_1 / Q5_1 d q + m; IQ4_NL d v[q]."""
    groups, nb = out_dim // 8, in_dim // 32
    g = g.reshape(groups, nb, -1)

    def scales(lo: int) -> np.ndarray:  # [G, nb, 8] f16 at byte lo -> [G, 8, nb, 1] fp32
        return (
            np.ascontiguousarray(g[..., lo : lo + 16]).view(np.float16).astype(np.float32).transpose(0, 2, 1)[..., None]
        )

    d = scales(0)
    if qtype == 8:
        q = g[..., 16:].view(np.int8).reshape(groups, nb, 8, 8, 4).transpose(0, 3, 1, 2, 4).reshape(groups, 8, nb, 32)
        return np.ascontiguousarray((q.astype(np.float32) * d).reshape(out_dim, in_dim))
    at = 32 if qtype in (3, 7) else 16
    p = g[..., at : at + 128].reshape(groups, nb, 4, 8, 4).transpose(0, 3, 1, 2, 4).reshape(groups, 8, nb, 16)
    idx = np.concatenate([p & 15, p >> 4], axis=-1)  # [G, o, nb, 32]
    if qtype == 20:
        return np.ascontiguousarray((IQ4NL_VALUES[idx].astype(np.float32) * d).reshape(out_dim, in_dim))
    if qtype in (6, 7):  # byte (o, i) of the fifth bits: bit b is input 4 b + i's
        hb = g[..., at + 128 : at + 160].reshape(groups, nb, 8, 1, 4)
        high = ((hb >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(groups, nb, 8, 32).transpose(0, 2, 1, 3)
        idx = idx | (high << 4)
    m = scales(16) if qtype in (3, 7) else d * np.float32(-16 if qtype == 6 else -8)
    return np.ascontiguousarray((idx.astype(np.float32) * d + m).reshape(out_dim, in_dim))


@dataclass(frozen=True)
class Format:
    """One GGUF weight format the kernels read in its file's own bytes, as a row of ggml's
    `type_traits`: its GGML id and name, its block in the file, the kernel's format id (quant.h's
    TLQ_*) and bytes per group of 8 outputs x 32 inputs (the superblock formats: on average), and
    the numpy reference of the repack (`tl_repack`) and of the dequantization the tests check the C
    code against. The C side exports the same rows (`tl_formats`); tests/kernels/test_formats.py
    checks that the two tables agree and that every prose list of formats is `format_names()`."""

    ggml_id: int
    name: str
    block_weights: int  # inputs per block in the file: 32, or a K-quant superblock's 256
    file_bytes: int  # bytes per block in the file
    kernel_id: int
    group_bytes: int
    repack: Callable[[np.ndarray, int, int], np.ndarray]  # (the file's blocks, out, in) -> the kernel's groups
    dequantize: Callable[[np.ndarray, int, int], np.ndarray]  # (the kernel's groups, out, in) -> float32 [out, in]

    @property
    def superblock(self) -> bool:
        """Read against ggml's Q8_K activations (one scale per 256 inputs: the K-quants' tile)."""
        return self.kernel_id in (_Q4K, _Q5K, _Q6K)


FORMATS: tuple[Format, ...] = (
    Format(2, "Q4_0", 32, 18, _Q40X8, 144, partial(_repack_blocks, 2), partial(_dequantize_blocks, 2)),
    Format(3, "Q4_1", 32, 20, _Q4X8, 160, partial(_repack_blocks, 3), partial(_dequantize_blocks, 3)),
    Format(6, "Q5_0", 32, 22, _Q50X8, 176, partial(_repack_blocks, 6), partial(_dequantize_blocks, 6)),
    Format(7, "Q5_1", 32, 24, _Q51X8, 192, partial(_repack_blocks, 7), partial(_dequantize_blocks, 7)),
    Format(8, "Q8_0", 32, 34, _Q8X8, 272, partial(_repack_blocks, 8), partial(_dequantize_blocks, 8)),
    Format(10, "Q2_K", 256, 84, _Q2K, 84, _repack_q2k, _dequantize_q2k),
    Format(11, "Q3_K", 256, 110, _Q3K, 110, _repack_q3k, _dequantize_q3k),
    Format(12, "Q4_K", 256, 144, _Q4K, 144, partial(_repack_k, 12), partial(_dequantize_k, _Q4K)),
    Format(13, "Q5_K", 256, 176, _Q5K, 176, partial(_repack_k, 13), partial(_dequantize_k, _Q5K)),
    Format(14, "Q6_K", 256, 210, _Q6K, 210, partial(_repack_k, 14), partial(_dequantize_k, _Q6K)),
    Format(20, "IQ4_NL", 32, 18, _IQ4NL, 144, partial(_repack_blocks, 20), partial(_dequantize_blocks, 20)),
    Format(23, "IQ4_XS", 256, 136, _IQ4XS, 136, _repack_iq4xs, _dequantize_iq4xs),
)
BY_GGML: dict[int, Format] = {f.ggml_id: f for f in FORMATS}
BY_KERNEL: dict[int, Format] = {f.kernel_id: f for f in FORMATS}


def format_names(sep: str = ", ") -> str:
    """The formats the kernels read, in the table's order: the one list README, the docs and the
    command line's help print."""
    return sep.join(f.name for f in FORMATS)


def _weight_buffer(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised uint8 tensor for weights: from 2 MB on, on transparent huge pages
    (`memory.huge_page_tensor`: a 1B file's weights 574 -> 782 MB on huge pages, decode 1.04x);
    smaller ones from numpy's allocator."""
    buffer = huge_page_tensor(shape)
    return buffer if buffer is not None else torch.from_numpy(np.empty(shape, dtype=np.uint8))


def _distinct(types: tuple[int, ...]) -> tuple[int, ...]:
    """A stack's part types, kept only when they differ (QuantWeight.types)."""
    return types if len(set(types)) > 1 else ()


@dataclass(frozen=True)
class QuantWeight:
    """A GGUF-quantized `[out, in]` weight (GGML type `qtype`, a row of `FORMATS`) in the kernels'
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
        for t in (self.qtype, self.qtype2) if self.split else (self.qtype,):
            if t not in BY_GGML:
                raise ValueError(f"unsupported GGML quantization type {t} (the kernels read {format_names()})")
        nb = self.in_dim // 32
        if self.split:
            first, second = BY_GGML[self.qtype], BY_GGML[self.qtype2]
            if self.split % 8 or not 0 < self.split < self.out_dim or first.kernel_id == second.kernel_id:
                raise ValueError(f"bad stack split {self.split} of {self.out_dim} outputs ({self.name})")
            fit = self.data.dim() == 1 and self.data.numel() == nb * (
                self.split // 8 * first.group_bytes + (self.out_dim - self.split) // 8 * second.group_bytes)
        else:
            fit = tuple(self.data.shape) == (self.out_dim // 8, nb * BY_GGML[self.qtype].group_bytes)
        if self.in_dim % 32 or self.out_dim % 8 or self.data.dtype != torch.uint8 or not fit:
            raise ValueError(
                f"quantized weight data {tuple(self.data.shape)} {self.data.dtype} "
                f"does not fit [{self.out_dim}, {self.in_dim}] {self.name}"
            )

    @classmethod
    def fits(cls, qtype: int, out_dim: int, in_dim: int) -> bool:
        return qtype in BY_GGML and out_dim % 8 == 0 and in_dim % BY_GGML[qtype].block_weights == 0

    @classmethod
    def from_blocks(cls, raw: np.ndarray | torch.Tensor, qtype: int, out_dim: int, in_dim: int) -> QuantWeight:
        """From a GGUF tensor's bytes, `[out, in/32 * block bytes]` uint8 (rows = outputs)."""
        if not cls.fits(qtype, out_dim, in_dim):
            raise ValueError(
                f"cannot keep [{out_dim}, {in_dim}] of GGML type {qtype} quantized "
                f"({format_names('/')}, out % 8, in % 32 (256 for K-quants))"
            )
        raw = np.ascontiguousarray(raw.numpy() if isinstance(raw, torch.Tensor) else raw, dtype=np.uint8)
        fmt = BY_GGML[qtype]
        if raw.size != out_dim * in_dim // fmt.block_weights * fmt.file_bytes:
            raise ValueError(f"{raw.size} bytes are not a [{out_dim}, {in_dim}] {fmt.name} tensor")
        loaded = load_library()
        if loaded is None:
            return cls(torch.from_numpy(fmt.repack(raw, out_dim, in_dim)), qtype, out_dim, in_dim)
        data = _weight_buffer((out_dim // 8, in_dim // 32 * fmt.group_bytes))
        if loaded.lib.tl_repack(raw.ctypes.data, data.data_ptr(), qtype, out_dim, in_dim) != 0:
            raise ValueError(f"tl_repack refused [{out_dim}, {in_dim}] {fmt.name}")
        return cls(data, qtype, out_dim, in_dim)

    @classmethod
    def from_blocks_numpy(cls, raw: np.ndarray, qtype: int, out_dim: int, in_dim: int) -> QuantWeight:
        """`from_blocks` through numpy (the reference the C repack is tested against)."""
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        return cls(torch.from_numpy(BY_GGML[qtype].repack(raw, out_dim, in_dim)), qtype, out_dim, in_dim)

    @property
    def name(self) -> str:
        return "+".join(dict.fromkeys(BY_GGML[t].name for t in self.types or (self.qtype,)))

    @property
    def format(self) -> int:
        """The kernels' format (quant.h), a TLQ_STACK of two for a stack."""
        if self.split:
            return BY_GGML[self.qtype].kernel_id | BY_GGML[self.qtype2].kernel_id << 4 | (self.split // 8) << 8
        return BY_GGML[self.qtype].kernel_id

    def parts(self) -> list[QuantWeight]:
        """A stack's two single-format weights (views of `data`); [self] otherwise."""
        if not self.split:
            return [self]
        head = self.split // 8 * (self.in_dim // 32) * BY_GGML[self.qtype].group_bytes
        a, b = self.data[:head], self.data[head:]
        types = self.types or (self.qtype, self.qtype2)
        n_a = next(i for i, t in enumerate(types) if BY_GGML[t].kernel_id != BY_GGML[self.qtype].kernel_id)
        return [
            QuantWeight(a.view(self.split // 8, -1), self.qtype, self.split, self.in_dim, _distinct(types[:n_a])),
            QuantWeight(
                b.view((self.out_dim - self.split) // 8, -1),
                self.qtype2,
                self.out_dim - self.split,
                self.in_dim,
                _distinct(types[n_a:]),
            ),
        ]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Stack weights of one input width along the outputs (a fused QKV, gate+up) in one or two
        runs of a kernel format: a Q4_K Q and K with a Q6_K V (Llama's Q4_K_M files) or a Q5_0 Q
        and K with a Q8_0 V (Qwen2.5-0.5B's, Gemma 3's) are a stack of two."""
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
        return QuantWeight(
            data, parts[0].qtype, out_dim, in_dim, _distinct(types), split=split, qtype2=parts[runs[0]].qtype
        )

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 `[n, in]`: the dequantized rows `ids` (an embedding lookup in a quantized token
        table, as llama.cpp's get_rows: only the groups of 8 rows that hold them are decoded)."""
        if self.split:
            raise ValueError("row lookups read single-format weights")
        ids = ids.reshape(-1).long().contiguous()
        if int(ids.min()) < 0 or int(ids.max()) >= self.out_dim:
            raise IndexError(f"row ids must be in [0, {self.out_dim})")
        loaded = load_library()
        if loaded is not None:
            out = torch.empty(ids.numel(), self.in_dim, dtype=torch.float32)
            loaded.lib.tl_quant_rows(
                self.data.data_ptr(), self.format, self.in_dim, ids.data_ptr(), ids.numel(), out.data_ptr()
            )
            return out
        groups, inverse = torch.unique(torch.div(ids, 8, rounding_mode="floor"), return_inverse=True)
        sub = QuantWeight(self.data[groups].contiguous(), self.qtype, 8 * int(groups.numel()), self.in_dim, self.types)
        return sub.dequantize().view(-1, 8, self.in_dim)[inverse, ids % 8]

    def dequantize(self) -> torch.Tensor:
        """float32 `[out, in]`: the values the kernels multiply by (the file's, exactly)."""
        if self.split:
            return torch.cat([part.dequantize() for part in self.parts()])
        return torch.from_numpy(BY_GGML[self.qtype].dequantize(self.data.numpy(), self.out_dim, self.in_dim))
