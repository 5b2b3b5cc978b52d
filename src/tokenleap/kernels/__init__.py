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
registers); the CPU's flags pick one at run time, the system C compiler builds it and ctypes
loads it (`build.py`); when no compiler or neither instruction set is present the model falls
back to torch ops (correct, slower, and not row-invariant: greedy speculation may then drift
from plain decoding). The weight formats are in `formats.py`, a model's weight matrix as one value
(`Linear`: dense, packed or quantized) in `linear.py`, the fused layer loop in `fused.py`; this
module is the API: `CpuKernels` (linears, norms, attention) and `load_kernels`.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from tokenleap.kernels.abi import ATTN_FP32, GLU_GELU_TANH, GLU_KINDS, AttnDesc
from tokenleap.kernels.build import cpu_flags, kernel_variant, load_library
from tokenleap.kernels.formats import FORMATS, Format, PackedWeight, QuantWeight, format_names
from tokenleap.kernels.linear import Linear, LinearWeight

logger = logging.getLogger(__name__)

__all__ = [
    "FORMATS", "KV_BF16", "KV_Q8_0", "AttentionWork", "CpuKernels", "Format", "Linear", "LinearWeight", "PackedWeight",
    "QuantWeight", "RowPlan", "cpu_flags", "format_names", "kernel_variant", "kv_slot_bytes", "load_kernels"
]

# The blocked KV caches' formats (attn16.h's TL_KV_*): bf16, or ggml's q8_0 (32 int8 values and
# one fp16 scale per 32 dims of a slot)
KV_BF16 = 0
KV_Q8_0 = 1


def kv_slot_bytes(kv_type: int, head_dim: int) -> int:
    """Bytes one slot of one kv head takes in a blocked cache of this format."""
    return head_dim + head_dim // 16 if kv_type == KV_Q8_0 else 2 * head_dim


@dataclass(frozen=True)
class CpuKernels:
    lib: ctypes.CDLL
    threads: int
    packed: bool = True  # whether tl_linear_packed (packed bf16 weights) is available
    bf16_attention: bool = True  # whether tl_attention_bf16 (blocked bf16 KV cache) is available
    variant: str = "avx512"  # which source: "avx512" (kernels.c) or "avx2" (kernels_avx2.c)
    march: str = "native"  # the build's -march (build.kernel_march: another CPU's code, for benchmarks)
    # each calling thread's scratch buffer for the linears (int8 / bf16 copies of the input),
    # reused across calls: a fresh torch.empty per call cost ~2.7 us of a ~12 us small linear
    _local: threading.local = field(default_factory=threading.local, repr=False, compare=False)

    def _scratch(self, nbytes: int) -> int:
        """The address of this thread's scratch buffer, at least `nbytes` long (grown as needed).
        Only the C call in progress on this thread reads or writes it."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.buf = torch.empty(
                max(nbytes, 1 << 16, 2 * (buf.numel() if buf is not None else 0)), dtype=torch.uint8
            )
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

    def prepare(self, weight: torch.Tensor) -> Linear:
        """A dense `[out, in]` weight as these kernels read it best: packed where they can, else as is."""
        packed = self.pack(weight)
        return Linear(packed if packed is not None else weight)

    def linear(
        self,
        x: torch.Tensor,
        weight: Linear | LinearWeight,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        *,
        norm: tuple[torch.Tensor, float] | None = None,
        glu: str | None = None,
    ) -> torch.Tensor:
        """`x @ weight.T + bias` with x fp32 `[rows, in]`, weight a `Linear` (or the form it holds:
        bf16/fp32 `[out, in]`, packed or quantized). With `out` (contiguous fp32 `[rows, out]`), the
        result is added to it in place. The input may be formed first, the same bits either way
        (quantized weights fuse it into their call): `norm=(w, eps)` RMSNorms x; `glu` ("silu" or
        "gelu_tanh") takes x = (gate | up) `[rows, 2 in]` and uses `act(gate) * up` (`glu_mul`)."""
        if isinstance(weight, Linear):
            weight = weight.weight
        if isinstance(weight, QuantWeight):
            return self._linear_quant(x, weight, bias, out, norm, glu)
        if glu is not None:
            x = self.glu_mul(x, glu)
        elif norm is not None:
            x = self.rmsnorm(x, norm[0], norm[1])
        if isinstance(weight, PackedWeight):
            return self._linear_packed(x, weight, bias, out)
        if out is not None:
            return out.add_(self.linear(x, weight, bias))
        rows, in_dim = x.shape
        out_dim = weight.shape[0]
        if in_dim % 32 or weight.shape[1] != in_dim or weight.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(
                f"kernel linear: unsupported shapes/dtype x {tuple(x.shape)}, w {tuple(weight.shape)} {weight.dtype}"
            )
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
            raise ValueError(
                f"kernel linear: x {tuple(x.shape)} {x.dtype} "
                f"does not fit packed weight [{weight.out_dim}, {weight.in_dim}]"
            )
        if out is not None and (
            out.shape != (rows, weight.out_dim) or out.dtype != torch.float32 or not out.is_contiguous()
        ):
            raise ValueError(
                f"kernel linear: out {tuple(out.shape)} must be contiguous float32 [{rows}, {weight.out_dim}]"
            )
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
        switch (None: as cpuid says); True only on the AVX-512 variant of a CPU with AVX-512 VNNI
        or the AVX2 variant of one with AVX-VNNI (the same instruction VEX-encoded: Intel's
        AVX2-only client cores from Alder Lake on)."""
        return bool(self.lib.tl_quant_vnni(-1 if enable is None else int(enable)))

    def quant_pair_rows(self, rows: int | None = None) -> int:
        """From how many rows the K-quant and the 32-input Q4_0 / Q4_1 / Q5_0 / Q5_1 linears use
        the two-group tile (16 outputs a 512-bit vector, one activation broadcast for both groups;
        AVX-512 VNNI only; the same bits as the 8-output tile; the K-quants' also at any row count
        for 8,192+ inputs, as a down projection has): with `rows`, set it (0: never, at any
        size); returns the setting in force (0 where the build has no such tile)."""
        if not hasattr(self.lib, "tl_quant_pair"):
            return 0
        return int(self.lib.tl_quant_pair(-1 if rows is None else int(rows)))

    def quant_xb_rows(self, rows: int | None = None) -> int:
        """From how many rows (8 at a time past 8) the K-quant linears without VNNI (the AVX2
        variant, or the AVX-512 one with `quant_vnni(False)`) take the superblock-major tile, whose
        activations are broadcast once per superblock for a run of groups instead of once per
        group (the same bits as the group-major tile); in builds without VNNI Q4_0 and Q5_0 take
        their run-major tile from this and 6 rows: with `rows`, set it (0: never); returns
        the setting in force (0 where the build has no such tile)."""
        if not hasattr(self.lib, "tl_quant_xb"):
            return 0
        return int(self.lib.tl_quant_xb(-1 if rows is None else int(rows)))

    def _linear_quant(
        self,
        x: torch.Tensor,
        weight: QuantWeight,
        bias: torch.Tensor | None,
        out: torch.Tensor | None,
        norm: tuple[torch.Tensor, float] | None = None,
        glu: str | None = None,
    ) -> torch.Tensor:
        """`tl_linear_q`: each row of x (RMSNormed or gated first when asked) quantized to int8
        blocks of 32 with its own scale (of 256 for the K-quants: ggml's Q8_K), then exact
        integer block dot products with the weight's blocks (see quant.h)."""
        rows, in_dim = x.shape
        glu_kind = self._glu_kind(glu) if glu is not None else 0
        if glu_kind:
            in_dim //= 2
        if in_dim != weight.in_dim or x.dtype != torch.float32:
            raise ValueError(
                f"kernel linear: x {tuple(x.shape)} {x.dtype} "
                f"does not fit {weight.name} weight [{weight.out_dim}, {weight.in_dim}]"
            )
        if out is not None and (
            out.shape != (rows, weight.out_dim) or out.dtype != torch.float32 or not out.is_contiguous()
        ):
            raise ValueError(
                f"kernel linear: out {tuple(out.shape)} must be contiguous float32 [{rows}, {weight.out_dim}]"
            )
        if bias is not None:
            bias = bias.float().contiguous()
        x = x.contiguous()
        # int8 rows, block scales and sums, the formed fp32 input when fusing, then a second int8
        # copy for a stack of two formats or the K-quants' activations (see tl_linear_q)
        scratch = self._scratch(rows * in_dim * 7 + 8 * rows * (in_dim // 32))
        y = out if out is not None else torch.empty(rows, weight.out_dim, dtype=torch.float32)
        norm_w = norm[0].contiguous() if norm is not None and not glu_kind else None
        self.lib.tl_linear_q(
            x.data_ptr(),
            norm_w.data_ptr() if norm_w is not None else None,
            float(norm[1]) if norm is not None and norm_w is not None else 0.0,
            glu_kind,
            scratch,
            weight.data.data_ptr(),
            weight.format,
            bias.data_ptr() if bias is not None else None,
            y.data_ptr(),
            rows,
            in_dim,
            weight.out_dim,
            int(out is not None),
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
        return self.glu_mul(gate_up, "silu")

    def glu_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """`act(gate) * up` for fp32 `[rows, 2f]` = (gate | up), f a multiple of 16: SwiGLU's
        ("silu") or GeGLU's ("gelu_tanh", as g / (1 + exp(-2k)): within 2 ulp of torch's
        `gelu(approximate="tanh")`)."""
        kind = self._glu_kind(activation)
        rows, width = gate_up.shape
        if gate_up.dtype != torch.float32 or width % 32:
            raise ValueError(
                f"glu_mul: needs fp32 [rows, 2f] with f a multiple of 16, got {tuple(gate_up.shape)} {gate_up.dtype}"
            )
        y = torch.empty(rows, width // 2, dtype=torch.float32)
        fn = self.lib.tl_gelu_mul if kind == GLU_GELU_TANH else self.lib.tl_silu_mul
        fn(gate_up.contiguous().data_ptr(), y.data_ptr(), rows, width // 2)
        return y

    def _glu_kind(self, activation: str) -> int:
        """tl_linear_q's / forward.h's gate code (TL_GLU_*) for an activation name."""
        kind = GLU_KINDS.get(activation)
        if kind is None:
            raise ValueError(f"unknown MLP gate {activation!r} (the kernels have {', '.join(GLU_KINDS)})")
        if kind == GLU_GELU_TANH and not hasattr(self.lib, "tl_gelu_mul"):
            raise ValueError("these kernels have no tl_gelu_mul")
        return kind

    def attention_head_dims(self, blocked: bool, kv_type: int = KV_BF16) -> tuple[int, ...]:
        """Head dims the fused attention serves: 16..128 over fp32 caches; with blocked bf16
        caches also 256 (Gemma 3), whose P.V runs in two 128-wide halves; q8_0 caches (32-value
        blocks) 32..256."""
        if not (blocked and self.bf16_attention):
            return (16, 32, 64, 128)
        return (32, 64, 128, 256) if kv_type == KV_Q8_0 else (16, 32, 64, 128, 256)

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
        # _work: its buffers, alive for the call
        desc, _work = self.attention_desc(plan, heads, kv_heads, head_dim, cos, sin)
        if self.lib.tl_attention_run(ctypes.byref(desc), qkv.data_ptr(), layer, out.data_ptr()) != 0:
            raise ValueError("kernel attention: this build lacks the kernel these caches need")
        return out

    def attention_desc(
        self, plan: RowPlan, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[AttnDesc, AttentionWork]:
        """The attention's C struct (`tl_attn_desc`) for a forward over `plan`, and the work
        buffers it points at (keep them alive while the struct is used)."""
        work = self.attention_work(plan, heads, kv_heads, head_dim)

        def addr(t: torch.Tensor | None) -> int | None:
            return t.data_ptr() if t is not None else None

        desc = AttnDesc(
            kv=1 + plan.kv_type if plan.blocked else ATTN_FP32,
            rows=plan.rows,
            heads=heads,
            kv_heads=kv_heads,
            hd=head_dim,
            pos=plan.positions.data_ptr(),
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            kv_base=plan.kv_base.data_ptr(),
            cap=plan.capacity.data_ptr(),
            wslot=plan.write_slot.data_ptr(),
            qbuf=work.q.data_ptr(),
            slot_end=addr(plan.slot_end),
            slot_off=addr(plan.slot_off),
            slot_idx=addr(plan.slot_idx),
            slot_lo=addr(plan.slot_lo),
            chunk=addr(work.chunk),
            scratch=work.scratch.data_ptr(),
            max_slots=plan.max_slots,
        )
        if work.mask is not None:  # a token tree over blocked caches (mask_start is set with the mask: plan_rows)
            desc.mask_start, desc.mask, desc.mask_w = addr(plan.mask_start), work.mask.data_ptr(), work.mask.shape[1]
            desc.tail, desc.tail_slots = addr(work.tail), work.tail_slots
        return desc, work

    def attention_work(self, plan: RowPlan, heads: int, kv_heads: int, head_dim: int) -> AttentionWork:
        """The attention kernel's buffers for a forward over `plan`, made by its first layer and
        kept in `plan.work` for the others. Over blocked bf16 caches (`tl_attention_bf16`) the
        queries are rounded to bf16 pairs into the query buffer, rows of one sequence attend
        together (`chunk`), and tree rows read their own path from `tail`."""
        if head_dim not in self.attention_head_dims(plan.blocked, plan.kv_type) or heads % kv_heads:
            raise ValueError(f"kernel attention: unsupported heads {heads}/{kv_heads} x {head_dim}")
        if plan.blocked and (not self.bf16_attention or plan.slot_end is None):
            raise ValueError("kernel attention: blocked bf16 caches need tl_attention_bf16 and slot_end")
        work, rows = plan.work, plan.rows
        if "q" not in work:  # the layers of one forward share the scratch buffers
            work["q"] = torch.empty(
                rows * heads * head_dim // (2 if plan.blocked else 1),
                dtype=torch.int32 if plan.blocked else torch.float32,
            )
            work["scratch"] = torch.empty(
                self.threads * (32 if plan.blocked else 4) * plan.max_slots, dtype=torch.float32
            )
        if not plan.blocked:
            return AttentionWork(work["q"], work["scratch"])
        if "chunk" not in work:
            work["chunk"] = torch.empty(rows + 1, dtype=torch.int64)
        mask = plan.mask.contiguous() if plan.mask is not None else None
        if mask is None:
            return AttentionWork(work["q"], work["scratch"], work["chunk"])
        tail_slots = -(-(15 + mask.shape[1]) // 16) * 16
        if "tail" not in work:  # zeroed once: slots past a path are read with probability 0
            work["tail"] = torch.zeros(
                rows * kv_heads * 2 * tail_slots * kv_slot_bytes(plan.kv_type, head_dim), dtype=torch.uint8
            )
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
    kv_type: int = 0  # blocked caches' format: KV_BF16 or KV_Q8_0 (attn16.h's TL_KV_*)
    work: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rows(self) -> int:
        return int(self.positions.shape[0])

@lru_cache(maxsize=1)
def load_kernels() -> CpuKernels | None:
    """Compile (once, cached on disk) and load the kernels; None when this machine can't."""
    loaded = load_library()
    if loaded is None:
        return None
    kernels = CpuKernels(
        lib=loaded.lib,
        threads=loaded.threads,
        packed=loaded.packed,
        bf16_attention=loaded.bf16_attention,
        variant=loaded.variant,
        march=loaded.march,
    )
    from tokenleap.kernels.tiles import choose_tiles  # it builds on this module's API

    try:
        choice = choose_tiles(kernels)
    except (RuntimeError, ValueError, OSError) as exc:  # a choice of speed only: keep the default tiles
        logger.warning("could not time the AVX2 many-row tiles (%s); keeping the default", exc)
        choice = None
    if choice is not None:
        logger.info(
            "AVX2 many-row tiles: buffered %.3f ms, group-major %.3f ms an 8-row call: %s",
            choice.buffered_ms,
            choice.group_major_ms,
            "buffered" if choice.xb_rows else "group-major",
        )
    return kernels
