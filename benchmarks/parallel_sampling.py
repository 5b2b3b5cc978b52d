"""Parallel sampling: one prompt, n samples with one shared prefill (`SamplingParams(n=...)`,
the KV cache forked) against the same n samples as separate requests (n prefills), both through
the batched `LLM.generate`, on the default model.

Prompts: the longest Spec-Bench first turns of `--num-prompts` groups (long prompts are where a
shared prefill pays), the chat template, temperature 0.8, `--n` samples (default 4) of
`--max-tokens` (default 32) each, sample i seeded i in both forms (so the texts are identical:
checked). `--rounds` (default 3) rounds alternating the two forms. Reports total wall time per form
and their ratio.

    .venv/bin/python benchmarks/parallel_sampling.py          # -> results/parallel_sampling.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from tokenleap import LLM, SamplingParams
from tokenleap.bench import default_spec_bench, load_questions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--num-prompts", type=int, default=4)
    ap.add_argument("--n", dest="samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "parallel_sampling.json")
    args = ap.parse_args(argv)
    llm = LLM()
    questions = load_questions(default_spec_bench(), 4)
    by_len = sorted(questions, key=lambda q: -len(q.turns[0]))[: args.num_prompts]
    convs = [[{"role": "user", "content": q.turns[0]}] for q in by_len]
    prompt_tokens = [len(llm.chat_token_ids(c)) for c in convs]
    params = SamplingParams(temperature=0.8, max_tokens=args.max_tokens, seed=0, n=args.samples, ignore_eos=True)
    seconds = {"shared prefill (n)": 0.0, "separate requests": 0.0}
    same = True
    for r in range(args.rounds):
        for form in (list(seconds) if r % 2 == 0 else list(seconds)[::-1]):
            t0 = time.perf_counter()
            if form.startswith("shared"):
                outs = llm.chat(convs, params, use_tqdm=False)
                texts = [[c.token_ids for c in o.outputs] for o in outs]
            else:
                singles = [dataclasses.replace(params, n=1, seed=i) for i in range(args.samples)]
                flat = llm.chat(
                    [c for c in convs for _ in range(args.samples)], [s for _ in convs for s in singles], use_tqdm=False
                )
                texts = [
                    [flat[k * args.samples + i].outputs[0].token_ids for i in range(args.samples)]
                    for k in range(len(convs))
                ]
            seconds[form] += time.perf_counter() - t0
            if r == 0:
                if form.startswith("shared"):
                    shared_texts = texts
                else:
                    separate_texts = texts
    same = shared_texts == separate_texts
    ratio = seconds["separate requests"] / seconds["shared prefill (n)"]
    for k, v in seconds.items():
        print(f"{k:22s} {v:7.2f} s")
    print(f"prompt tokens {prompt_tokens}; shared prefill is {ratio:.2f}x faster; identical samples: {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"seconds": seconds, "speedup": ratio, "identical": same,
                                    "prompt_tokens": prompt_tokens,
                                    "meta": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
