r"""What one draft token costs against one target step, on a real target / draft pair: the draft
model's one-row decode step (forward plus LM head) over its whole vocabulary and over reduced
draft vocabularies (`draft_vocab`, FR-Spec: its head cut to the N most frequent tokens), each
divided by the target's one-row step, timed in the same rounds, interleaved (memory bandwidth
moves within minutes here: a ratio inside one round is what holds). The issue's bar: a draft
step <= 0.3 of the target's on the real pair. Best and median over `--rounds`; JSON to `--out`.

    .venv/bin/python benchmarks/draft_cost.py qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct \
        --vocab 0,32768,16384
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name, csv_of  # noqa: E402

from tokenleap.models.base import CausalLM  # noqa: E402
from tokenleap.models.loading import load_model  # noqa: E402
from tokenleap.models.registry import resolve  # noqa: E402


def step_seconds(model: CausalLM, context: int, steps: int) -> float:
    """Seconds per one-row decode step (forward + logits) at `context` cached tokens, best of `steps`."""
    kv = model.new_kv_cache()
    ids = torch.arange(context) % 1000 + 100
    model.forward(ids, torch.arange(context), kv)
    best = float("inf")
    for i in range(steps):
        t = time.perf_counter()
        out = model.forward(torch.tensor([7 + i]), torch.tensor([context + i]), kv)
        model.compute_logits(out.hidden, [0])
        best = min(best, time.perf_counter() - t)
    kv.free()
    return best


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("target", help="the target (a registered name or a .gguf file)")
    ap.add_argument("draft", help="the draft model, with the target's tokenizer")
    ap.add_argument(
        "--vocab", type=csv_of(int), default="0,32768,16384", help="draft vocabularies to time (0: the whole)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per model and round (the best counts)")
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the timed steps")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "draft_cost.json")
    args = ap.parse_args()
    target, tokenizer = load_model(resolve(args.target), torch.bfloat16, quantization="gguf")
    draft, _ = load_model(resolve(args.draft), torch.bfloat16, quantization="gguf")
    drafts: dict[int, CausalLM] = {}
    for n in args.vocab:
        if n == 0:
            drafts[n] = draft
            continue
        from tokenleap.drafters.draft_model import (
            frequent_tokens,  # (a reduced vocabulary only: runs against older checkouts)
        )

        drafts[n] = draft.with_vocab(frequent_tokens(tokenizer, draft.config.vocab_size, n))[0]
    ratios: dict[int, list[float]] = {n: [] for n in args.vocab}
    target_ms: list[float] = []
    for r in range(args.rounds):
        t = step_seconds(target, args.context, args.steps)
        target_ms.append(1e3 * t)
        for n, model in drafts.items():
            ratios[n].append(step_seconds(model, args.context, args.steps) / t)
        print(
            f"round {r + 1}: target {1e3 * t:.1f} ms; "
            + ", ".join(f"vocab {n or 'all'} {ratios[n][-1]:.3f}" for n in args.vocab),
            flush=True,
        )
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "target": args.target,
        "draft": args.draft,
        "context": args.context,
        "target_step_ms": {"best": min(target_ms), "median": statistics.median(target_ms)},
        "target_bytes_per_token": target.weight_bytes_per_token(),
        "vocabularies": {
            str(n): {
                "vocab": int(m.compute_logits(torch.zeros(1, m.config.hidden_size)).shape[-1]),
                "bytes_per_token": m.weight_bytes_per_token(),
                "ratio_best": min(ratios[n]),
                "ratio_median": statistics.median(ratios[n]),
            }
            for n, m in drafts.items()
        },
    }
    print(f"{cpu_name()}: target step {min(target_ms):.1f} ms ({target.weight_bytes_per_token() / 1e6:.0f} MB a token)")
    print("| draft vocabulary | MB a token | draft step / target step (best / median) |\n| --- | --- | --- |")
    for row in result["vocabularies"].values():
        print(
            f"| {row['vocab']} | {row['bytes_per_token'] / 1e6:.0f} | "
            f"{row['ratio_best']:.3f} / {row['ratio_median']:.3f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
