"""What a verify forward of k rows costs against one row, on a GGUF model, with the K-quants'
two-group tile (quant.h `qk_tile2`, 4 rows and up on AVX-512 VNNI) and without it (without VNNI,
as on the AVX2 variant, `TOKENLEAP_KERNELS=avx2`: the run-major tiles `qk_tile_xb` / `q_tile_xb`), and
how fast the one-row layer stack reads its weights against `torch.sum`'s read rate of the moment.

Each round times, in turn: `torch.sum`, the forward plus logits (the engine's `forward_batch` + LM head) at
each row count with the tile and, from the row count it starts at, without it
(`CpuKernels.quant_pair_rows(0)`, or `quant_xb_rows(0)`; where the load measured the group-major
tile faster and chose it, `kernels/tiles.py`, the other case is the run-major tiles from 4 rows),
at `--context` cached tokens; then every decoder linear of the model once, one row, in forward
order; with `--parts`, the layer linears and the LM head at each row count (a forward's time
less those two is its attention, norms and the rest); `torch.sum` over 256 MB comes first in
each round (then a pause: torch's OpenMP threads spin a while after it). Best and median over
`--rounds`; JSON to `--out`.

    .venv/bin/python benchmarks/forward_rows.py benchmarks/.peer/models/llama-3.1-8b-Q4_K_M.gguf --rows 1,5,9
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name, csv_of  # noqa: E402

from tokenleap import LLM  # noqa: E402
from tokenleap.kernels.tiles import XB_FROM  # noqa: E402
from tokenleap.models.base import SeqInput  # noqa: E402


def measure(llm: LLM, rows: list[int], context: int, rounds: int, parts: bool = False) -> dict[str, Any]:
    model = llm.model
    kernels = getattr(model, "kernels", None)
    # the tile each row count takes by default, and the other one (the labelled cases): with VNNI
    # the two-group tiles (quant_pair_rows) against the one-group tile; without it the run-major
    # ones (quant_xb_rows) against the group-major tile, or, where this host's load measured the
    # group-major tile faster and chose it (kernels/tiles.py), the run-major ones from XB_FROM rows
    switch, tile_default, other, other_name = None, 0, 0, ""
    if kernels is not None:
        switch = kernels.quant_pair_rows if kernels.quant_vnni() else kernels.quant_xb_rows
        tile_default = switch()
        if kernels.quant_vnni():
            other_name = "one-group tile"
        elif tile_default:
            other_name = "group-major tile"
        else:
            other, other_name = XB_FROM, "superblock-major tile"
    start = tile_default or other  # the row count from which the two settings differ (0: they never do)
    cases = [(n, True) for n in rows] + [(n, False) for n in rows if start and n >= start]
    linears = [w for layer in model.layers for w in layer.linears()]
    inputs = {w.in_dim: torch.randn(1, w.in_dim) for w in linears}
    kv = model.new_kv_cache(context + max(rows) + 2)
    model.forward(torch.arange(context) % model.config.vocab_size, torch.arange(context), kv)
    times: dict[str, list[float]] = {}
    big = torch.ones(1 << 26)
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            big.sum()
            times.setdefault("torch.sum 256 MB", []).append(time.perf_counter() - t0)
            time.sleep(0.2)  # torch's OpenMP threads spin a while after their work: let them go idle first
            for n, pair in cases:
                if switch is not None:
                    switch(tile_default if pair else other)
                kv.truncate(context)
                t0 = time.perf_counter()
                model.compute_logits(
                    model.forward_batch([SeqInput(torch.full((n,), 17), torch.arange(context, context + n), kv)]).hidden
                )
                times.setdefault(f"{n} rows" + ("" if pair else f", {other_name}"), []).append(
                    time.perf_counter() - t0
                )
            if kernels is not None and switch is not None:
                switch(tile_default)
                t0 = time.perf_counter()
                for w in linears:
                    kernels.linear(inputs[w.in_dim], w)
                times.setdefault("layer linears, 1 row", []).append(time.perf_counter() - t0)
            if parts and kernels is not None:  # where a forward's time goes: its linears and LM head at each row count
                for n in rows:
                    xs = {d: torch.randn(n, d) for d in inputs}
                    t0 = time.perf_counter()
                    for w in linears:
                        kernels.linear(xs[w.in_dim], w)
                    times.setdefault(f"{n} rows: layer linears", []).append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    kernels.linear(torch.randn(n, model.config.hidden_size), model.lm_head_linear)
                    times.setdefault(f"{n} rows: LM head", []).append(time.perf_counter() - t0)
    finally:
        if switch is not None:
            switch(tile_default)
        kv.free()
    one = f"{rows[0]} rows"
    result: dict[str, Any] = {"cases": {}}
    for key, ts in times.items():
        result["cases"][key] = {
            "best_ms": min(ts) * 1e3,
            "median_ms": statistics.median(ts) * 1e3,
            "best_rel": min(ts) / min(times[one]),
            "median_rel": statistics.median(ts) / statistics.median(times[one]),
        }
    nbytes = sum(w.nbytes for w in linears)
    if "layer linears, 1 row" in times and nbytes:
        result["linears_gb"] = nbytes / 1e9
        result["linears_gbps"] = nbytes / min(times["layer linears, 1 row"]) / 1e9
    result["sum_gbps"] = (1 << 28) / min(times["torch.sum 256 MB"]) / 1e9
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a GGUF file or a registered model name")
    ap.add_argument("--rows", type=csv_of(int), default="1,5,9", help="row counts (the first is the reference)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--parts", action="store_true", help="also time the layer linears and LM head at each row count")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "forward_rows.json")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.rows) or args.rounds < 1 or args.context < 1:
        ap.error("--rows, --rounds and --context must be positive")
    llm = LLM(model=args.model)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "model": args.model, "context": args.context,
              "rounds": args.rounds, **measure(llm, args.rows, args.context, args.rounds, args.parts)}
    print(f"{result['cpu']}; {args.model} at {args.context} tokens of context, {args.rounds} rounds")
    for key, c in result["cases"].items():
        print(
            f"  {key}: best {c['best_ms']:.1f} ms ({c['best_rel']:.2f}x), "
            f"median {c['median_ms']:.1f} ms ({c['median_rel']:.2f}x)"
        )
    if "linears_gbps" in result:
        print(
            f"  layer linears read at {result['linears_gbps']:.1f} GB/s ({result['linears_gb']:.2f} GB); "
            f"torch.sum {result['sum_gbps']:.1f} GB/s"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
