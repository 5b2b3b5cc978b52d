"""One layer's attention over the fp32 KV cache and over the blocked bf16 one, per kernel variant.

The AVX2 kernels kept K and V in fp32 until session 15; now both variants read the slot-blocked
bf16 cache (kernels/attn16.h). This times `CpuKernels.attention` for one layer of Llama-3.2-1B's
shape (32 query heads, 8 kv heads, head_dim 64) at a given depth of context, for a decode row
and a verified draft of 5 rows, over an fp32 cache and a blocked bf16 cache (fastest of
`--repeats` calls after warm-up). Each variant runs in its own process (`TOKENLEAP_KERNELS`), so
an AVX-512 host measures the AVX2 kernels too.

    .venv/bin/python benchmarks/kv_attention.py --depths 1024,8192   # -> results/kv_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name, csv_of  # noqa: E402


def measure(depths: list[int], rows_list: list[int], repeats: int) -> dict[str, Any]:
    """In this process: microseconds per call for every (depth, rows, cache)."""
    import torch

    from tokenleap.attention import causal_mask
    from tokenleap.attention.ops import RowGroup, plan_rows
    from tokenleap.kernels import load_kernels
    from tokenleap.kv.cache import KVCache

    k = load_kernels()
    if k is None or not k.bf16_attention:
        raise SystemExit("no kernels with bf16 attention on this machine")
    heads, kv_heads, hd = 32, 8, 64
    out: dict[str, Any] = {"variant": k.variant, "rows": []}
    for depth in depths:
        for rows in rows_list:
            row: dict[str, Any] = {"depth": depth, "rows": rows}
            for blocked in (False, True):
                kv = KVCache(1, kv_heads, hd, dtype=torch.bfloat16 if blocked else torch.float32, max_capacity=depth + 64,
                             initial_capacity=depth + 64, blocked=blocked)
                kv.reserve(depth)
                kv.write(0, 0, torch.randn(kv_heads, depth, hd), torch.randn(kv_heads, depth, hd))
                kv.commit(depth)
                kv.reserve(rows)
                plan = plan_rows([RowGroup(kv, depth, torch.arange(depth, depth + rows), causal_mask())])
                cos, sin = torch.ones(depth + rows, hd), torch.zeros(depth + rows, hd)
                qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd)
                for _ in range(3):
                    k.attention(qkv, plan, 0, heads, kv_heads, hd, cos, sin)
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    k.attention(qkv, plan, 0, heads, kv_heads, hd, cos, sin)
                    best = min(best, time.perf_counter() - t0)
                row["bf16_us" if blocked else "fp32_us"] = best * 1e6
            row["fp32_over_bf16"] = row["fp32_us"] / row["bf16_us"]
            out["rows"].append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=csv_of(int), default="1024,8192")
    ap.add_argument("--rows", type=csv_of(int), default="1,5")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--variants", default="avx2,avx512", help="kernel variants to run (those the CPU has)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_attention.json")
    args = ap.parse_args(argv)
    depths, rows_list = args.depths, args.rows
    if args.worker:
        print(json.dumps(measure(depths, rows_list, args.repeats)))
        return 0
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "command": " ".join(sys.argv), "variants": []}
    for variant in args.variants.split(","):
        env = {**os.environ, "TOKENLEAP_KERNELS": variant}
        cmd = [sys.executable, __file__, "--worker", "--depths", ",".join(map(str, depths)), "--rows", ",".join(map(str, rows_list)),
               "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"{variant}: {proc.stderr.strip()[-300:]}", file=sys.stderr)
            continue
        data = json.loads(proc.stdout.strip().splitlines()[-1])
        result["variants"].append(data)
        for r in data["rows"]:
            print(f"{data['variant']}: depth {r['depth']}, {r['rows']} row(s): fp32 {r['fp32_us']:.0f} us, blocked bf16 "
                  f"{r['bf16_us']:.0f} us ({r['fp32_over_bf16']:.2f}x)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
