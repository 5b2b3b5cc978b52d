"""GB/s of the quantized linears (quant.h) per GGUF type, in the shapes of a Llama-3.2-1B layer.

For each type and shape, enough distinct weights to overflow the caches (~300 MB in all) are
built from random blocks (every quant bit and sub-scale random, small scales: the kernels' speed
does not depend on the values) and one `CpuKernels.linear` call per weight is timed at 1 and 8
rows, fastest of 5 rounds; GB/s = the weight's bytes / the time of one call. One row streams the
weights (decode); 8 rows are a verify forward. JSON to `benchmarks/results/quant_bandwidth.json`.

    .venv/bin/python benchmarks/quant_bandwidth.py --types Q4_K,Q5_K,Q6_K,Q8_0,Q4_0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name  # noqa: E402

from tokenleap.kernels import QuantWeight, load_kernels  # noqa: E402

SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048))  # QKV, O, gate+up, down, LM head


def random_blocks(qtype: gguf.GGMLQuantizationType, out_dim: int, in_dim: int, rng: np.random.Generator) -> np.ndarray:
    """A tensor's bytes in `qtype` with random quants and small f16 scales."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(out_dim, in_dim // block, nbytes), dtype=np.uint8)
    scale = (rng.random((out_dim, in_dim // block, 1)) * 0.002).astype(np.float16).view(np.uint8)
    if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K):
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    elif qtype == gguf.GGMLQuantizationType.Q6_K:
        raw[..., 208:210] = scale
    else:
        raw[..., 0:2] = scale
    return raw.reshape(out_dim, -1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0,Q4_0")
    ap.add_argument("--budget-mb", type=float, default=300.0, help="bytes of distinct weights per shape")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quant_bandwidth.json")
    args = ap.parse_args(argv)
    kernels = load_kernels()
    if kernels is None:
        ap.error("no tokenleap kernels on this machine")
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "threads": kernels.threads,
              "variant": kernels.variant, "vnni": kernels.quant_vnni(), "gbps": {}}
    rng = np.random.default_rng(0)
    for name in args.types.split(","):
        qtype = gguf.GGMLQuantizationType[name]
        for out_dim, in_dim in SHAPES:
            first = QuantWeight.from_blocks(random_blocks(qtype, out_dim, in_dim, rng), int(qtype), out_dim, in_dim)
            copies = max(1, int(args.budget_mb * 1e6 // first.nbytes))
            weights = [first] + [
                QuantWeight.from_blocks(random_blocks(qtype, out_dim, in_dim, rng), int(qtype), out_dim, in_dim)
                for _ in range(copies - 1)
            ]
            for rows in (1, 8):
                x = torch.randn(rows, in_dim)
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    for w in weights:
                        kernels.linear(x, w)
                    best = min(best, (time.perf_counter() - t0) / len(weights))
                gbps = first.nbytes / best / 1e9
                result["gbps"][f"{name} [{out_dim},{in_dim}] rows={rows}"] = gbps
                print(f"{name} [{out_dim}, {in_dim}] rows {rows}: {best * 1e3:.3f} ms, {gbps:.1f} GB/s", flush=True)
            del weights
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
