"""Sampled token-tree speculation: the whole tree (lossless multi-candidate verification,
`verify/tree_sampling.py`) against its first path only, a prompt-lookup chain and plain decoding.

Spec-Bench first turns (`--num-prompts`, default 8, the six groups in turn), the model's chat
template, temperature 0.7 (`--temperature`), seeds 0..`--seeds`-1 (default 3: each seed is a
full pass, so acceptance is averaged over more sampled text), `--max-tokens` (default 128).
Methods, run back to back on one loaded model by `tokenleap.bench.run_bench` (which rotates the
order per prompt so drift hits all alike, and shares one measured cost curve):

* `ngram-tree`: prompt lookup as a token tree (`drafters/lookup_tree.py`), every branch verified;
* `ngram-tree/first-path`: the same trees, reduced to their first root path (what sampled
  requests did before);
* `ngram`: prompt lookup as a chain;
* `plain`.

A seeded sampled request drafts a fixed number of tokens (`--draft-max`, default 8: no
adaptive length, whose timing-driven choices would change the text). Reports per method the
mean acceptance length (tokens per target forward), decode-phase and end-to-end tokens/s and
their ratios to plain. Sampled outputs differ between methods (each consumes the random stream
its own way); each is a sample from the target's distribution.

    .venv/bin/python benchmarks/tree_sampling.py                      # -> results/tree_sampling.json
    .venv/bin/python benchmarks/tree_sampling.py -n 2 --max-tokens 16 --seeds 1 --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tokenleap import LLM, SpecConfig
from tokenleap.bench import default_spec_bench, load_questions, run_bench, summarize

RESULTS = Path(__file__).resolve().parent / "results"
console = Console(width=None if sys.stdout.isatty() else 130)


def methods(draft_max: int) -> dict[str, SpecConfig]:
    return {
        "ngram-tree": SpecConfig(method="ngram-tree", num_speculative_tokens=draft_max),
        "ngram-tree/first-path": SpecConfig(
            method="ngram-tree", num_speculative_tokens=draft_max, sampled_tree="first-path"
        ),
        "ngram": SpecConfig(method="ngram", num_speculative_tokens=draft_max),
    }


def pick_questions(path: Path, n: int) -> list:  # type: ignore[type-arg]
    """n questions, the groups in turn."""
    pool = load_questions(path, per_group=n)
    by_group: dict[str, list] = {}  # type: ignore[type-arg]
    for q in pool:
        by_group.setdefault(q.group, []).append(q)
    chosen = []
    while len(chosen) < n and any(by_group.values()):
        for qs in by_group.values():
            if qs and len(chosen) < n:
                chosen.append(qs.pop(0))
    return [type(q)(q.question_id, q.group, q.turns[:1], q.assistant_prefix, q.stop, q.max_tokens) for q in chosen]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("-n", "--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--draft-max", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--questions", default=str(default_spec_bench()))
    parser.add_argument("--out", default=str(RESULTS / "tree_sampling.json"))
    args = parser.parse_args()
    if args.temperature <= 0:
        raise SystemExit("error: --temperature must be > 0 (this compares sampled verification)")
    llm = LLM()
    questions = pick_questions(Path(args.questions), args.num_prompts)
    t0 = time.perf_counter()
    records = []
    for seed in range(args.seeds):
        records += run_bench(
            llm.model, llm.tokenizer, questions, methods(args.draft_max), args.max_tokens, args.temperature, seed=seed
        )
    summary = summarize(records)["overall"]
    table = Table(
        title=(
            f"{len(questions)} Spec-Bench prompts x {args.seeds} seeds, {args.max_tokens} new tokens, "
            f"temperature {args.temperature}, draft {args.draft_max} ({time.perf_counter() - t0:.0f} s)"
        )
    )
    for col in ("method", "acceptance length", "decode tok/s", "decode vs plain", "end-to-end tok/s", "e2e vs plain"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for name in ("plain", *methods(args.draft_max)):
        f = summary[name]
        table.add_row(name, f"{f['mean_acceptance_length']:.2f}", f"{f['decode_tokens_per_second']:.1f}",
                      f"{f['decode_speedup']:.2f}x", f"{f['tokens_per_second']:.1f}", f"{f['speedup']:.2f}x")
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: getattr(args, k) for k in ("num_prompts", "max_tokens", "temperature", "draft_max", "seeds")}
    out.write_text(json.dumps({"meta": meta, "overall": summary, "records": [r.__dict__ for r in records]}, indent=1))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
