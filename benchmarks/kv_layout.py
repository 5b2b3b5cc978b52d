"""Verify cost by KV-cache layout: the bf16 model with its bf16 slot-blocked cache (the default)
against the same model with an fp32 cache (the layout before it), at several contexts.

For each context: prefill that many tokens, then time one forward of k new tokens plus the LM
head on all k rows (the verification of k-1 draft tokens), fastest of `--repeats` interleaved
rounds, for k in `--ks`; both layouts in the same process, one after the other per context.

    .venv/bin/python benchmarks/kv_layout.py --contexts 300 1000 2000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tokenleap.config import DEFAULT_MODEL
from tokenleap.models.llama import LlamaModel
from tokenleap.models.loading import DTYPES, load_model
from tokenleap.models.registry import resolve

ROOT = Path(__file__).resolve().parent


def time_rows(model: LlamaModel, context: int, ks: list[int], repeats: int) -> dict[int, float]:
    kv = model.new_kv_cache(context + max(ks) + 2)
    gen = torch.Generator().manual_seed(context)
    model.forward(torch.randint(100, 40000, (context,), generator=gen), torch.arange(context), kv)
    best = {k: float("inf") for k in ks}
    for _ in range(repeats):
        for k in ks:
            kv.truncate(context)
            ids = torch.randint(100, 40000, (k,), generator=gen)
            t0 = time.perf_counter()
            model.compute_logits(model.forward(ids, torch.arange(context, context + k), kv).hidden)
            best[k] = min(best[k], time.perf_counter() - t0)
    return {k: 1000 * t for k, t in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 1000, 2000])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "results/kv_layout.json"))
    args = parser.parse_args()
    model, _ = load_model(resolve(DEFAULT_MODEL), DTYPES["bf16"])
    if not model.kv_blocked:
        raise SystemExit("error: the bf16 blocked cache needs the kernels with AVX512-BF16 on this machine")
    layouts = {"bf16 blocked": (True, torch.bfloat16), "fp32": (False, torch.float32)}
    results = []
    for context in args.contexts:
        for name, (blocked, dtype) in layouts.items():
            model.kv_blocked, model.kv_dtype = blocked, dtype  # the layout new caches get
            ms = time_rows(model, context, args.ks, args.repeats)
            results.append({"context": context, "layout": name, "ms": ms})
    model.kv_blocked, model.kv_dtype = True, torch.bfloat16
    table = Table(title="forward of k tokens + logits, ms (relative to k = 1)")
    table.add_column("context")
    table.add_column("KV cache")
    for k in args.ks:
        table.add_column(f"k={k}", justify="right")
    for r in results:
        base = r["ms"][args.ks[0]]
        table.add_row(str(r["context"]), r["layout"], *(f"{r['ms'][k]:.1f} ({r['ms'][k] / base:.2f})" for k in args.ks))
    Console().print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "ks": args.ks, "results": results}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
