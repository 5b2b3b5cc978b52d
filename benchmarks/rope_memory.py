"""Resident memory of a model after load and a short answer, with the rotary tables built on
demand (`lazy`, the default) or in full at load (`full`, as before session 16).

    .venv/bin/python benchmarks/rope_memory.py benchmarks/.peer/models/gemma3-1b-Q4_K_M.gguf full
    .venv/bin/python benchmarks/rope_memory.py benchmarks/.peer/models/gemma3-1b-Q4_K_M.gguf lazy
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a registered name, a .gguf file or a Hugging Face folder")
    ap.add_argument("tables", choices=["lazy", "full"])
    args = ap.parse_args(argv)
    if not Path(args.model).exists() and "/" in args.model:
        ap.error(f"{args.model} does not exist")
    import tokenleap.models.llama as llama

    if args.tables == "full":
        llama.ROPE_TABLE_START = llama.MAX_ROPE_TABLE
    from tokenleap import LLM, SamplingParams

    llm = LLM(model=args.model)
    llm.generate(["Hello there, how are you?"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    rss = next(
        int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS")
    )
    print(json.dumps({"tables": args.tables, "rss_gb": round(rss / 1e6, 3),
                      "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
