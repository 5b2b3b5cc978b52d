"""The quantized linears' roofline per format and ISA: how many verify rows are free on this host.

For each kernel format (quant.h's TLQ_*) and each kernel variant this CPU can run (AVX2 always;
the AVX-512 one where the CPU has it), `benchmarks/quant_roofline.c` times one core's call of
`tl_linear_q` (the library's own kernel source) at 1..8 rows with the weight in cache (the
compute time) and streamed from memory (a new copy each call), and the memory's read rate per
core while both cores read. A row count is free when its in-cache time is under the time the
memory needs for the weight's bytes: verifying that many draft tokens then costs what one
decode step costs, in the linears. `--mno-avx512` adds an AVX2 build without AVX-512's 32
vector registers and EVEX forms, and without AVX-VNNI (what an AVX2-only CPU such as Zen 3
compiles), since on an AVX-512 host the library's AVX2 variant is compiled with `-march=native`.

    .venv/bin/python benchmarks/quant_roofline.py --mno-avx512
    .venv/bin/python benchmarks/quant_roofline.py --types Q4_K,Q6_K --rows 1,2,4,8 --variants avx2

Writes a table to stdout and JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name, csv_of  # noqa: E402

from tokenleap.kernels.build import cpu_flags, kernel_flags, kernel_variant  # noqa: E402
from tokenleap.kernels.formats import FORMATS as FORMAT_TABLE  # noqa: E402

KERNEL_DIR = ROOT / "src" / "tokenleap" / "kernels"
# GGUF type -> quant.h's kernel format (the table's rows)
FORMATS = {f.name: f.kernel_id for f in FORMAT_TABLE}
SHAPE = (256, 2048)  # [out, in]: 0.15-0.54 MB of weights, in one core's L2 on every host here
_READ = re.compile(r"read_gbps_per_core ([\d.]+)")
_ROW = re.compile(r"rows (\d+) hot_ns ([\d.]+) cold_ns ([\d.]+) bytes (\d+)")


def build(variant: str, out: Path, no_avx512: bool = False, optimize: str = "-O3") -> Path:
    """Compile quant_roofline.c against this checkout's kernels for `variant` (`optimize`: the
    library's -O3 for timings; the tests build at -O1, a third of the compile time)."""
    source = "kernels.c" if variant == "avx512" else "kernels_avx2.c"
    compiler = shutil.which("gcc") or shutil.which("cc") or "cc"
    flags = [optimize if f == "-O3" else f for f in kernel_flags() if f not in ("-shared", "-fPIC")]
    flags += ["-mno-avx512f", "-mno-avxvnni"] if no_avx512 else []  # Zen 3 has neither
    subprocess.run([compiler, *flags, f"-I{KERNEL_DIR}", f'-DKERNELS_SOURCE="{source}"',
                    str(ROOT / "benchmarks" / "quant_roofline.c"), "-o", str(out), "-lm"],
                   check=True, capture_output=True, text=True)
    return out


def run(binary: Path, fmt: int, rows: list[int]) -> dict[str, Any]:
    """One run of the binary: the read rate per core and each row count's hot and cold times."""
    text = subprocess.run([str(binary), str(fmt), str(SHAPE[0]), str(SHAPE[1]), *map(str, rows)],
                          check=True, capture_output=True, text=True, timeout=900).stdout
    read = _READ.search(text)
    if read is None:
        raise RuntimeError(f"unexpected output from {binary.name}: {text!r}")
    out: dict[str, Any] = {"read_gbps_per_core": float(read[1]), "rows": {}}
    for m in _ROW.finditer(text):
        out["bytes"] = int(m[4])
        out["rows"][int(m[1])] = {"hot_ns": float(m[2]), "cold_ns": float(m[3])}
    return out


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    """Memory time of the weight's bytes, each row count's compute / memory ratio, the free rows."""
    memory_ns = r["bytes"] / r["read_gbps_per_core"]
    one_cold = r["rows"][min(r["rows"])]["cold_ns"]
    per = {
        n: {**v, "compute_over_memory": v["hot_ns"] / memory_ns, "cold_over_one_row": v["cold_ns"] / one_cold}
        for n, v in r["rows"].items()
    }
    free = max((n for n, v in per.items() if v["compute_over_memory"] <= 1.0), default=0)
    return {
        "memory_ns": memory_ns,
        "free_rows": free,
        "rows": per,
        "read_gbps_per_core": r["read_gbps_per_core"],
        "bytes": r["bytes"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", type=csv_of(str), default=",".join(FORMATS))
    ap.add_argument("--rows", type=csv_of(int), default="1,2,3,4,5,8")
    ap.add_argument("--variants", type=csv_of(str), default="", help="avx2, avx512 (default: every one this CPU runs)")
    ap.add_argument(
        "--mno-avx512",
        action="store_true",
        help="also an AVX2 build without AVX-512 or AVX-VNNI (16 registers: Zen 3's code)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quant_roofline.json")
    args = ap.parse_args(argv)
    unknown = [t for t in args.types if t not in FORMATS]
    if unknown:
        ap.error(f"unknown type(s) {unknown}; choose from {', '.join(FORMATS)}")
    if not args.rows or any(n < 1 or n > 64 for n in args.rows):
        ap.error("--rows must be in 1..64")
    best = kernel_variant(cpu_flags())
    if best is None:
        ap.error("no tokenleap kernels for this CPU")
    variants = [v for v in args.variants if v] or (["avx2", "avx512"] if best == "avx512" else ["avx2"])
    if any(v not in ("avx2", "avx512") for v in variants):
        ap.error("--variants: avx2 and/or avx512")
    if "avx512" in variants and best != "avx512":
        ap.error("this CPU has no AVX-512 kernels")
    rows = sorted(set(args.rows) | {1})
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "shape": SHAPE, "cases": {}}
    print(
        f"{result['cpu']}; one core, [{SHAPE[0]}, {SHAPE[1]}] weights; "
        "compute = in-cache time, memory = the bytes at the read rate per core"
    )
    with tempfile.TemporaryDirectory() as tmp:
        builds = {v: build(v, Path(tmp) / v) for v in variants}
        if args.mno_avx512 and best == "avx512":
            builds["avx2 -mno-avx512f"] = build("avx2", Path(tmp) / "avx2_strict", no_avx512=True)
        header = " | ".join(f"{n} rows" for n in rows)
        print(f"| build | type | read GB/s/core | {header} | free rows |")
        print("| --- | --- | --- | " + " | ".join("---" for _ in rows) + " | --- |")
        for label, binary in builds.items():
            for name in args.types:
                s = summarize(run(binary, FORMATS[name], rows))
                result["cases"][f"{label} {name}"] = s
                cells = " | ".join(
                    f"{s['rows'][n]['compute_over_memory']:.2f} ({s['rows'][n]['cold_over_one_row']:.2f})" for n in rows
                )
                print(f"| {label} | {name} | {s['read_gbps_per_core']:.1f} | {cells} | {s['free_rows']} |", flush=True)
    print("cells: in-cache time / memory time (streamed time / one row's streamed time)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
