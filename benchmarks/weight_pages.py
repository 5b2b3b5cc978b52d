"""Decoding with the weights on transparent huge pages against the same weights on 4 KiB pages.

`formats._weight_buffer` gives every weight of 2 MB or more its own 2 MB-aligned mapping with
`madvise(MADV_HUGEPAGE)` (see its docstring), and a model gathers its smaller weights onto one
more (`memory.gather_on_huge_pages`); before, numpy's allocator madvised only buffers of
4 MB and more, unaligned, so a 1B model's QKV and output projections (2-4 MB each) and every
weight's ends sat on 4 KiB pages. Here one process loads the file twice, once as the library does
and once as it did before (`--against small-pages`: through numpy's allocator; `no-gather`: the
weights under 2 MB left where numpy put them), and decodes `--tokens` forced tokens on each in turn
(`model_sizes.tg`, the order alternating per pair), with the memory's read rate before and
after each pair (this host's bandwidth swings within minutes, so only pairs compare). Reports the
share of the process's anonymous memory on huge pages and the median speed ratio; JSON to
`benchmarks/results/weight_pages.json`.

    .venv/bin/python benchmarks/weight_pages.py benchmarks/.peer/models/llama-3.2-1b-Q4_K_M.gguf --pairs 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name, read_bandwidth, tg  # noqa: E402

import tokenleap.kernels.formats as formats  # noqa: E402
import tokenleap.models.weights as model_weights  # noqa: E402
from tokenleap import LLM  # noqa: E402


def load_on_small_pages(model: str, against: str = "small-pages") -> LLM:
    """`model` loaded as the library did before: "small-pages", numpy's allocator for every weight
    and no gathering (before huge-page buffers, s22); "no-gather", the weights of 2 MB and more on
    their own huge-page mappings but the smaller ones left on 4 KiB pages (before s33)."""
    own, gather = formats._weight_buffer, model_weights.gather_on_huge_pages
    if against == "small-pages":
        formats._weight_buffer = lambda shape: torch.from_numpy(np.empty(shape, dtype=np.uint8))  # type: ignore[assignment]
    model_weights.gather_on_huge_pages = lambda tensors: 0  # type: ignore[assignment]
    try:
        return LLM(model=model)
    finally:
        formats._weight_buffer = own  # type: ignore[assignment]
        model_weights.gather_on_huge_pages = gather  # type: ignore[assignment]


def huge_page_kb() -> int:
    """This process's anonymous memory on transparent huge pages (kB; 0 where unknown)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0
    return int(text.split("AnonHugePages:")[1].split()[0]) if "AnonHugePages:" in text else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a GGUF file or a registered model name")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--against", choices=["small-pages", "no-gather"], default="small-pages",
                    help="small-pages: every weight from numpy's allocator; no-gather: only the weights under "
                         "2 MB left on 4 KiB pages (not gathered onto one huge-page mapping)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "weight_pages.json")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.tokens < 1:
        ap.error("--pairs and --tokens must be at least 1")
    if args.model.endswith(".gguf") and not Path(args.model).is_file():
        ap.error(f"no such file: {args.model}")
    before = huge_page_kb()
    huge = LLM(model=args.model)
    huge_kb = huge_page_kb() - before
    small = load_on_small_pages(args.model, args.against)
    small_kb = huge_page_kb() - before - huge_kb
    print(f"{cpu_name()}; anonymous memory on huge pages: {huge_kb / 1024:.0f} MB (as the library loads), "
          f"{small_kb / 1024:.0f} MB ({args.against})", flush=True)
    tg(huge, 8, repeats=1)
    tg(small, 8, repeats=1)
    pairs: list[dict[str, Any]] = []
    for i in range(args.pairs):
        r0 = read_bandwidth(3)
        order = [("huge", huge), ("small", small)] if i % 2 == 0 else [("small", small), ("huge", huge)]
        speed = {name: tg(llm, args.tokens, repeats=1) for name, llm in order}
        r1 = read_bandwidth(3)
        pairs.append({"read_before": r0, "read_after": r1, **speed, "ratio": speed["huge"] / speed["small"]})
        print(f"  pair {i + 1}: huge pages {speed['huge']:.2f} vs 4 KiB pages {speed['small']:.2f} tok/s "
              f"({pairs[-1]['ratio']:.3f}x), read {r0:.0f} / {r1:.0f} GB/s", flush=True)
    median = statistics.median(p["ratio"] for p in pairs)
    print(f"median {median:.3f}x over {len(pairs)} pairs", flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "model": args.model, "tokens": args.tokens,
              "command": " ".join(sys.argv), "against": args.against,
              "huge_page_mb": {"huge_buffers": huge_kb / 1024, args.against: small_kb / 1024},
              "pairs": pairs, "median_ratio": median}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
