"""Prompt prefill (or, `--decode`, one-row decode steps) of this checkout against another tree's, on
real models, processes alternating.

Each pass runs one process per tree (`--baseline DIR`: a checkout of the revision to compare,
e.g. `git worktree add /tmp/base REV`; then this checkout), in turn, `--pairs` times: each loads
every model of `--models` and times one forward over a random prompt of each of `--lengths`
tokens (fastest of 3; with `--decode`, the fastest of 40 one-row steps after such a prompt), so
a busy moment of the host hits both trees alike. Prints milliseconds a prompt token (or a step)
per tree (the median over the pairs) and the ratio; JSON to `--out`.

    git worktree add /tmp/base ff0b0b4
    .venv/bin/python benchmarks/prefill_ab.py --baseline /tmp/base \\
        --models qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct --lengths 128,512
    .venv/bin/python benchmarks/prefill_ab.py --baseline /tmp/base --decode --lengths 256 --pairs 4
    TOKENLEAP_KERNELS=avx2 .venv/bin/python benchmarks/prefill_ab.py --baseline /tmp/base --xb-rows 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name, csv_of  # noqa: E402

WORKER = """
import json, sys, time
import torch
from tokenleap import LLM
from tokenleap.models.base import SeqInput
decode = sys.argv[3] == "decode"
out = {}
for name in sys.argv[1].split(","):
    model = LLM(model=name).model
    if int(sys.argv[4]) >= 0:  # the buffered tiles' setting, over the load's choice (kernels/tiles.py)
        from tokenleap.kernels import load_kernels
        load_kernels().quant_xb_rows(int(sys.argv[4]))
    for n in map(int, sys.argv[2].split(",")):
        ids = torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(n))
        best = float("inf")
        if decode:  # one-row steps (forward + logits) after a prompt of n tokens
            kv = model.new_kv_cache(n + 2)
            model.forward(ids, torch.arange(n), kv)
            for _ in range(40):
                kv.truncate(n)
                t0 = time.perf_counter()
                model.compute_logits(model.forward_batch([SeqInput(ids[-1:], torch.arange(n, n + 1), kv)]).hidden)
                best = min(best, time.perf_counter() - t0)
            kv.free()
            out[f"{name} {n}"] = best * 1e3
            continue
        for _ in range(3):
            kv = model.new_kv_cache(n + 2)
            t0 = time.perf_counter()
            model.forward(ids, torch.arange(n), kv)
            best = min(best, time.perf_counter() - t0)
            kv.free()
        out[f"{name} {n}"] = best * 1e3 / n
print(json.dumps(out))
"""


def run_tree(tree: Path, models: str, lengths: str, mode: str = "prefill", xb_rows: int = -1) -> dict[str, float]:
    """One worker process on `tree`'s sources: milliseconds a prompt token (or, `mode` "decode",
    a one-row step at that context) per model and length; `xb_rows` >= 0 sets the AVX2 buffered
    tiles' threshold (CpuKernels.quant_xb_rows) after each load."""
    env_path = str(tree / "src")
    done = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {env_path!r})\n" + WORKER, models, lengths, mode,
         str(xb_rows)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:  # an unknown model, a tree that does not import: its last line, not a traceback here
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"prefill_ab: the worker on {tree} failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout of the revision to compare against")
    ap.add_argument("--models", default="qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--lengths", type=csv_of(int), default="128,512")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--decode", action="store_true",
                    help="time one-row decode steps (forward + logits, fastest of 40) after a prompt of each "
                    "length instead")
    ap.add_argument("--xb-rows", type=int, default=-1,
                    help="in both trees, the AVX2 buffered tiles from this many rows (0: group-major only) "
                    "whatever the load measured (kernels/tiles.py); default: the load's choice")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefill_ab.json")
    args = ap.parse_args(argv)
    if not (args.baseline / "src" / "tokenleap").is_dir():
        ap.error(f"{args.baseline} is not a tokenleap checkout (no src/tokenleap)")
    lengths = ",".join(map(str, args.lengths))
    trees = {"baseline": args.baseline, "current": ROOT}
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
    for _ in range(args.pairs):
        for label, tree in trees.items():
            mode = "decode" if args.decode else "prefill"
            runs[label].append(run_tree(tree, args.models, lengths, mode, args.xb_rows))
    unit = "ms a decode step at that context" if args.decode else "ms a prompt token"
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "baseline": str(args.baseline),
              "unit": unit, "xb_rows": args.xb_rows, "cases": {}}
    print(f"{result['cpu']}; {unit}, median of {args.pairs} alternating pairs")
    for key in runs["current"][0]:
        base = statistics.median(r[key] for r in runs["baseline"])
        cur = statistics.median(r[key] for r in runs["current"])
        per_run = {label: [r[key] for r in v] for label, v in runs.items()}
        result["cases"][key] = {"baseline_ms": base, "current_ms": cur, "runs": per_run}
        print(f"{key} tokens: baseline {base:.2f}, current {cur:.2f} ({base / cur:.3f}x the speed)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
