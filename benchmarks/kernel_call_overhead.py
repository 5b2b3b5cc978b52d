"""What one kernel call costs outside the kernel: the Python wrapper of a quantized linear.

Decode of the default model makes ~121 quantized-linear calls per token (4 per layer and the LM
head), so the wrapper's fixed cost is paid ~121 times a token whatever the weights' size. This
times, on a tiny Q4_1 weight ([8, 32], one row: the kernel's own work is negligible), the full
`CpuKernels.linear` call against the bare ctypes call into `tl_linear_q` with preallocated
buffers, and one `torch.empty` for scale; the difference is the wrapper's overhead. Best of
`--rounds` rounds of `--calls` calls each.

    .venv/bin/python benchmarks/kernel_call_overhead.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from tokenleap.kernels import QuantWeight, load_kernels  # noqa: E402


def per_call_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    for _ in range(calls // 10):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default: print only)")
    args = ap.parse_args()
    kernels = load_kernels()
    if kernels is None:
        print("no kernels on this machine", file=sys.stderr)
        return 1
    dense = torch.randn(8, 32, generator=torch.Generator().manual_seed(0)).numpy()
    w = QuantWeight.from_blocks(gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q4_1), 3, 8, 32)
    x = torch.randn(1, 32)
    scratch, y = torch.empty(4096, dtype=torch.uint8), torch.empty(1, 8)
    ptrs = (x.data_ptr(), scratch.data_ptr(), w.data.data_ptr(), y.data_ptr())
    fmt, lib = w.format, kernels.lib
    result = {
        "kernels": kernels.variant,
        "wrapper_us": per_call_us(lambda: kernels.linear(x, w), args.calls, args.rounds),
        "bare_ctypes_us": per_call_us(
            lambda: lib.tl_linear_q(ptrs[0], None, 0.0, 0, ptrs[1], ptrs[2], fmt, None, ptrs[3], 1, 32, 8, 0),
            args.calls,
            args.rounds,
        ),
        "torch_empty_us": per_call_us(lambda: torch.empty(100, dtype=torch.uint8), args.calls, args.rounds),
    }
    result["overhead_us"] = result["wrapper_us"] - result["bare_ctypes_us"]
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
