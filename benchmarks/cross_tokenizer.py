"""Drafting across tokenizers: SmolLM2-135M-Instruct (49k vocabulary) drafts for Gemma 3 270M
(262k) by string-level re-tokenization (`drafters/cross_tokenizer.py`), against prompt lookup and
plain decoding of the same target.

Prompts: Spec-Bench first turns (`--num-prompts`, default 6, one per group) as raw text (the
Gemma base GGUF has no chat template), greedy, `--max-tokens` (default 64) new tokens, EOS
honoured. Engines: plain, `draft-model` with a fixed draft of `--draft` tokens (default 4),
`draft-model` with adaptive draft length, and `ngram` (prompt lookup); all in one process on one
loaded target, the order rotated per prompt. Reported per method: outputs identical to plain
(must be all), mean acceptance length (tokens per target forward), tokens per wall second of
decode and its ratio to plain.

    .venv/bin/python benchmarks/cross_tokenizer.py                  # -> results/cross_tokenizer.json
    .venv/bin/python benchmarks/cross_tokenizer.py -n 1 --max-tokens 16 --out /tmp/smoke.json
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
from tokenleap.drafters import default_registry
from tokenleap.engine.engine import Engine
from tokenleap.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from gemma_exactness import prompts  # noqa: E402

DRAFT = "smollm2-135m-instruct"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft", type=int, default=4)
    ap.add_argument("--target", default="gemma3-270m")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cross_tokenizer.json")
    args = ap.parse_args(argv)

    llm = LLM(model=args.target)
    model, tok = llm.model, llm.tokenizer
    configs = {
        f"draft-model {DRAFT}, k={args.draft}": SpecConfig(
            method="draft-model", model=DRAFT, num_speculative_tokens=args.draft, adaptive=False
        ),
        f"draft-model {DRAFT}, adaptive": SpecConfig(method="draft-model", model=DRAFT, num_speculative_tokens=8),
        "ngram": SpecConfig(method="ngram"),
    }
    engines = {"plain": Engine(model, tok)}
    registry = default_registry()
    for name, cfg in configs.items():
        engines[name] = Engine(
            model, tok, spec=cfg, drafter=registry.create(cfg.method, cfg, target=model, tokenizer=tok)
        )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    names = list(engines)
    totals = {
        n: {
            "tokens": 0, "forwards": 0, "decode_tokens": 0, "decode_s": 0.0, "identical": 0, "drafted": 0, "accepted": 0
        }
        for n in names
    }
    texts = prompts(args.num_prompts)
    t0 = time.perf_counter()
    for i, text in enumerate(texts):
        ids = tok.encode(text)
        outs: dict[str, list[int]] = {}
        for name in names[i % len(names):] + names[: i % len(names)]:
            req = engines[name].run(engines[name].add_request(ids, params))
            m, t = req.metrics, totals[name]
            outs[name] = list(req.output_ids)
            t["tokens"] += len(req.output_ids)
            t["forwards"] += m.num_forward_passes
            t["decode_tokens"] += m.num_decode_tokens
            t["decode_s"] += m.decode_seconds
            t["drafted"] += m.spec.num_draft_tokens
            t["accepted"] += m.spec.num_accepted_tokens
        for name in names:
            totals[name]["identical"] += outs[name] == outs["plain"]
    plain_rate = totals["plain"]["decode_tokens"] / totals["plain"]["decode_s"]
    table = Table(title=f"{args.target} target, {len(texts)} Spec-Bench prompts, {args.max_tokens} new tokens, greedy "
                        f"({time.perf_counter() - t0:.0f} s)")
    for col in ("method", "identical", "acceptance length", "accepted / drafted", "decode tok/s", "vs plain"):
        table.add_column(col, justify="left" if col == "method" else "right")
    summary = {}
    for name in names:
        t = totals[name]
        rate = t["decode_tokens"] / t["decode_s"]
        # tokens per decode forward, the decode rate and its ratio to plain decoding's
        summary[name] = dict(t, acceptance_length=t["decode_tokens"] / max(1, t["forwards"]),
                             decode_tokens_per_second=rate, decode_speedup=rate / plain_rate)
        table.add_row(name, f"{t['identical']}/{len(texts)}", f"{summary[name]['acceptance_length']:.2f}",
                      f"{t['accepted']}/{t['drafted']}", f"{rate:.1f}", f"{rate / plain_rate:.2f}x")
    Console(width=140).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": {k: str(v) for k, v in vars(args).items()}, "summary": summary}, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(s["identical"] == len(texts) for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
