"""Building and binding the kernels: the CPU's flags pick a source (`kernels.c` for AVX-512,
`kernels_avx2.c` for AVX2 + FMA), the system C compiler builds it once into the user cache
(`-march=native`, keyed by the sources, the flags, the compiler and the CPU's feature flags; the
source and `quant_k.c`, the K-quants' groups functions, compile at once, one a core, and link;
`TOKENLEAP_KERNEL_MARCH` builds another CPU's code instead, for benchmarks: see `kernel_march`),
and `bind` declares the C signature of every entry point for ctypes (the kernels' ABI);
`load_library` does all three once per process and starts the kernels' thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from tokenleap.paths import cache_dir

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
_SOURCES = {"avx512": _DIR / "kernels.c", "avx2": _DIR / "kernels_avx2.c"}
_HEADERS = sorted(_DIR.glob("*.h"))  # every header is part of every build
# the K-quants' groups functions: a unit of their own beside the variant's source (quant.h's TLQ_UNIT),
# so the two compile at once, one a core
_K_UNIT = _DIR / "quant_k.c"
# what each variant's source defines before it includes quant.h, for quant_k.c (a unit that
# disagrees on VNNI fails to link: quant.h's TLQ_UNITS_VNNI)
_K_DEFINES = {"avx512": ["-DTLQ_ALLOW_VNNI=1"], "avx2": []}
# -ffp-contract=off: a scalar a*b+c must not become an FMA in one inlined tile and stay a
# multiply-add in another (the row-invariance contract); FMAs are written as intrinsics.
_FLAGS = ["-O3", "-ffp-contract=off", "-pthread", "-shared", "-fPIC", "-std=gnu11"]
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


def kernel_march() -> str:
    """The build's -march: "native", or `TOKENLEAP_KERNEL_MARCH` (a GCC CPU name such as "znver3"
    or "skylake") to run that CPU's code on this one: on an AVX-512 host, `TOKENLEAP_KERNELS=avx2
    TOKENLEAP_KERNEL_MARCH=znver3` measures the instruction stream a Zen 3 host compiles (16
    vector registers, no VNNI) instead of an AVX2 build that may use AVX-512's registers and
    AVX-VNNI. It must name a CPU whose instructions this one has (else the kernels die on an
    illegal instruction), e.g. "znver3", "skylake", "x86-64-v3". Raises ValueError for anything
    but such a name (a flag, a path, two words)."""
    march = os.environ.get("TOKENLEAP_KERNEL_MARCH", "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", march):
        raise ValueError(f"TOKENLEAP_KERNEL_MARCH={march!r} is not a CPU name (e.g. znver3, skylake, native)")
    return march


def kernel_flags(march: str | None = None) -> list[str]:
    """A kernel build's compiler flags for `march` (default: kernel_march())."""
    return [f"-march={march or kernel_march()}", *_FLAGS]


KERNEL_CACHE_KEEP = 4  # builds of a variant kept beside the one in use (the most recently used)


def prune_kernel_cache(folder: Path, variant: str, keep: Path, limit: int = KERNEL_CACHE_KEEP) -> list[Path]:
    """Remove all but the `limit` most recently used builds of `variant` in `folder` (every
    other tokenleap version or CPU leaves one behind); `keep` stays. A process that has a removed
    build loaded keeps it (the file is only unlinked). Returns what was removed."""
    builds = [f for f in folder.glob(f"tokenleap_kernels_{variant}_*.so") if f != keep]
    builds.sort(key=lambda f: f.stat().st_mtime, reverse=True)
    removed = builds[limit:]
    for f in removed:
        f.unlink(missing_ok=True)
    return removed


def _run_all(commands: list[list[str]]) -> None:
    """Run the commands at once and wait for all; the first that failed raises
    CalledProcessError with its output (as subprocess.run(check=True) would)."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    results = [(c, p, *p.communicate()) for c, p in zip(commands, procs)]
    for command, proc, out, err in results:
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, command, out, err)


def library_path(compiler: str, variant: str, flags: frozenset[str], march: str = "native") -> Path:
    """Where the build of `variant` for `march` lives in the cache: keyed by the sources, the
    build's flags, the compiler and the CPU's feature flags."""
    parts = [_SOURCES[variant].read_bytes(), _K_UNIT.read_bytes(), *(h.read_bytes() for h in _HEADERS),
             " ".join(kernel_flags(march)).encode(), compiler.encode()]
    parts.append(" ".join(sorted(flags)).encode())  # -march=native: a build for one CPU is no build for another
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return cache_dir() / "kernels" / f"tokenleap_kernels_{variant}_{digest}.so"


def build_library(compiler: str, variant: str, flags: frozenset[str], march: str = "native") -> Path:
    source = _SOURCES[variant]
    build_flags = kernel_flags(march)
    target = library_path(compiler, variant, flags, march)
    if target.exists():
        try:
            os.utime(target)  # most recently used (prune_kernel_cache keeps those)
        except OSError:  # a read-only cache
            pass
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_out = Path(tmp) / target.name
        compile_flags = [f for f in build_flags if f != "-shared"]
        objects = [Path(tmp) / "main.o", Path(tmp) / "quant_k.o"]
        _run_all(
            [
                [compiler, *compile_flags, "-DTLQ_UNIT=1", "-c", str(source), "-o", str(objects[0])],
                [compiler, *compile_flags, *_K_DEFINES[variant], "-c", str(_K_UNIT), "-o", str(objects[1])],
            ]
        )
        _run_all([[compiler, "-shared", "-pthread", *map(str, objects), "-o", str(tmp_out), "-lm"]])
        os.replace(tmp_out, target)  # atomic: concurrent processes never see half a file
    try:
        prune_kernel_cache(target.parent, variant, target)
    except OSError:  # pruning only saves space
        pass
    return target



def bind(lib: ctypes.CDLL) -> tuple[bool, bool]:
    """Declare the argument and result types of the library's entry points; returns whether it
    has `tl_linear_packed` (packed bf16 weights) and attention over the blocked bf16 and q8_0 KV
    caches (`tl_attention_run` with a blocked `tl_attn_desc`)."""
    lib.tl_linear.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int]
    lib.tl_linear.restype = None
    lib.tl_attention_run.argtypes = [_ptr, _ptr, _i64, _ptr]
    lib.tl_attention_run.restype = ctypes.c_int
    lib.tl_abi_layout.argtypes = [_ptr]
    lib.tl_abi_layout.restype = _i64
    lib.tl_rmsnorm.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float]
    lib.tl_rmsnorm.restype = None
    lib.tl_silu_mul.argtypes = [_ptr, _ptr, _i64, _i64]
    lib.tl_silu_mul.restype = None
    if hasattr(lib, "tl_gelu_mul"):  # not in the kernels before 2026-11-27 (kernel_ab.py builds those)
        lib.tl_gelu_mul.argtypes = [_ptr, _ptr, _i64, _i64]
        lib.tl_gelu_mul.restype = None
    lib.tl_head_norm.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, ctypes.c_float, ctypes.c_float]
    lib.tl_head_norm.restype = None
    lib.tl_rmsnorm_add.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float]
    lib.tl_rmsnorm_add.restype = None
    lib.tl_init.argtypes = [ctypes.c_int]
    lib.tl_init.restype = ctypes.c_int
    lib.tl_linear_q.argtypes = [
        _ptr, _ptr, ctypes.c_float, ctypes.c_int, _ptr, _ptr, ctypes.c_int, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int
    ]
    lib.tl_linear_q.restype = None
    lib.tl_quant_vnni.argtypes = [ctypes.c_int]
    lib.tl_quant_vnni.restype = ctypes.c_int
    if hasattr(lib, "tl_quant_pair"):  # not in the kernels before 2026-11-26 (benchmarks/kernel_ab.py builds those)
        lib.tl_quant_pair.argtypes = [ctypes.c_int]
        lib.tl_quant_pair.restype = ctypes.c_int
    if hasattr(lib, "tl_quant_xb"):  # not before 2026-11-28 (session 29)
        lib.tl_quant_xb.argtypes = [ctypes.c_int]
        lib.tl_quant_xb.restype = ctypes.c_int
    lib.tl_formats.argtypes = [_ptr, ctypes.c_int]
    lib.tl_formats.restype = ctypes.c_int
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
    return packed, bf16_attention


@dataclass(frozen=True)
class Library:
    """The loaded kernels: the library, its thread pool's size and what this build offers."""

    lib: ctypes.CDLL
    threads: int
    packed: bool  # tl_linear_packed (packed bf16 weights)
    bf16_attention: bool  # attention over blocked bf16 / q8_0 KV caches
    variant: str  # "avx512" (kernels.c) or "avx2" (kernels_avx2.c)
    march: str = "native"  # the build's -march (kernel_march)


@lru_cache(maxsize=1)
def load_library() -> Library | None:
    """Compile (once, cached on disk), load and bind the kernels and start their thread pool;
    None when this machine can't (`kernels.load_kernels` wraps it in the API)."""
    if os.environ.get("TOKENLEAP_NO_KERNELS"):
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    flags = cpu_flags()
    variant = kernel_variant(flags)
    if not compiler or variant is None:
        logger.warning(
            "no C compiler, or a CPU without AVX-512 or AVX2+FMA: using torch kernels (slower, not row-invariant)"
        )
        return None
    try:
        march = kernel_march()
        lib = ctypes.CDLL(str(build_library(compiler, variant, flags, march)))
    except (OSError, ValueError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        logger.warning("could not build tokenleap kernels, using torch: %s", detail.strip()[:500])
        return None
    packed, bf16_attention = bind(lib)
    threads = lib.tl_init(torch.get_num_threads())  # the kernels' own thread pool (see pool.h)
    logger.info("tokenleap kernels: %s variant, -march=%s, %d threads", variant, march, threads)
    return Library(lib, threads, packed, bf16_attention, variant, march)
