"""Decode speed whether a program imports torch before tokenleap or after it.

`tokenleap/__init__.py` sets OMP_WAIT_POLICY=passive for torch's OpenMP runtime, which reads it
once, when torch is first imported; a program that imported torch first keeps libgomp's default
policy, whose workers spin after every parallel region. The engine therefore runs each step's
torch ops on one torch thread beside the kernels' pool (`Engine._step_threads`). This script runs
the same greedy decode (`--max-tokens` forced tokens, `--repeats` times, best decode tokens/s) in
fresh processes that import torch first or tokenleap first, alternating, with the default model
kept quantized and dequantized. JSON to `benchmarks/results/import_order.json`.

    .venv/bin/python benchmarks/import_order.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import sys
if sys.argv[1] == "torch-first":
    import torch
sys.path.insert(0, {src!r})
from tokenleap import LLM, SamplingParams
llm = LLM(quantization=sys.argv[2])
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True)
msg = [{{"role": "user", "content": "Write a short story about a robot learning to paint."}}]
best = 0.0
for _ in range(int(sys.argv[4])):
    out = llm.chat(msg, params, use_tqdm=False)[0]
    best = max(best, out.metrics.num_decode_tokens / out.metrics.decode_seconds)
print(best)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "import_order.json")
    args = ap.parse_args()
    code = CHILD.format(src=str(ROOT / "src"))
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # as a fresh shell has it
    runs: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for quant in ("gguf", "none"):
            for order in ("tokenleap-first", "torch-first"):
                proc = subprocess.run(
                    [sys.executable, "-c", code, order, quant, str(args.max_tokens), str(args.repeats)],
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=600,
                )
                if proc.returncode != 0:
                    print(proc.stderr[-2000:], file=sys.stderr)
                    return 1
                tps = float(proc.stdout.strip().splitlines()[-1])
                runs.setdefault(f"{quant} {order}", []).append(tps)
                print(f"quantization={quant:5s} {order:16s} {tps:6.1f} decode tok/s", flush=True)
    best = {k: max(v) for k, v in runs.items()}
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "max_tokens": args.max_tokens,
        "runs": runs,
        "best": best,
        "torch_first_over_tokenleap_first": {
            q: best[f"{q} torch-first"] / best[f"{q} tokenleap-first"] for q in ("gguf", "none")
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["torch_first_over_tokenleap_first"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
