"""Plain decoding against llama.cpp in back-to-back pairs, each tagged with the memory's read rate.

This host's memory bandwidth swings between two states within minutes (~33 and ~55 GB/s on the
Zen 4 machine), and decoding a 1B-8B model moves with it, so one tokenleap run and one
llama-bench run minutes apart can compare two different machines. Here one process loads the
file once and then, `--pairs` times: measures the read rate (`model_sizes.read_bandwidth`),
decodes `--tokens` forced tokens after a one-token prompt (as `model_sizes.tg`: llama-bench's
tg), runs `llama-bench -p 0 -n TOKENS -r 1` on the same file and threads, and measures the read
rate again. The order within a pair alternates. A pair whose two read rates fall on the same
side of `--fast-gbps` counts for that state; the ratio tokenleap / llama.cpp is reported per
pair, with medians per state, and so is each side's share of the memory floor (the issue's
alternative bar): the speed the pair's mean read rate allows when a step reads the bytes it
must (`weight_bytes_per_token`: every linear and the LM head, as stored). JSON to `benchmarks/results/tg_pairs.json`.

    .venv/bin/python benchmarks/tg_pairs.py M/llama-3.1-8b-Q4_K_M.gguf --llama-bench B --pairs 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name, read_bandwidth, tg  # noqa: E402
from quant_decode import llama_bench  # noqa: E402

from tokenleap import LLM  # noqa: E402


def pair(llm: LLM, bench: str, path: Path, threads: int, tokens: int, ours_first: bool,
         extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One back-to-back pair with the read rate before and after it (`extra`: more llama-bench
    flags), and both sides as a share of the memory floor."""
    before = read_bandwidth(3)
    if ours_first:
        ours = tg(llm, tokens, repeats=1)
    peer = llama_bench(bench, path, threads, gen=str(tokens), repeats=1, extra=extra)
    if not ours_first:
        ours = tg(llm, tokens, repeats=1)
    after = read_bandwidth(3)
    if not isinstance(peer, float):
        raise RuntimeError("llama-bench gave no tg figure")
    floor = (before + after) / 2 * 1e9 / llm.model.weight_bytes_per_token()  # tok/s at the read rate
    return {"read_before": before, "read_after": after, "tokenleap": ours, "llama_cpp": peer, "ratio": ours / peer,
            "order": "tokenleap first" if ours_first else "llama.cpp first", "floor_tok_s": floor,
            "tokenleap_of_floor": ours / floor, "llama_cpp_of_floor": peer / floor}


def summarize(pairs: list[dict[str, Any]], fast_gbps: float) -> dict[str, dict[str, float]]:
    """Median ratio and speeds per memory state (pairs straddling a switch count for neither)."""
    out: dict[str, dict[str, float]] = {}
    for state in ("fast", "slow"):
        part = [p for p in pairs if all((p[k] > fast_gbps) == (state == "fast") for k in ("read_before", "read_after"))]
        if part:
            out[state] = {"pairs": len(part), "ratio": statistics.median(p["ratio"] for p in part),
                          "tokenleap": statistics.median(p["tokenleap"] for p in part),
                          "llama_cpp": statistics.median(p["llama_cpp"] for p in part),
                          "read_gbps": statistics.median((p["read_before"] + p["read_after"]) / 2 for p in part)}
            if all("tokenleap_of_floor" in p for p in part):
                out[state]["tokenleap_of_floor"] = statistics.median(p["tokenleap_of_floor"] for p in part)
                out[state]["llama_cpp_of_floor"] = statistics.median(p["llama_cpp_of_floor"] for p in part)
    out["all"] = {"pairs": len(pairs), "ratio": statistics.median(p["ratio"] for p in pairs)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="GGUF files (benchmarks/make_gguf.py)")
    ap.add_argument("--llama-bench", required=True, help="llama-bench binary (benchmarks/build_llamacpp.sh)")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--fast-gbps", type=float, default=45.0, help="read rate above which a pair counts as the fast memory state"
    )
    ap.add_argument(
        "--llama-args",
        default="",
        help='more llama-bench flags, e.g. "-mmp 0" (weights read into memory instead of mapped)',
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tg_pairs.json")
    args = ap.parse_args(argv)
    extra = tuple(args.llama_args.split())
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        ap.error(f"no such file(s): {missing}")
    if not Path(args.llama_bench).is_file():
        ap.error(f"no llama-bench at {args.llama_bench} (build it: benchmarks/build_llamacpp.sh)")
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "threads": args.threads, "tokens": args.tokens,
        "fast_gbps": args.fast_gbps, "llama_args": list(extra), "command": " ".join(sys.argv), "files": {}
    }
    print(result["cpu"], flush=True)
    for path in args.files:
        llm = LLM(model=str(path))
        tg(llm, 16, repeats=1)  # warm up
        pairs = []
        for i in range(args.pairs):
            try:
                p = pair(llm, args.llama_bench, path, args.threads, args.tokens, ours_first=i % 2 == 0, extra=extra)
            except RuntimeError as exc:  # llama-bench failed (its stderr is printed above)
                print(f"tg_pairs: {path.name}: {exc}", file=sys.stderr)
                return 1
            pairs.append(p)
            print(f"  {path.name} pair {i + 1}: tokenleap {p['tokenleap']:.2f} vs llama.cpp {p['llama_cpp']:.2f} tok/s "
                  f"({p['ratio']:.2f}x), read {p['read_before']:.0f} / {p['read_after']:.0f} GB/s, "
                  f"of the floor {p['tokenleap_of_floor']:.2f} / {p['llama_cpp_of_floor']:.2f}", flush=True)
        summary = summarize(pairs, args.fast_gbps)
        result["files"][path.name] = {"pairs": pairs, "summary": summary}
        for state, s in summary.items():
            print(f"{path.name} {state}: " + ", ".join(f"{k} {v:.3g}" for k, v in s.items()), flush=True)
        del llm
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
