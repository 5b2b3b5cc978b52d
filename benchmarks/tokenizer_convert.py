"""A GGUF's tokenizer conversion (a model's first load): `tokenizer.convert_gguf` against
`AutoTokenizer.from_pretrained(folder, gguf_file=name)`, alternating round by round, with the two
results' saved folders compared byte for byte.

    .venv/bin/python benchmarks/tokenizer_convert.py gemma3-270m qwen2.5-coder-0.5b-instruct smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name  # noqa: E402

from tokenleap.errors import TokenleapError  # noqa: E402
from tokenleap.models.registry import resolve  # noqa: E402
from tokenleap.tokenizer import convert_gguf  # noqa: E402


def _saved(tokenizer: Any, folder: Path) -> dict[str, bytes]:
    tokenizer.save_pretrained(str(folder))
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def measure(model: str, rounds: int) -> dict[str, Any]:
    """Fastest of `rounds` for each way, and whether they saved the same files."""
    from transformers import AutoTokenizer

    path = resolve(model).path
    ways = {
        "convert_gguf": lambda: convert_gguf(path),
        "AutoTokenizer": lambda: AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    made: dict[str, Any] = {}
    for _ in range(rounds):
        for name, way in ways.items():
            t0 = time.perf_counter()
            made[name] = way()
            times[name].append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        same = _saved(made["convert_gguf"], Path(tmp) / "a") == _saved(made["AutoTokenizer"], Path(tmp) / "b")
    best = {name: min(ts) for name, ts in times.items()}
    return {"best_s": best, "speedup": best["AutoTokenizer"] / best["convert_gguf"], "same_files": same,
            "class": type(made["convert_gguf"]).__name__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="registered model names or GGUF files")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tokenizer_convert.json")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be positive")
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "rounds": args.rounds,
                              "models": {}}
    print(f"{result['cpu']}; best of {args.rounds}")
    for model in args.models:
        try:
            r = result["models"][model] = measure(model, args.rounds)
        except TokenleapError as exc:  # an unknown name, a missing file
            ap.error(str(exc))
        print(f"  {model} ({r['class']}): convert_gguf {r['best_s']['convert_gguf']:.2f} s, AutoTokenizer "
              f"{r['best_s']['AutoTokenizer']:.2f} s ({r['speedup']:.1f}x), same files: {r['same_files']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["same_files"] for r in result["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
