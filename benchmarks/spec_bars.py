"""Issue 37's speculation bars on this host in one command: every measurement the bars name, run
by the benchmark that owns it (each its own process, its JSON into `--out-dir`), then one table of
bar, threshold, what this host measured and whether it is met.

Parts (`--parts`, all by default):

* `rows`: `forward_rows.py FILE --rows 1,4,8` on each bar file (`--files`: the Llama-3.2-1B and -3B
  Q4_K_M and Qwen2.5-1.5B Q5_K_M shapes `make_gguf.py` writes): a forward of 4 rows <= 1.3x one
  row, of 8 rows <= 1.6x (the best round's ratio; a forward's ratio moves with the memory speed of
  the moment, so the median is printed beside it);
* `replay`: `model_sizes.py --replay --replay-lengths 4` on the Q4_K_M files: perfect drafts of 4
  >= 3x plain, every output identical;
* `draft`: `draft_cost.py` on the real pair over its whole vocabulary and reduced ones (32,768, the
  benchmarks' draft-model setting, and 16,384): the draft's step <= 0.3 of the target's (the
  cheapest; the others beside it);
* `pair`: `tokenleap bench` on the real pair, greedy, `--rounds 3` (methods interleaved prompt by
  prompt): HumanEval (code completions), code edits and Spec-Bench (open chat): the best
  speculative method >= 1.6x / 2x / 0.97x plain end to end, the draft model >= 1.2x on code
  completions and >= 0.97x on open chat, every output identical to plain;
* `server`: `pair_server.py` with `--llama-server BIN`: tokenleap's best speculation >= 1.3x
  llama.cpp's best, every configuration resident and taking turns prompt by prompt (skipped
  without a binary).

`--kernels avx2` runs every part on the AVX2 variant (`TOKENLEAP_KERNELS`; an AVX-512 host runs
it too), `--march CPU` with another CPU's code (`TOKENLEAP_KERNEL_MARCH`, e.g. `znver3`: what an
AVX2-only AMD host compiles). `--summarize` prints the table from a directory of earlier results
without running anything; `--dry-run` prints the commands. The whole run takes about an hour on
2 cores.

    .venv/bin/python benchmarks/spec_bars.py --kernels avx2 --out-dir benchmarks/results/bars_avx2
    .venv/bin/python benchmarks/spec_bars.py --summarize --out-dir benchmarks/results/bars_avx2
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name, csv_of  # noqa: E402

PARTS = ("rows", "replay", "draft", "pair", "server")
MODELS = ROOT / "benchmarks" / ".peer" / "models"
BAR_FILES = ("llama-3.2-1b-Q4_K_M.gguf", "llama-3.2-3b-Q4_K_M.gguf", "qwen2.5-1.5b-Q5_K_M.gguf")
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
DRAFT_METHOD = "draft-model:draft_vocab=32768"
DATA = ROOT / "benchmarks" / "data"
# the real pair's workloads: (result name, `tokenleap bench` arguments, methods)
PAIR_RUNS = (
    ("pair_humaneval", ["--input", str(DATA / "humaneval.jsonl"), "-q", "6", "-n", "128", "--draft-max", "4"],
     f"{DRAFT_METHOD},suffix"),
    ("pair_codeedit", ["--input", str(DATA / "code_edit.jsonl"), "-q", "3", "-n", "128"], "suffix"),
    ("pair_specbench", ["-q", "1", "-n", "64", "--draft-max", "4"], f"{DRAFT_METHOD},suffix"),
)
PAIR_BARS = {  # result name: (workload, best method's bar, the draft model's bar or None)
    "pair_humaneval": ("code completions", 1.6, 1.2),
    "pair_codeedit": ("code edits", 2.0, None),
    "pair_specbench": ("open chat", 0.97, 0.97),
}


@dataclass(frozen=True)
class Bar:
    """One bar: what it is, `measured` against `threshold` (`at_most`: measured <= threshold),
    `note` for what else the table should say (a median, a source)."""

    name: str
    threshold: float
    at_most: bool
    measured: float | None
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured <= self.threshold if self.at_most else self.measured >= self.threshold


def _python(script: str, *args: str) -> list[str]:
    return [sys.executable, str(ROOT / "benchmarks" / script), *args]


def commands(parts: list[str], files: list[Path], out: Path, rounds: int, llama_server: str | None) -> list[list[str]]:
    """The benchmark commands the chosen parts run, in order."""
    cmds: list[list[str]] = []
    if "rows" in parts:
        for f in files:
            cmds.append(_python("forward_rows.py", str(f), "--rows", "1,4,8", "--rounds", str(rounds),
                                "--out", str(out / f"rows_{f.stem}.json")))
    if "replay" in parts:
        q4 = [str(f) for f in files if "Q4_K_M" in f.name]
        if q4:
            cmds.append(_python("model_sizes.py", *q4, "--replay", "--replay-lengths", "4", "--replay-rounds", "3",
                                "--out", str(out / "replay.json")))
    if "draft" in parts:
        cmds.append(_python("draft_cost.py", TARGET, DRAFT, "--vocab", "0,32768,16384",
                            "--out", str(out / "draft_cost.json")))
    if "pair" in parts:
        tokenleap = str(Path(sys.executable).with_name("tokenleap"))
        for name, args, methods in PAIR_RUNS:
            cmds.append([tokenleap, "bench", "-m", TARGET, "-md", DRAFT, *args, "--rounds", "3", "--methods", methods,
                         "--out", str(out / f"{name}.json")])
    if "server" in parts and llama_server:
        cmds.append(_python("pair_server.py", "--llama-server", llama_server, "-q", "6",
                            "--out", str(out / "pair_server.json")))
    return cmds


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def bars(out: Path, files: list[Path]) -> list[Bar]:
    """Every bar with what the results in `out` say (measured None where a result is missing)."""
    table: list[Bar] = []
    for f in files:
        cases = (_load(out / f"rows_{f.stem}.json") or {}).get("cases", {})
        for rows, limit in ((4, 1.3), (8, 1.6)):
            c = cases.get(f"{rows} rows")
            table.append(Bar(f"{f.stem}: a forward of {rows} rows / one row", limit, True,
                             c["best_rel"] if c else None, f"median {c['median_rel']:.2f}x" if c else ""))
    replay = _load(out / "replay.json") or {}
    for row in replay.get("rows", []):
        perfect = [r for r in row.get("replay", {}).get("rows", []) if r["k"] == 4 and r["p"] == 1.0]
        if perfect:
            r = perfect[0]
            table.append(Bar(f"{Path(row['file']).stem}: perfect drafts of 4 / plain", 3.0, False, r["speedup"],
                             "identical" if r["identical"] else "OUTPUT DIFFERS"))
    if not replay:
        table.append(Bar("perfect drafts of 4 / plain", 3.0, False, None))
    vocabs = (_load(out / "draft_cost.json") or {}).get("vocabularies") or {}
    cheapest = min(vocabs, key=lambda v: vocabs[v]["ratio_best"]) if vocabs else None
    others = ", ".join(f"{v}: {c['ratio_best']:.3f}" for v, c in vocabs.items() if v != cheapest)
    table.append(Bar("the draft's step / the target's", 0.3, True, vocabs[cheapest]["ratio_best"] if cheapest else None,
                     f"draft_vocab {cheapest} (0: the whole); {others}" if cheapest else ""))
    for name, (workload, best_bar, draft_bar) in PAIR_BARS.items():
        summary = ((_load(out / f"{name}.json") or {}).get("summary") or {}).get("overall", {})
        spec = {m: s for m, s in summary.items() if m != "plain"}
        same = all(s["matched_plain"] == s["prompts"] for s in spec.values())
        best = max(spec, key=lambda m: spec[m]["speedup"]) if spec else None
        table.append(Bar(f"{workload}: the best speculation / plain", best_bar, False,
                         spec[best]["speedup"] if best else None,
                         (f"{best}; " + ("every output identical" if same else "OUTPUT DIFFERS")) if best else ""))
        if draft_bar is not None:
            dm = spec.get(DRAFT_METHOD)
            table.append(Bar(f"{workload}: the draft model / plain", draft_bar, False, dm["speedup"] if dm else None))
    server = (_load(out / "pair_server.json") or {}).get("totals", {})
    ours = [t["tok_s"] for k, t in server.items() if k.startswith("tokenleap") and "plain" not in k]
    theirs = [t["tok_s"] for k, t in server.items() if k.startswith("llama-server") and "plain" not in k]
    table.append(Bar("tokenleap's best speculation / llama.cpp's best (server)", 1.3, False,
                     max(ours) / max(theirs) if ours and theirs else None))
    return table


def render(table: list[Bar]) -> str:
    lines = []
    for b in table:
        op = "<=" if b.at_most else ">="
        got = "not measured" if b.measured is None else f"{b.measured:.3f}"
        verdict = {True: "met", False: "MISSED", None: "-"}[b.met]
        lines.append(f"  {verdict:7} {b.name}: {got} (bar {op} {b.threshold:g}){'; ' + b.note if b.note else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=csv_of(str), default=",".join(PARTS), help=f"a comma list of {', '.join(PARTS)}")
    ap.add_argument("--files", type=csv_of(Path), default=",".join(str(MODELS / f) for f in BAR_FILES),
                    help="the bar's GGUF files (benchmarks/make_gguf.py)")
    ap.add_argument("--kernels", choices=["auto", "avx2", "avx512"], default="auto",
                    help="the kernel variant every part runs (TOKENLEAP_KERNELS)")
    ap.add_argument("--march", default=None, help="build the kernels for this GCC CPU name (TOKENLEAP_KERNEL_MARCH)")
    ap.add_argument("--rounds", type=int, default=5, help="forward_rows.py's rounds")
    ap.add_argument("--llama-server", default=None, help="a llama-server binary for the server part")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results" / "bars")
    ap.add_argument("--summarize", action="store_true", help="only print the table from --out-dir's results")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {', '.join(unknown)} (choose from {', '.join(PARTS)})")
    if args.rounds < 1:
        ap.error("--rounds must be positive")
    env = dict(os.environ)
    if args.kernels != "auto":
        env["TOKENLEAP_KERNELS"] = args.kernels
    if args.march:
        env["TOKENLEAP_KERNEL_MARCH"] = args.march
    cmds = commands(args.parts, args.files, args.out_dir, args.rounds, args.llama_server)
    if args.dry_run:
        prefix = " ".join(f"{k}={env[k]}" for k in ("TOKENLEAP_KERNELS", "TOKENLEAP_KERNEL_MARCH") if k in env)
        for c in cmds:
            print((prefix + " " if prefix else "") + shlex.join(c))
        return 0
    if not args.summarize:
        missing = [str(f) for f in args.files if not f.is_file()] if {"rows", "replay"} & set(args.parts) else []
        if missing:
            print(f"spec_bars: no such file: {', '.join(missing)}; make them with\n"
                  "  TARGETS=llama-quantize benchmarks/build_llamacpp.sh\n"
                  "  .venv/bin/python benchmarks/make_gguf.py --shape llama-3.2-1b,llama-3.2-3b --types Q4_K_M\n"
                  "  .venv/bin/python benchmarks/make_gguf.py --shape qwen2.5-1.5b --types Q5_K_M", file=sys.stderr)
            return 2
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for i, c in enumerate(cmds, 1):
            print(f"[{i}/{len(cmds)}] {shlex.join(c)}", flush=True)
            if subprocess.run(c, env=env, cwd=ROOT).returncode != 0:
                print("spec_bars: that command failed; the table below shows what finished", file=sys.stderr)
                break
    table = bars(args.out_dir, args.files)
    results = [_load(p) for p in args.out_dir.glob("*.json") if p.name != "bars.json"]
    hosts = sorted({r["cpu"] for r in results if r and isinstance(r.get("cpu"), str)})
    march = f", march {args.march}" if args.march else ""
    print(f"measured on {'; '.join(hosts) or 'nothing yet'}; kernels {args.kernels}{march}; "
          f"results in {args.out_dir} ({time.strftime('%Y-%m-%d %H:%M')})")
    print(render(table))
    if not args.out_dir.is_dir():
        return 0
    (args.out_dir / "bars.json").write_text(json.dumps(
        {"cpu": cpu_name(), "kernels": args.kernels, "march": args.march,
         "bars": [{"name": b.name, "threshold": b.threshold, "at_most": b.at_most, "measured": b.measured,
                   "met": b.met, "note": b.note} for b in table]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
