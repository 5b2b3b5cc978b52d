"""Kernel-path forwards of the general model path (Gemma 3, Qwen3, Mistral) with one torch thread
(`tokenleap.threads`, the current behaviour) against torch's default threads (the previous one).

One process, Gemma 3 270M in bf16, greedy decoding of `--max-tokens` (default 48, EOS ignored)
after a short raw prompt, `--rounds` rounds (default 6) with the settings alternating ABBA. The
previous behaviour is restored by replacing `tokenleap.models.llama.torch_threads` with a no-op.
Reports the load average before and after (the effect depends on what else wants the cores),
wall time per setting, their ratio, and whether the outputs are identical.

    .venv/bin/python benchmarks/torch_threads.py          # -> results/torch_threads.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import tokenleap.models.llama as llama_module
from tokenleap import LLM, SamplingParams

PROMPT = "The capital of France is"


@contextlib.contextmanager
def _unchanged(n: int | None) -> Iterator[None]:
    yield


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "torch_threads.json")
    args = ap.parse_args(argv)
    llm = LLM(model=args.model)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    real = llama_module.torch_threads
    settings = {"one torch thread": real, "torch default threads": _unchanged}
    seconds = dict.fromkeys(settings, 0.0)
    outputs: dict[str, list[int]] = {}
    names = list(settings)
    load_before = os.getloadavg()
    for r in range(args.rounds):
        for setting in names if r % 2 == 0 else names[::-1]:
            llama_module.torch_threads = settings[setting]
            try:
                t0 = time.perf_counter()
                out = llm.generate([PROMPT], params, use_tqdm=False)[0]
                seconds[setting] += time.perf_counter() - t0
                outputs.setdefault(setting, list(out.outputs[0].token_ids))
            finally:
                llama_module.torch_threads = real
    identical = outputs[names[0]] == outputs[names[1]]
    ratio = seconds[names[1]] / seconds[names[0]]
    load_after = os.getloadavg()
    for s in names:
        print(f"{s:24s} {seconds[s]:7.2f} s  ({args.rounds * args.max_tokens / seconds[s]:.1f} tok/s)")
    print(
        f"speedup of one torch thread: {ratio:.2f}x; outputs identical: {identical}; "
        f"load average {load_before[0]:.1f} -> {load_after[0]:.1f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"seconds": seconds, "speedup": ratio, "identical": identical,
                                    "load_before": load_before, "load_after": load_after,
                                    "meta": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
