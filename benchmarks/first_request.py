"""How long a process's first speculative request waits for the verify cost curve (a k-row
forward against one row, `engine/speculation.py`), measured (the curve's folder empty) and then
read back from the user cache by a second `LLM` on the same model: each the first request of its
engine, one short greedy generate.

    .venv/bin/python benchmarks/first_request.py qwen2.5-coder-1.5b-instruct --method suffix
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name  # noqa: E402

import tokenleap.engine.speculation as speculation  # noqa: E402
from tokenleap import LLM, SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a GGUF file or a registered model name")
    ap.add_argument("--method", default="suffix", help="the speculative method (default: suffix)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "first_request.json")
    args = ap.parse_args(argv)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    result: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "model": args.model,
        "method": args.method,
    }
    user_cache = speculation.cache_dir
    with tempfile.TemporaryDirectory() as folder:
        speculation.cache_dir = lambda: Path(folder)  # type: ignore[assignment]  # an empty cache: the first curve is measured
        try:
            for case in ("measured", "from the cache"):
                llm = LLM(model=args.model, speculative_config={"method": args.method})
                t0 = time.perf_counter()
                llm.generate(["Write a Python function that reverses a string."], params, use_tqdm=False)
                result[case] = time.perf_counter() - t0
                print(f"first request, cost curve {case}: {result[case]:.2f} s", flush=True)
                del llm
            result["cached_curves"] = len(list(Path(folder).rglob("*.json")))
        finally:
            speculation.cache_dir = user_cache  # type: ignore[assignment]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{result['cpu']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
