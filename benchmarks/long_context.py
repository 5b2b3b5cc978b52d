"""Decoding at long context against llama.cpp, on the same GGUF file (issue "real model sizes", item 3).

At a few thousand tokens of context a decode step reads the KV cache as well as the weights:
for Llama-3.2-1B at 8,192 tokens that is 268 MB in bf16 (llama.cpp's default f16 cache holds the
same bytes) next to 0.8 GB of Q4_K_M weights. For each file and depth, back to back with the
same threads:

* tokenleap: a prompt of `depth` random tokens is prefilled, then `--gen` tokens are decoded
  (forced, greedy); decode tokens/s, the prefill's tokens/s, the KV cache's bytes and the
  process's resident memory after the run;
* llama.cpp: `llama-bench -p 0 -n GEN -d DEPTH -r 1` (it prefills the same depth, then times
  the decode), before and after tokenleap.

Each KV cache type of `--kv-cache-dtypes` is a row: tokenleap's bf16 cache against llama.cpp's
default f16 one, tokenleap's q8_0 cache against llama.cpp's `-ctk q8_0 -ctv q8_0 -fa 1` (its
quantized V needs flash attention).

    .venv/bin/python benchmarks/long_context.py benchmarks/.peer/models/llama-3.2-1b-Q4_K_M.gguf \\
        --depths 0,2048,8192 --kv-cache-dtypes bf16,q8_0 --llama-bench benchmarks/.peer/llama.cpp/build/bin/llama-bench
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name, csv_of  # noqa: E402
from quant_decode import llama_bench  # noqa: E402

from tokenleap import LLM, SamplingParams  # noqa: E402


def decode_at_depth(llm: LLM, depth: int, gen: int) -> dict[str, Any]:
    """Prefill `depth` random tokens, decode `gen` forced tokens; speeds and the cache's size."""
    rng = random.Random(depth)
    vocab = llm.model.config.vocab_size
    prompt = [rng.randrange(vocab // 8, vocab // 2) for _ in range(max(1, depth))]
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    t0 = time.perf_counter()
    req = llm.engine.add_request(prompt, params)
    done = llm.engine.run(req)
    total = time.perf_counter() - t0
    m = done.metrics
    kv = llm.model.new_kv_cache(16)
    bytes_per_slot = kv.nbytes() // kv.capacity
    return {
        "tg": m.num_decode_tokens / m.decode_seconds,
        "prefill_tps": len(prompt) / max(1e-9, total - m.decode_seconds),
        "kv_gb": bytes_per_slot * (len(prompt) + gen) / 1e9,
        "kv_dtype": {"int8": "q8_0"}.get(
            str(llm.model.kv_dtype).removeprefix("torch."), str(llm.model.kv_dtype).removeprefix("torch.")
        ),
        "rss_gb": psutil.Process().memory_info().rss / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="GGUF files (benchmarks/make_gguf.py)")
    ap.add_argument("--depths", type=csv_of(int), default="0,2048,8192", help="comma-separated context lengths")
    ap.add_argument("--gen", type=int, default=64, help="tokens decoded at each depth")
    ap.add_argument(
        "--kv-cache-dtypes",
        type=csv_of(str),
        default="bf16",
        help="tokenleap's KV cache types, one row each (bf16, q8_0)",
    )
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary (benchmarks/build_llamacpp.sh)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "long_context.json")
    args = ap.parse_args(argv)
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)} (make them with benchmarks/make_gguf.py)")
    depths = args.depths
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "threads": args.threads,
                              "command": " ".join(sys.argv), "rows": []}
    for path in args.files:
        for kv_type in args.kv_cache_dtypes:
            llm = LLM(model=str(path), max_model_len=max(depths) + args.gen + 8, kv_cache_dtype=kv_type)
            peer_flags = ("-ctk", "q8_0", "-ctv", "q8_0", "-fa", "1") if kv_type == "q8_0" else ()
            for depth in depths:
                row: dict[str, Any] = {"file": path.name, "depth": depth, "llama_flags": " ".join(peer_flags)}

                def peer(
                    path: Path = path, depth: int = depth, flags: tuple[str, ...] = peer_flags
                ) -> float | dict[int, float] | None:
                    if not args.llama_bench:
                        return None
                    return llama_bench(
                        args.llama_bench, path, args.threads, gen=str(args.gen), depth=depth, repeats=1, extra=flags
                    )

                before = peer()
                row.update(decode_at_depth(llm, depth, args.gen))
                after = peer()
                if isinstance(before, float) and isinstance(after, float):
                    row["llama_tg"] = [before, after]
                    row["tg_ratio"] = row["tg"] / statistics.mean([before, after])
                print(
                    f"{path.name} {kv_type} depth {depth}: {row['tg']:.1f} tok/s "
                    f"(llama.cpp {row.get('llama_tg')} {row['llama_flags']}, "
                    f"ratio {row.get('tg_ratio', float('nan')):.2f}); prefill {row['prefill_tps']:.0f} tok/s, "
                    f"KV {row['kv_gb']:.3f} GB {row['kv_dtype']}, rss {row['rss_gb']:.2f} GB",
                    flush=True,
                )
                result["rows"].append(row)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=1))
            del llm
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
