"""Static cycle counts of the quantized linears' inner loops for a CPU this host is not (llvm-mca).

Compiles the AVX2 kernel variant (`kernels_avx2.c`, of this checkout or of a git revision) for
`-march=CPU`, splits one K-quant function's assembly into basic blocks and has `llvm-mca` model
each block that holds `vpmaddubsw` (one block of 32 inputs x 8 outputs for 1..8 rows): cycles per
block and per multiply. Used where the day's host is not the CPU the code is for (Zen 3's
broadcasts take an FP pipe, Intel's do not): a prediction to check on the real CPU, never a
measured figure.

    .venv/bin/python benchmarks/kernel_mca.py --cpu znver3 --function qk_groups_q4k --baseline f2a8540

With `--read-gbs` (the memory's read rate per core while every core reads) and `--ghz` it also puts
each row count's fastest block against the cycles the memory takes to bring that block in: which
row counts the model says are free on that host (a roofline predicted, to check there):

    .venv/bin/python benchmarks/kernel_mca.py --cpu znver3 --read-gbs 10.5 --ghz 3.3 \
        --function qk_groups_q4k,qk_groups_q5k,qk_groups_q6k,q_groups_xb_q40,q_groups_xb_q50
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernel_ab import revision_sources  # noqa: E402

KERNEL_DIR = ROOT / "src" / "tokenleap" / "kernels"


def assembly(source_dir: Path, cpu: str, out: Path, defines: list[str], functions: list[str] | None = None) -> str:
    """The AVX2 variant's assembly for -march=cpu; only the K-quants' unit (`quant_k.c`, about half
    the compile) when every function wanted is one of its groups functions and the sources have it."""
    compiler = shutil.which("gcc") or "cc"
    k_only = bool(functions) and all(f.startswith("qk_groups_") for f in functions or [])
    source = source_dir / ("quant_k.c" if k_only and (source_dir / "quant_k.c").exists() else "kernels_avx2.c")
    subprocess.run([compiler, "-O3", f"-march={cpu}", "-ffp-contract=off", "-pthread", "-std=gnu11", "-fPIC", *defines,
                    "-S", str(source), "-o", str(out)],
                   check=True, capture_output=True, text=True)
    return out.read_text()


def blocks(asm: str, function: str) -> list[list[str]]:
    """The function's basic blocks (split at labels and after jumps); `function` may have lost a
    part to GCC's partial inlining (q_run -> q_run.part.0)."""
    lines = asm.split("\n")
    label = re.compile(rf"{re.escape(function)}(\.part\.\d+)?:")
    start = next((i for i, line in enumerate(lines) if label.fullmatch(line)), None)
    if start is None:
        raise ValueError(f"no function {function} in the assembly (inlined, or not in this build)")
    name = lines[start][:-1]
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(f"\t.size\t{name},"))
    out: list[list[str]] = []
    cur: list[str] = []
    for line in lines[start + 1 : end]:
        s = line.strip()
        if re.match(r"^\.L\w+:", line):
            out.append(cur)
            cur = []
        elif s and not s.startswith("."):
            cur.append(line)
            if s.startswith("j"):
                out.append(cur)
                cur = []
    out.append(cur)
    return out


def model(asm: str, function: str, cpu: str) -> list[dict[str, Any]]:
    rows = []
    for b in blocks(asm, function):
        n = sum("vpmaddubsw" in line for line in b)
        if not n:
            continue
        text = "\n".join(line for line in b if not line.strip().startswith("j"))
        out = subprocess.run(
            ["llvm-mca", f"-mcpu={cpu}", "-iterations=200"], input=text, capture_output=True, text=True, check=True
        ).stdout
        m = re.search(r"Total Cycles:\s+(\d+)", out)
        if m is None:
            raise RuntimeError(f"unexpected llvm-mca output: {out[:300]!r}")
        cycles = int(m[1]) / 200
        rows.append({"maddubs": n, "broadcasts": sum("vpbroadcastd" in line for line in b), "instructions": len(b),
                     "cycles": cycles, "cycles_per_maddubs": cycles / n})
    return sorted(rows, key=lambda r: -r["maddubs"])


# bytes of one block (32 inputs x 8 outputs) of the format a function's tiles read
BLOCK_BYTES = {"qk_groups_q4k": 144, "qk_groups_q5k": 176, "qk_groups_q6k": 210, "q_groups_xb_q40": 144,
               "q_groups_xb_q50": 176}


def roofline(rows: list[dict[str, Any]], block_bytes: int, read_gbs: float, ghz: float) -> dict[str, Any]:
    """Each row count's fastest block against the memory's cycles for the block's bytes (at
    read_gbs per core and ghz): compute over memory, the linear's predicted cost over one row's
    (each block takes the longer of the two), and the free rows (compute under memory, from one row
    up; a function with no one-row tile, from its fewest rows)."""
    memory = block_bytes / (read_gbs / ghz)
    best: dict[int, float] = {}
    for r in rows:
        if r["maddubs"] % 8 == 0:
            n = r["maddubs"] // 8
            best[n] = min(best.get(n, float("inf")), r["cycles"])
    one = max(best.get(1, 0.0), memory)  # no one-row tile (the run-major ones): one row at the memory's time
    out = {n: {"cycles": c, "over_memory": c / memory, "over_one_row": max(c, memory) / one}
           for n, c in sorted(best.items())}
    free = 0
    for n in sorted(out):
        if out[n]["over_memory"] > 1.0:
            break
        free = n
    return {"memory_cycles": memory, "rows": out, "free_rows": free}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", default="znver3", help="an -march / -mcpu name (znver3, skylake-avx512, haswell, ...)")
    ap.add_argument("--function", default="qk_groups_q4k",
                    help="qk_groups_q4k, qk_groups_q5k, qk_groups_q6k; q_groups_xb_q40, q_groups_xb_q50 (the 32-input "
                         "formats' run-major tiles); q_run (every 32-input tile, the group-major ones with "
                         "broadcasts); several, comma-separated, from one compile")
    ap.add_argument("--read-gbs", type=float, help="the memory's read rate per core (GB/s, every core reading): "
                    "put each block against its read time (needs --ghz)")
    ap.add_argument("--ghz", type=float, help="the core's clock under load (GHz), for --read-gbs")
    ap.add_argument("--baseline", help="a git revision whose kernels to model beside this checkout's")
    ap.add_argument("--define", action="append", default=[], help="a -D for the compiler (NAME or NAME=VALUE)")
    ap.add_argument("--out", type=Path, default=None, help="JSON")
    args = ap.parse_args(argv)
    functions = [f for f in args.function.split(",") if f]
    given = args.read_gbs is not None
    if given != (args.ghz is not None) or given and (args.read_gbs <= 0 or args.ghz <= 0):
        ap.error("--read-gbs and --ghz go together, both positive")
    if args.read_gbs is not None and (unknown := [f for f in functions if f not in BLOCK_BYTES]):
        ap.error(f"no block size known for {', '.join(unknown)} (one format a function: {', '.join(BLOCK_BYTES)})")
    if shutil.which("llvm-mca") is None:
        ap.error("llvm-mca is not installed (Debian: apt-get install llvm)")
    defines = [f"-D{d}" for d in args.define]
    result: dict[str, Any] = {"cpu": args.cpu, "functions": functions, "defines": args.define, "builds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"current": KERNEL_DIR}
        if args.baseline:
            src = Path(tmp) / "baseline"
            src.mkdir()
            sources = {"baseline": revision_sources(args.baseline, src), **sources}
        for label, folder in sources.items():
            asm = assembly(folder, args.cpu, Path(tmp) / f"{label}.s", defines, functions)
            try:
                result["builds"][label] = {f: model(asm, f, args.cpu) for f in functions}
            except ValueError as exc:
                ap.error(f"{label}: {exc}")
    print(f"llvm-mca -mcpu={args.cpu}: cycles per block of 32 inputs x 8 outputs (a prediction, not a measurement)")
    for label, by_function in result["builds"].items():
        for function, rows in by_function.items():
            print(
                f"  {label} {function}: "
                + ", ".join(
                    f"{r['maddubs'] // 8} rows {r['cycles']:.1f}"
                    + (f" ({r['broadcasts']} broadcasts)" if r["broadcasts"] else "")
                    for r in rows
                    if r["maddubs"] % 8 == 0
                )
            )
    if args.read_gbs is not None:
        print(f"against the memory at {args.read_gbs:g} GB/s a core and {args.ghz:g} GHz "
              "(each row count's fastest block; the linear's cost over one row's; free: compute under memory)")
        result["roofline"] = {"read_gbs": args.read_gbs, "ghz": args.ghz, "builds": {}}
        for label, by_function in result["builds"].items():
            lines = result["roofline"]["builds"][label] = {}
            for function, rows in by_function.items():
                rf = lines[function] = roofline(rows, BLOCK_BYTES[function], args.read_gbs, args.ghz)
                print(f"  {label} {function}: memory {rf['memory_cycles']:.1f} cycles a block, "
                      f"free rows {rf['free_rows']}; "
                      + ", ".join(f"{n} rows {v['over_memory']:.2f} of memory, {v['over_one_row']:.2f}x one row"
                                  for n, v in rf["rows"].items() if n in (1, 2, 4, 6, 8)))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
