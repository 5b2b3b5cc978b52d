"""The quantized linears of this checkout against another commit's, in one process on the same weights.

Builds the kernel sources of `--baseline` (a git revision: `git show REV:src/tokenleap/kernels/...`,
compiled with the flags `kernels/build.py` uses) beside the current ones, then for each GGUF type
and layer shape times one `CpuKernels.linear` call per distinct weight (enough weights to
overflow the caches, ~150 MB: cold, as a decode step streams them) at each row count, the two
builds alternating round by round (a busy moment hits both), fastest of `--rounds`. Prints
milliseconds per call and the current build's time relative to the baseline's; JSON to
`benchmarks/results/kernel_ab.json`.

    .venv/bin/python benchmarks/kernel_ab.py --baseline 1c9298b --types Q4_K,Q6_K --rows 1,5,8
    .venv/bin/python benchmarks/kernel_ab.py --baseline ff0b0b4 --shape qwen2.5-0.5b --types Q5_0,Q4_K --rows 1,8,128

`--without-tile xb` (or `pair`) compares this build with itself with that tile switched off
(`CpuKernels.quant_xb_rows(0)`, `quant_pair_rows(0)`) instead of with another revision (the
xb tiles from 4 rows, even where the load measured them slower and chose the group-major tile):

    TOKENLEAP_KERNELS=avx2 .venv/bin/python benchmarks/kernel_ab.py --without-tile xb --shape qwen2.5-1.5b --rows 4,8
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name, csv_of  # noqa: E402
from quant_bandwidth import random_blocks  # noqa: E402

from tokenleap.kernels import CpuKernels, QuantWeight, load_kernels  # noqa: E402
from tokenleap.kernels.build import bind, kernel_flags  # noqa: E402
from tokenleap.kernels.tiles import XB_FROM  # noqa: E402

# a layer's QKV, gate+up and down (the O projection is QKV's shape class), then the (tied) LM head
SHAPES = {"llama-3.2-3b": ((5120, 3072), (16384, 3072), (3072, 8192), (128256, 3072)),
          "llama-3.2-1b": ((3072, 2048), (16384, 2048), (2048, 8192), (128256, 2048)),
          # the real pair's layers (QKV, gate+up, down): Qwen2.5-Coder-1.5B / -0.5B
          "qwen2.5-1.5b": ((2048, 1536), (17920, 1536), (1536, 8960)),
          "qwen2.5-0.5b": ((1152, 896), (9728, 896), (896, 4864))}
KERNEL_DIR = "src/tokenleap/kernels"


def revision_sources(rev: str, workdir: Path) -> Path:
    """Revision `rev`'s kernel sources (.c / .h) written into `workdir`; returns it."""
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{KERNEL_DIR}"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith((".c", ".h")):
            blob = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{rev}:{KERNEL_DIR}/{name}"], check=True, capture_output=True
            ).stdout
            (workdir / name).write_bytes(blob)
    return workdir


def build_revision(rev: str, variant: str, workdir: Path) -> Path:
    """Compile revision `rev`'s kernel sources for `variant`; returns the shared library."""
    source = revision_sources(rev, workdir) / ("kernels.c" if variant == "avx512" else "kernels_avx2.c")
    out = workdir / f"baseline_{variant}.so"
    compiler = shutil.which("gcc") or shutil.which("cc") or "cc"
    subprocess.run(
        [compiler, *kernel_flags(), str(source), "-o", str(out), "-lm"], check=True, capture_output=True, text=True
    )
    return out


def load_library(path: Path, variant: str, threads: int) -> CpuKernels:
    lib = ctypes.CDLL(str(path))
    packed, bf16_attention = bind(lib)
    return CpuKernels(
        lib=lib, threads=lib.tl_init(threads), packed=packed, bf16_attention=bf16_attention, variant=variant
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="git revision whose kernels to compare against (e.g. HEAD~1)")
    ap.add_argument("--without-tile", choices=["xb", "pair"],
                    help="instead: this build with its superblock-major (xb) or two-group (pair) tile off")
    ap.add_argument("--types", type=csv_of(str), default="Q4_K,Q5_K,Q6_K")
    ap.add_argument("--rows", type=csv_of(int), default="1,5,8")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-3b")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--budget-mb", type=float, default=150.0, help="bytes of distinct weights per shape")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kernel_ab.json")
    args = ap.parse_args(argv)
    if (args.baseline is None) == (args.without_tile is None):
        ap.error("give one of --baseline REV and --without-tile TILE")
    current = load_kernels()
    if current is None:
        ap.error("no tokenleap kernels on this machine")
    for name in args.types:
        if name not in gguf.GGMLQuantizationType.__members__:
            ap.error(f"unknown GGUF type {name!r}")
    switch, loaded_setting = None, 0
    if args.without_tile:
        switch = current.quant_xb_rows if args.without_tile == "xb" else current.quant_pair_rows
        loaded_setting = switch()
        if args.without_tile == "xb" and not current.quant_vnni() and hasattr(current.lib, "tl_quant_xb"):
            switch(switch() or XB_FROM)  # where the load chose the group-major tile (kernels/tiles.py)
        if not switch():
            ap.error(f"this build has no {args.without_tile} tile in use (xb: kernels without VNNI, "
                     "e.g. TOKENLEAP_KERNELS=avx2; pair: AVX-512 VNNI)")
    tile_default = switch() if switch is not None else 0
    with tempfile.TemporaryDirectory() as tmp:
        if switch is None:
            try:
                baseline = load_library(
                    build_revision(args.baseline, current.variant, Path(tmp)), current.variant, current.threads
                )
            except subprocess.CalledProcessError as exc:
                ap.error(f"could not build the kernels of {args.baseline!r}: {(exc.stderr or '').strip()[:300]}")
        else:
            baseline = current
        builds = {"baseline": baseline, "current": current}
        settings = {"baseline": 0, "current": tile_default}
        result = {
            "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "variant": current.variant,
            "threads": current.threads, "vnni": current.quant_vnni(),
            "baseline": args.baseline or f"this build, {args.without_tile} tile off", "shape": args.shape,
            "ms": {}
        }
        print(
            f"{result['cpu']}, {current.variant} kernels, {current.threads} threads; baseline {result['baseline']}",
            flush=True,
        )
        rng = np.random.default_rng(0)
        for name in args.types:
            qtype = gguf.GGMLQuantizationType[name]
            for out_dim, in_dim in SHAPES[args.shape]:
                if in_dim % gguf.GGML_QUANT_SIZES[qtype][0]:
                    continue  # a K-quant over inputs that are no multiple of its 256 (Qwen2.5-0.5B's 896)
                first = QuantWeight.from_blocks(random_blocks(qtype, out_dim, in_dim, rng), int(qtype), out_dim, in_dim)
                copies = max(1, int(args.budget_mb * 1e6 // first.nbytes))
                weights = [first] + [
                    QuantWeight.from_blocks(random_blocks(qtype, out_dim, in_dim, rng), int(qtype), out_dim, in_dim)
                    for _ in range(copies - 1)
                ]
                for rows in args.rows:
                    x = torch.randn(rows, in_dim)
                    best = dict.fromkeys(builds, float("inf"))
                    for _ in range(args.rounds):
                        for label, kernels in builds.items():
                            if switch is not None:
                                switch(settings[label])
                            t0 = time.perf_counter()
                            for w in weights:
                                kernels.linear(x, w)
                            best[label] = min(best[label], (time.perf_counter() - t0) / len(weights))
                    key = f"{name} [{out_dim},{in_dim}] rows={rows}"
                    result["ms"][key] = {label: t * 1e3 for label, t in best.items()}
                    print(f"{key}: baseline {best['baseline'] * 1e3:.3f} ms, current {best['current'] * 1e3:.3f} ms "
                          f"({best['current'] / best['baseline']:.2f}x the time)", flush=True)
                del weights
    if switch is not None:
        switch(loaded_setting)  # as the load left it
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
