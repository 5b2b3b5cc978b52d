"""How close a decode's quantized linears come to the memory's own read rate, against another commit's kernels.

Builds `benchmarks/quant_stream.c` (one row through a sequence of distinct cold weights of one
layer shape, then a plain two-thread read of 256 MB in the same moment) from this checkout's
kernel sources and, with `--baseline REV`, from that revision's, then runs the builds in turn
until `--seconds` are up (`--pages both`: each with the weights on 4 KiB pages and on transparent
huge pages, as the library keeps them). Each run gives the kernel's GB/s as a fraction of the read's; runs are
split by the read rate (this host's bandwidth swings between ~30 and ~55 GB/s within minutes,
and a kernel can keep up with the slow state and not with the fast one) and the medians are
reported per build, shape and state. The bar of issue 22 ("95 % of the memory floor") is this
fraction. JSON to `benchmarks/results/quant_stream.json`.

    .venv/bin/python benchmarks/quant_stream.py --baseline c558bad --shape llama-3.1-8b --types Q4_K --seconds 120
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernel_ab import revision_sources  # noqa: E402
from model_sizes import cpu_name, csv_of  # noqa: E402

from tokenleap.kernels.build import cpu_flags, kernel_flags, kernel_variant  # noqa: E402

KERNEL_DIR = ROOT / "src" / "tokenleap" / "kernels"
FORMATS = {"Q4_K": 5, "Q6_K": 6, "Q5_K": 7, "Q4_0": 3, "Q8_0": 2}  # quant.h's TLQ_* kernel formats
# a layer's QKV, gate+up and down, then the LM head ([out, in]), as the decode calls them
SHAPES = {"llama-3.2-1b": ((3072, 2048), (16384, 2048), (2048, 8192), (128256, 2048)),
          "llama-3.2-3b": ((5120, 3072), (16384, 3072), (3072, 8192), (128256, 3072)),
          "llama-3.1-8b": ((6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096)),
          "gemma3-4b": ((4096, 2560), (20480, 2560), (2560, 10240), (262144, 2560))}
_LINE = re.compile(r"gbps ([\d.]+) read ([\d.]+) ratio ([\d.]+) us_per_call ([\d.]+)")


def build(source_dir: Path, variant: str, out: Path, optimize: str = "-O3") -> Path:
    """Compile quant_stream.c against the kernel sources in `source_dir` for `variant` (`optimize`:
    the library's -O3 for timings; the tests build at -O1, a third of the compile time)."""
    source = "kernels.c" if variant == "avx512" else "kernels_avx2.c"
    compiler = shutil.which("gcc") or shutil.which("cc") or "cc"
    flags = [optimize if f == "-O3" else f for f in kernel_flags() if f not in ("-shared", "-fPIC")]
    subprocess.run([compiler, *flags, f"-I{source_dir}", f'-DKERNELS_SOURCE="{source}"',
                    str(ROOT / "benchmarks" / "quant_stream.c"), "-o", str(out), "-lm"],
                   check=True, capture_output=True, text=True)
    return out


def run_once(
    binary: Path, fmt: int, out_dim: int, in_dim: int, mb: float, rows: int, threads: int, huge: bool = True
) -> dict[str, float]:
    """One run: the kernel's and the read's best of 3, as quant_stream.c prints them (`huge`: the
    weights on transparent huge pages, as the library keeps them; else on 4 KiB pages)."""
    text = subprocess.run(
        [str(binary), str(fmt), str(out_dim), str(in_dim), str(mb), "3", str(rows), str(threads), str(int(huge))],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    m = _LINE.search(text)
    if m is None:
        raise RuntimeError(f"unexpected output from {binary.name}: {text!r}")
    return {"gbps": float(m[1]), "read": float(m[2]), "ratio": float(m[3]), "us_per_call": float(m[4])}


def summarize(runs: list[dict[str, float]], fast_gbps: float) -> dict[str, dict[str, float]]:
    """Median ratio, kernel rate and read rate per memory state ("fast": read > fast_gbps)."""
    out = {}
    for state in ("fast", "slow"):
        part = [r for r in runs if (r["read"] > fast_gbps) == (state == "fast")]
        if part:
            out[state] = {
                "n": len(part),
                **{k: statistics.median(r[k] for r in part) for k in ("ratio", "gbps", "read")},
            }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="git revision whose kernels to compare against (e.g. HEAD~1)")
    ap.add_argument("--types", type=csv_of(str), default="Q4_K,Q6_K")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mb", type=float, default=150.0, help="bytes of distinct weights per run")
    ap.add_argument("--seconds", type=float, default=60.0, help="per type and shape")
    ap.add_argument(
        "--fast-gbps", type=float, default=45.0, help="read rate above which a run counts as the fast memory state"
    )
    ap.add_argument(
        "--pages",
        choices=("huge", "4k", "both"),
        default="huge",
        help=(
            "the weights on transparent huge pages (as the library keeps them), on 4 KiB pages, "
            "or both in turn (an A/B)"
        ),
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quant_stream.json")
    args = ap.parse_args(argv)
    unknown = [t for t in args.types if t not in FORMATS]
    if unknown:
        ap.error(f"unknown type(s) {unknown}; choose from {sorted(FORMATS)}")
    variant = kernel_variant(cpu_flags())
    if variant is None:
        ap.error("no tokenleap kernels for this CPU")
    with tempfile.TemporaryDirectory() as tmp:
        binaries = {"current": build(KERNEL_DIR, variant, Path(tmp) / "current")}
        if args.baseline:
            try:
                src_dir = Path(tmp) / "baseline_src"
                src_dir.mkdir()
                src = revision_sources(args.baseline, src_dir)
                binaries = {"baseline": build(src, variant, Path(tmp) / "baseline"), **binaries}
            except subprocess.CalledProcessError as exc:
                ap.error(f"could not build the kernels of {args.baseline!r}: {(exc.stderr or '').strip()[:300]}")
        pages = {"huge": [True], "4k": [False], "both": [False, True]}[args.pages]
        cases = {(f"{label} {'huge' if huge else '4k'}" if len(pages) > 1 else label): (binary, huge)
                 for label, binary in binaries.items() for huge in pages}
        result = {
            "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "variant": variant, "threads": args.threads,
            "rows": args.rows, "baseline": args.baseline, "shape": args.shape, "pages": args.pages,
            "fast_gbps": args.fast_gbps, "cases": {}
        }
        print(f"{result['cpu']}, {variant} kernels, {args.threads} threads, {args.rows} row(s)", flush=True)
        for name in args.types:
            for out_dim, in_dim in SHAPES[args.shape]:
                runs: dict[str, list[dict[str, float]]] = {label: [] for label in cases}
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < args.seconds or not all(runs.values()):
                    for label, (binary, huge) in cases.items():
                        runs[label].append(
                            run_once(binary, FORMATS[name], out_dim, in_dim, args.mb, args.rows, args.threads, huge)
                        )
                key = f"{name} [{out_dim},{in_dim}]"
                result["cases"][key] = {label: summarize(r, args.fast_gbps) for label, r in runs.items()}
                for label, states in result["cases"][key].items():
                    text = "; ".join(
                        f"{s} (n={v['n']:.0f}): {v['ratio']:.3f} of the read ({v['gbps']:.1f} of {v['read']:.1f} GB/s)"
                        for s, v in states.items()
                    )
                    print(f"{key} {label}: {text}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
