"""Static cycle counts of the quantized linears' inner loops for a CPU this host is not (llvm-mca).

Compiles the AVX2 kernel variant (`kernels_avx2.c`, of this checkout or of a git revision) for
`-march=CPU`, splits one K-quant function's assembly into basic blocks and has `llvm-mca` model
each block that holds `vpmaddubsw` (one block of 32 inputs x 8 outputs for 1..8 rows): cycles per
block and per multiply. Used where the day's host is not the CPU the code is for (Zen 3's
broadcasts take an FP pipe, Intel's do not): a prediction to check on the real CPU, never a
measured figure.

    .venv/bin/python benchmarks/kernel_mca.py --cpu znver3 --function qk_groups_q4k --baseline f2a8540
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


def assembly(source_dir: Path, cpu: str, out: Path, defines: list[str]) -> str:
    compiler = shutil.which("gcc") or "cc"
    subprocess.run([compiler, "-O3", f"-march={cpu}", "-ffp-contract=off", "-pthread", "-std=gnu11", "-fPIC", *defines,
                    "-S", str(source_dir / "kernels_avx2.c"), "-o", str(out)],
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", default="znver3", help="an -march / -mcpu name (znver3, skylake-avx512, haswell, ...)")
    ap.add_argument("--function", default="qk_groups_q4k",
                    help="qk_groups_q4k, qk_groups_q5k, qk_groups_q6k; q_groups_xb_q40, q_groups_xb_q50 (the 32-input "
                         "formats' run-major tiles); q_run (every 32-input tile, the group-major ones with broadcasts)")
    ap.add_argument("--baseline", help="a git revision whose kernels to model beside this checkout's")
    ap.add_argument("--define", action="append", default=[], help="a -D for the compiler (NAME or NAME=VALUE)")
    ap.add_argument("--out", type=Path, default=None, help="JSON")
    args = ap.parse_args(argv)
    if shutil.which("llvm-mca") is None:
        ap.error("llvm-mca is not installed (Debian: apt-get install llvm)")
    defines = [f"-D{d}" for d in args.define]
    result: dict[str, Any] = {"cpu": args.cpu, "function": args.function, "defines": args.define, "builds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"current": KERNEL_DIR}
        if args.baseline:
            src = Path(tmp) / "baseline"
            src.mkdir()
            sources = {"baseline": revision_sources(args.baseline, src), **sources}
        for label, folder in sources.items():
            try:
                result["builds"][label] = model(
                    assembly(folder, args.cpu, Path(tmp) / f"{label}.s", defines), args.function, args.cpu
                )
            except ValueError as exc:
                ap.error(f"{label}: {exc}")
    print(
        f"llvm-mca -mcpu={args.cpu}, {args.function}: cycles per block of 32 inputs x 8 outputs "
        "(a prediction, not a measurement)"
    )
    for label, rows in result["builds"].items():
        print(
            f"  {label}: "
            + ", ".join(
                f"{r['maddubs'] // 8} rows {r['cycles']:.1f}"
                + (f" ({r['broadcasts']} broadcasts)" if r["broadcasts"] else "")
                for r in rows
                if r["maddubs"] % 8 == 0
            )
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
