"""Offline acceptance simulation: how well would a drafter do on Spec-Bench, without the model?

Greedy speculative output equals plain greedy output (tokenleap is lossless), so a drafter's
acceptance on a prompt depends only on the plain greedy continuation. This tool decodes each
prompt once with plain greedy decoding (cached in a JSON file), then replays every drafter
configuration over those continuations step by step (propose up to k tokens, accept the
matching prefix plus one token, `accept` back to the drafter), and reports the mean acceptance
length (tokens per target forward) per group. Seconds per configuration instead of minutes, so
drafter settings can be explored quickly; `tokenleap bench` then measures the real speed.

    python benchmarks/draft_sim.py -q 8 -n 128 --k 8 --k 16 \
        --config '{"method": "ngram"}' --config '{"method": "suffix"}'
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

import tokenleap
from tokenleap import SpecConfig
from tokenleap.bench import default_spec_bench, load_questions
from tokenleap.drafters import default_registry
from tokenleap.drafters.base import DraftRequest
from tokenleap.sampling import SamplingParams, make_generator


def greedy_runs(path: Path, per_group: int, max_tokens: int, cache: Path) -> list[dict[str, Any]]:
    """[{group, prompt_ids, output_ids}] for the first turn of each question, cached on disk."""
    key = f"{path}:{per_group}:{max_tokens}"
    if cache.is_file():
        data = json.loads(cache.read_text())
        if data.get("key") == key:
            return data["runs"]
    llm = tokenleap.LLM()
    runs = []
    for q in tqdm(load_questions(path, per_group), desc="plain greedy"):
        prompt = llm.chat_token_ids([{"role": "user", "content": q.turns[0]}])
        if q.assistant_prefix:
            prompt += llm.tokenizer.encode(q.assistant_prefix)
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)[0]
        runs.append({"group": q.group, "prompt_ids": prompt, "output_ids": list(out.outputs[0].token_ids)})
    cache.write_text(json.dumps({"key": key, "runs": runs}))
    return runs


def simulate(spec: SpecConfig, runs: Sequence[dict[str, Any]], k: int) -> dict[str, list[float]]:
    """Acceptance length per prompt, by group, for a fixed draft cap `k` (requests in order,
    one drafter instance, so global state such as suffix trees carries over as in a server)."""
    drafter = default_registry().create(spec.method, spec)
    per_group: dict[str, list[float]] = defaultdict(list)
    for n, run in enumerate(runs):
        rid = f"sim-{n}"
        prompt, out = run["prompt_ids"], run["output_ids"]
        drafter.begin(DraftRequest(rid, prompt, SamplingParams(temperature=0.0), make_generator(None)))
        i, steps = 0, 0
        while i < len(out):
            draft = drafter.propose(rid, prompt + out[:i], min(k, len(out) - i - 1)) if i + 1 < len(out) else None
            tokens = list(draft.tokens) if draft is not None else []
            acc = 0
            while acc < len(tokens) and i + acc < len(out) and tokens[acc] == out[i + acc]:
                acc += 1
            committed = out[i : i + acc + 1]
            drafter.accept(rid, committed, acc)
            i += len(committed)
            steps += 1
        drafter.end(rid)
        per_group[run["group"]].append(len(out) / max(steps, 1))
    return per_group


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", type=Path, default=default_spec_bench())
    ap.add_argument("-q", "--questions-per-group", type=int, default=8)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, action="append", help="draft caps to try (default 8)")
    ap.add_argument("--config", action="append", help="speculative_config JSON (repeatable)")
    ap.add_argument("--cache", type=Path, default=Path("benchmarks/results/greedy_cache.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    runs = greedy_runs(args.input, args.questions_per_group, args.max_tokens, args.cache)
    configs = [json.loads(c) for c in (args.config or ['{"method": "ngram"}', '{"method": "suffix"}'])]
    groups = sorted({r["group"] for r in runs})
    table = Table(title=f"simulated mean acceptance length ({len(runs)} prompts, {args.max_tokens} tokens)")
    console = Console(width=200)
    for col in ["config", "k", *groups, "overall"]:
        table.add_column(col)
    for cfg in configs:
        for k in args.k or [8]:
            res = simulate(SpecConfig.from_dict(cfg), runs, k)  # type: ignore[arg-type]
            cells = [f"{statistics.mean(res[g]):.2f}" for g in groups]
            overall = statistics.mean([x for g in groups for x in res[g]])
            table.add_row(json.dumps(cfg), str(k), *cells, f"{overall:.2f}")
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
