"""Quantized linears: AVX-512 VNNI (`vpdpbusd`) integer sums against the AVX2 path
(`vpmaddubsw` + `vpmaddwd`), per GGUF type, at 1 and 8 rows, in one process.

Both paths compute the same exact integer block sums (the outputs are checked bit-identical
here too), so the only difference is speed. One Gemma-3-ffn_down-shaped linear `[640, 2048]`
(in a multiple of 256, so the K-quants fit) over `--copies` distinct weights (cold in cache, as
in a forward); per type and row count the two paths alternate (ABAB) for `--rounds` rounds and
the figures are the fastest round of each and the median of
the per-round (paired, back to back) AVX2 / VNNI time ratios, the robust one on a busy machine.
Also the file's bytes per weight and the kernel form's (the K-quants and Q5_0 are widened at
load). JSON to `benchmarks/results/quant_vnni.json`.

    .venv/bin/python benchmarks/quant_vnni.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from tokenleap.kernels import FORMATS, QuantWeight, load_kernels  # noqa: E402


def random_weight(qtype: int, out_dim: int, in_dim: int, rng: np.random.Generator) -> QuantWeight:
    """A weight of GGML type `qtype`: gguf-py's quantizer where it has one, else random K-quant
    superblocks with small scales."""
    import gguf

    t = gguf.GGMLQuantizationType(qtype)
    if qtype in (12, 14):
        block, nbytes = gguf.GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, size=(out_dim, in_dim // block, nbytes), dtype=np.uint8)
        scale = (rng.random((out_dim, in_dim // block, 1)) * 0.002).astype(np.float16).view(np.uint8)
        if qtype == 12:
            raw[..., 0:2], raw[..., 2:4] = scale, scale
        else:
            raw[..., 208:210] = scale
        return QuantWeight.from_blocks(raw.reshape(out_dim, -1), qtype, out_dim, in_dim)
    dense = (rng.standard_normal((out_dim, in_dim)) * 0.05).astype(np.float32)
    return QuantWeight.from_blocks(gguf.quants.quantize(dense, t), qtype, out_dim, in_dim)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--copies", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quant_vnni.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_kernels()
    if kernels is None or not kernels.quant_vnni(True):
        print("no AVX-512 VNNI path here (kernels unavailable, AVX2 variant, or a CPU without VNNI)", file=sys.stderr)
        return 2
    import gguf

    out_dim, in_dim = 640, 2048
    rng = np.random.default_rng(0)
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
                    "shape": [out_dim, in_dim], "copies": args.copies, "threads": kernels.threads,
                    "load_before": os.getloadavg(), "types": {}}
    for fmt in FORMATS:
        qtype, name = fmt.ggml_id, fmt.name
        weights = [random_weight(qtype, out_dim, in_dim, rng) for _ in range(args.copies)]
        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        entry: dict = {
            "file_bits_per_weight": 8 * nbytes / block,
            "kernel_bits_per_weight": 8 * weights[0].nbytes / (out_dim * in_dim),
        }
        for rows in (1, 8):
            x = torch.randn(rows, in_dim, generator=torch.Generator().manual_seed(rows))
            best = {True: float("inf"), False: float("inf")}
            ys: dict[bool, torch.Tensor] = {}
            ratios = []
            for _ in range(args.rounds):
                t = {}
                for vnni in (True, False):
                    kernels.quant_vnni(vnni)
                    t0 = time.perf_counter()
                    for w in weights:
                        ys[vnni] = kernels.linear(x, w)
                    t[vnni] = (time.perf_counter() - t0) / len(weights)
                    best[vnni] = min(best[vnni], t[vnni])
                ratios.append(t[False] / t[True])
            ratio = float(np.median(ratios))
            if not torch.equal(ys[True], ys[False]):
                print(f"{name}: VNNI and AVX2 outputs differ", file=sys.stderr)
                return 1
            entry[f"rows_{rows}"] = {
                "vnni_us": best[True] * 1e6,
                "avx2_us": best[False] * 1e6,
                "avx2_over_vnni_median": ratio,
            }
            print(
                f"{name:5s} rows {rows}: VNNI {best[True] * 1e6:7.1f} us  AVX2 {best[False] * 1e6:7.1f} us  "
                f"AVX2/VNNI (median paired) {ratio:.2f}x"
            )
        result["types"][name] = entry
    kernels.quant_vnni(None)
    result["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
