"""Row-invariant CPU kernels (linear and per-row attention), compiled on first use.

Measured on the project machine, torch's own bf16 `linear` streams weights at ~10 GB/s of the
~31 GB/s the memory gives, and its fp32 GEMM rounds a row differently depending on how many
rows share the call. `kernels.c` computes each output element with one fixed instruction
sequence (AVX-512, fp32 accumulation), streams the weights once for all rows, and so is both
faster and exact for speculative verification. It is compiled with the system C compiler into
the user cache and loaded with ctypes; when no compiler or no AVX-512 is present the model falls
back to torch ops (correct, slower, and not guaranteed row-invariant).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from tokenleap.paths import cache_dir

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("kernels.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


def _cpu_has_avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512f " in flags.replace("\n", " ") + " "


def _compile(compiler: str) -> Path:
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode() + compiler.encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"tokenleap_kernels_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_out = Path(tmp) / target.name
        subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", str(tmp_out), "-lm"],
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


@dataclass(frozen=True)
class CpuKernels:
    lib: ctypes.CDLL
    threads: int
    packed: bool = True  # whether tl_linear_packed (AVX512-BF16) is available

    @staticmethod
    def supports(*widths_then_head_dim: int) -> bool:
        """Whether linear input widths (multiples of 32) and head_dim (16, 32, 64 or 128) fit the kernels."""
        *widths, head_dim = widths_then_head_dim
        return all(w % 32 == 0 for w in widths) and head_dim in (16, 32, 64, 128)

    def pack(self, weight: torch.Tensor) -> PackedWeight | None:
        """The packed form of `weight` when the packed kernel can use it, else None."""
        return PackedWeight.pack(weight) if self.packed and PackedWeight.fits(weight) else None

    def linear(self, x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ weight.T + bias` with x fp32 `[rows, in]`, weight bf16/fp32 `[out, in]` or packed."""
        if isinstance(weight, PackedWeight):
            return self._linear_packed(x, weight, bias)
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
        scratch = torch.empty(rows * in_dim if weight.dtype == torch.bfloat16 else 0, dtype=torch.float32)
        self.lib.tl_linear(
            x.data_ptr(),
            weight.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            y.data_ptr(),
            scratch.data_ptr(),
            rows,
            in_dim,
            out_dim,
            16 if weight.dtype == torch.bfloat16 else 32,
            self.threads,
        )
        return y

    def _linear_packed(self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        rows, in_dim = x.shape
        if in_dim != weight.in_dim or x.dtype != torch.float32:
            raise ValueError(f"kernel linear: x {tuple(x.shape)} {x.dtype} does not fit packed weight [{weight.out_dim}, {weight.in_dim}]")
        if bias is not None:
            bias = bias.float().contiguous()
        x = x.contiguous()
        y = torch.empty(rows, weight.out_dim, dtype=torch.float32)
        scratch = torch.empty(rows * in_dim, dtype=torch.bfloat16)
        self.lib.tl_linear_packed(
            x.data_ptr(),
            weight.data.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            y.data_ptr(),
            scratch.data_ptr(),
            rows,
            in_dim,
            weight.out_dim,
            self.threads,
        )
        return y

    def attention(
        self,
        q: torch.Tensor,  # [rows, heads, hd] fp32
        keys: torch.Tensor,  # [kv_heads, cap, hd] fp32 (a layer of the cache)
        values: torch.Tensor,
        slot_end: torch.Tensor | None,  # [rows] int64: row r sees slots 0..slot_end[r]-1
        slot_off: torch.Tensor | None,  # [rows + 1] int64 offsets into slot_idx
        slot_idx: torch.Tensor | None,  # [total] int64 slot indices (tree rows)
        max_slots: int,
    ) -> torch.Tensor:  # [rows, heads * hd]
        rows, heads, hd = q.shape
        kv_heads, cap, _ = keys.shape
        if hd not in (16, 32, 64, 128) or heads % kv_heads or keys.dtype != torch.float32 or q.dtype != torch.float32:
            raise ValueError(f"kernel attention: unsupported q {tuple(q.shape)} {q.dtype}, keys {tuple(keys.shape)} {keys.dtype}")
        if keys.stride() != (cap * hd, hd, 1) or values.stride() != keys.stride():
            raise ValueError("kernel attention: keys/values must be a contiguous cache layer [kv_heads, cap, hd]")
        q = q.contiguous()
        out = torch.empty(rows, heads * hd, dtype=torch.float32)
        max_slots = -(-max(max_slots, 1) // 16) * 16  # the kernel writes scores 16 at a time
        scratch = torch.empty(self.threads * 4 * max_slots, dtype=torch.float32)
        self.lib.tl_attention(
            q.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            out.data_ptr(),
            rows,
            heads,
            kv_heads,
            hd,
            cap,
            slot_end.data_ptr() if slot_end is not None else None,
            slot_off.data_ptr() if slot_off is not None else None,
            slot_idx.data_ptr() if slot_idx is not None else None,
            scratch.data_ptr(),
            max_slots,
            self.threads,
        )
        return out


@lru_cache(maxsize=1)
def load_kernels() -> CpuKernels | None:
    """Compile (once, cached on disk) and load the kernels; None when this machine can't."""
    if os.environ.get("TOKENLEAP_NO_KERNELS"):
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler or not _cpu_has_avx512():
        logger.warning("no C compiler or no AVX-512: using torch kernels (slower, not row-invariant)")
        return None
    try:
        lib = ctypes.CDLL(str(_compile(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        logger.warning("could not build tokenleap kernels, using torch: %s", detail.strip()[:500])
        return None
    lib.tl_linear.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int, ctypes.c_int]
    lib.tl_linear.restype = None
    lib.tl_attention.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, ctypes.c_int]
    lib.tl_attention.restype = None
    packed = bool(lib.tl_has_bf16_dot())
    if packed:
        lib.tl_linear_packed.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int]
        lib.tl_linear_packed.restype = None
    return CpuKernels(lib=lib, threads=torch.get_num_threads(), packed=packed)
