"""One layer's attention over the fp32, the blocked bf16 and the q8_0 KV caches, per kernel variant.

The AVX2 kernels kept K and V in fp32 until session 15; now both variants read the slot-blocked
bf16 cache and the q8_0 one (kernels/attn16.h). This times `CpuKernels.attention` for layers of
Llama-3.2-1B's shape (32 query heads, 8 kv heads, head_dim 64) at a given depth of context, for
a decode row and a verified draft of 5 rows. The cache holds `--layers` layers, attended in turn
(16 layers at 8k tokens: 128 MB of bf16, past the last-level cache, so K and V stream from
memory as in a real decode step); the figure is microseconds per layer of the fastest of
`--repeats` passes. `--pages both` times the blocked caches on 4 KiB pages too (the library keeps
a cache of 2 MB or more on transparent huge pages: kernels/memory.py), in alternation. Each
variant runs in its own process (`TOKENLEAP_KERNELS`), so an AVX-512 host measures the AVX2
kernels too.

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

CACHES = {"fp32": ("float32", False), "bf16": ("bfloat16", True), "q8_0": ("int8", True)}


def measure(depths: list[int], rows_list: list[int], repeats: int, layers: int, pages: str = "huge") -> dict[str, Any]:
    """In this process: microseconds per layer for every (depth, rows, cache); with `pages`
    "both", each cache also on 4 KiB pages (`{name}_4k_us`), timed in alternation with it."""
    import torch

    import tokenleap.kv.cache as kv_cache
    from tokenleap.attention import causal_mask
    from tokenleap.attention.ops import RowGroup, plan_rows
    from tokenleap.kernels import load_kernels

    k = load_kernels()
    if k is None or not k.bf16_attention:
        raise SystemExit("no kernels with blocked attention on this machine")
    heads, kv_heads, hd = 32, 8, 64
    huge_alloc = kv_cache.huge_page_tensor

    def cache(depth: int, dtype: str, blocked: bool, huge: bool) -> Any:
        kv_cache.huge_page_tensor = huge_alloc if huge else (lambda *a, **kw: None)  # type: ignore[assignment]
        try:
            kv = kv_cache.KVCache(layers, kv_heads, hd, dtype=getattr(torch, dtype), max_capacity=depth + 64,
                                  initial_capacity=depth + 64, blocked=blocked)
        finally:
            kv_cache.huge_page_tensor = huge_alloc  # type: ignore[assignment]
        kv.reserve(depth)
        for layer in range(layers):
            kv.write(layer, 0, torch.randn(kv_heads, depth, hd), torch.randn(kv_heads, depth, hd))
        kv.commit(depth)
        return kv

    out: dict[str, Any] = {"variant": k.variant, "pages": pages, "rows": []}
    for depth in depths:
        for rows in rows_list:
            row: dict[str, Any] = {"depth": depth, "rows": rows}
            for name, (dtype, blocked) in CACHES.items():
                kinds = {"": True, "_4k": False} if pages == "both" and blocked else {"": True}
                kvs = {kind: cache(depth, dtype, blocked, huge) for kind, huge in kinds.items()}
                cos, sin = torch.ones(depth + rows, hd), torch.zeros(depth + rows, hd)
                qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd)
                plans = {}
                for kind, kv in kvs.items():
                    kv.reserve(rows)
                    plans[kind] = plan_rows([RowGroup(kv, depth, torch.arange(depth, depth + rows), causal_mask())])
                    for layer in range(layers):
                        k.attention(qkv, plans[kind], layer, heads, kv_heads, hd, cos, sin)
                best = dict.fromkeys(kvs, float("inf"))
                for _ in range(repeats):
                    for kind in kvs:
                        t0 = time.perf_counter()
                        for layer in range(layers):
                            k.attention(qkv, plans[kind], layer, heads, kv_heads, hd, cos, sin)
                        best[kind] = min(best[kind], (time.perf_counter() - t0) / layers)
                for kind, t in best.items():
                    row[f"{name}{kind}_us"] = t * 1e6
                del kvs, plans
            row["bf16_over_q8_0"] = row["bf16_us"] / row["q8_0_us"]
            out["rows"].append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=csv_of(int), default="1024,8192")
    ap.add_argument("--rows", type=csv_of(int), default="1,5")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--layers", type=int, default=16, help="layers in the cache, attended in turn (default: %(default)s)"
    )
    ap.add_argument("--variants", default="avx2,avx512", help="kernel variants to run (those the CPU has)")
    ap.add_argument(
        "--pages",
        choices=("huge", "both"),
        default="huge",
        help=(
            "the caches on transparent huge pages (as the library keeps them), or also on 4 KiB pages, "
            "timed in alternation"
        ),
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_attention.json")
    args = ap.parse_args(argv)
    depths, rows_list = args.depths, args.rows
    if args.worker:
        print(json.dumps(measure(depths, rows_list, args.repeats, args.layers, args.pages)))
        return 0
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "command": " ".join(sys.argv),
        "variants": [],
    }
    for variant in args.variants.split(","):
        env = {**os.environ, "TOKENLEAP_KERNELS": variant}
        cmd = [
            sys.executable, __file__, "--worker", "--depths", ",".join(map(str, depths)), "--rows",
            ",".join(map(str, rows_list)), "--repeats", str(args.repeats), "--layers", str(args.layers), "--pages",
            args.pages
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"{variant}: {proc.stderr.strip()[-300:]}", file=sys.stderr)
            continue
        data = json.loads(proc.stdout.strip().splitlines()[-1])
        result["variants"].append(data)
        for r in data["rows"]:
            print(
                f"{data['variant']}: depth {r['depth']}, {r['rows']} row(s): us per layer: fp32 {r['fp32_us']:.0f}, "
                f"bf16 {r['bf16_us']:.0f}, q8_0 {r['q8_0_us']:.0f} (bf16 / q8_0 {r['bf16_over_q8_0']:.2f}x)"
                + (
                    f"; on 4 KiB pages: bf16 {r['bf16_4k_us']:.0f}, q8_0 {r['q8_0_4k_us']:.0f}"
                    if "bf16_4k_us" in r
                    else ""
                ),
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
