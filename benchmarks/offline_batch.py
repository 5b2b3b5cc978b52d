"""Offline batched generation: `LLM.generate` over many prompts, batched against one at a time.

Measured back to back in one process on one loaded model, on the same prompts: Spec-Bench first
turns (`--num-prompts`, default 64, taken from the six groups in turn), wrapped in the model's
chat template, greedy, `--max-tokens` (default 128) new tokens at most (EOS ends an answer, as
a user would see it). Two modes:

* one at a time: `llm.generate([prompt], params)` for each prompt in turn (what `generate`
  over many prompts did before it batched);
* batched: one `llm.generate(prompts, params)` call, continuous batching with `max_num_seqs`
  (`--max-num-seqs`, a comma list runs each).

The modes alternate ABBA (`--rounds 2`: one at a time, batched, batched, one at a time) so that
drift on a shared machine hits both alike; output tokens/s is total generated tokens / total
wall seconds of each mode (prefill included, vLLM's offline throughput), and the ratio is of
those. Every batched output is compared with the one-at-a-time output token for token.

Memory: the engine's `add_request` / `finish` are wrapped to count the requests holding a KV
cache, and a thread samples every 2 ms the bytes of their KV caches, the process's resident set
size and its virtual size (`/proc/self/statm`); each run reports the most live requests, the
peak KV bytes and the peak RSS and virtual size above their values at its start (after
`malloc_trim`). For contrast, creating every prompt's request up front (what `generate` did
before: each KV cache allocated before the first token) is measured the same way, then freed.
A cache's pages become resident only when written (the fp32 layout is allocated with
`torch.empty`, the blocked bf16 layout is zero-filled), so RSS and virtual size tell different
parts of the story on different kernels.

    .venv/bin/python benchmarks/offline_batch.py                       # -> results/offline_batch.json
    .venv/bin/python benchmarks/offline_batch.py -n 8 --max-tokens 16 --rounds 1 --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenleap import LLM, SamplingParams
from tokenleap.bench import default_spec_bench, load_questions
from tokenleap.engine.request import Request
from tokenleap.kv.cache import trim_free_memory
from tokenleap.types import RequestOutput

RESULTS = Path(__file__).resolve().parent / "results"
console = Console(width=None if sys.stdout.isatty() else 130)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def statm() -> tuple[int, int]:
    """(virtual size, resident set size) of this process in bytes."""
    with open("/proc/self/statm") as f:
        size, resident = f.read().split()[:2]
    return int(size) * _PAGE, int(resident) * _PAGE


class MemoryProbe:
    """While the block runs: the engine's live requests (counted by wrapping `add_request` /
    `finish`) and, sampled on a thread, their KV-cache bytes, RSS and virtual size."""

    def __init__(self, llm: LLM, interval: float = 0.002) -> None:
        self.engine = llm.engine
        self.interval = interval
        self.live: dict[str, Request] = {}
        self.peak_live = self.peak_kv = 0
        self.rss0 = self.vm0 = self.peak_rss = self.peak_vm = 0
        self._stop = threading.Event()

    def __enter__(self) -> MemoryProbe:
        add, finish = self.engine.add_request, self.engine.finish

        def counting_add(*args: Any, **kwargs: Any) -> Request:
            req = add(*args, **kwargs)
            self.live[req.request_id] = req
            self.peak_live = max(self.peak_live, len(self.live))
            return req

        def counting_finish(req: Request, reason: str | None = None) -> None:
            finish(req, reason)
            self.live.pop(req.request_id, None)

        self.engine.add_request, self.engine.finish = counting_add, counting_finish  # type: ignore[method-assign]
        trim_free_memory()
        self.vm0, self.rss0 = self.peak_vm, self.peak_rss = statm()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def sample(self) -> None:
        vm, rss = statm()
        self.peak_vm, self.peak_rss = max(self.peak_vm, vm), max(self.peak_rss, rss)
        self.peak_kv = max(self.peak_kv, sum(req.kv.nbytes() for req in list(self.live.values())))

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        del self.engine.add_request, self.engine.finish  # back to the class's methods

    def report(self) -> dict[str, float]:
        mb = 2**20
        return {"peak_live_requests": self.peak_live, "peak_kv_mb": self.peak_kv / mb,
                "peak_rss_above_start_mb": (self.peak_rss - self.rss0) / mb,
                "peak_vm_above_start_mb": (self.peak_vm - self.vm0) / mb, "rss_start_mb": self.rss0 / mb}


def load_prompts(llm: LLM, path: Path, n: int) -> list[list[int]]:
    """The first turns of `n` Spec-Bench questions, groups in turn, as chat-templated token ids."""
    questions = load_questions(path, n)
    by_group: dict[str, list[str]] = {}
    for q in questions:
        by_group.setdefault(q.group, []).append(q.turns[0])
    mixed = [qs[i] for i in range(n) for qs in by_group.values() if i < len(qs)][:n]
    if len(mixed) < n:
        raise SystemExit(f"error: only {len(mixed)} questions in {path}")
    return [llm.chat_token_ids([{"role": "user", "content": q}]) for q in mixed]


def run_mode(llm: LLM, prompts: list[list[int]], params: SamplingParams, max_num_seqs: int | None) -> dict[str, Any]:
    """One pass over the prompts: one at a time (`max_num_seqs` None) or batched."""
    with MemoryProbe(llm) as probe:
        t0 = time.perf_counter()
        if max_num_seqs is None:
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        else:
            saved = llm.config
            llm.config = dataclasses.replace(saved, max_num_seqs=max_num_seqs)
            try:
                outs = llm.generate(prompts, params, use_tqdm=False)
            finally:
                llm.config = saved
        seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "mode": "one-at-a-time" if max_num_seqs is None else f"batched-{max_num_seqs}",
        "seconds": seconds,
        "output_tokens": tokens,
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens_per_second": tokens / seconds,
        **probe.report(),
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def eager_allocation(llm: LLM, prompts: list[list[int]]) -> dict[str, float]:
    """Memory of creating every prompt's request up front (the old `generate`), freed after."""
    with MemoryProbe(llm) as probe:
        reqs = [llm.engine.add_request(p, SamplingParams(temperature=0.0)) for p in prompts]
        probe.sample()
        for req in reqs:
            llm.engine.finish(req, "abort")
    trim_free_memory()
    return probe.report()


def measure(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch_sizes: Sequence[int], rounds: int,
            progress: Callable[[dict[str, Any]], None] = lambda run: None) -> dict[str, Any]:
    """Alternate one-at-a-time and batched passes (ABBA...) and summarise per mode."""
    modes: list[int | None] = [None, *batch_sizes]
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            run = run_mode(llm, prompts, params, m)
            run["round"] = r
            runs.append(run)
            progress(run)
    reference = next(run["outputs"] for run in runs if run["mode"] == "one-at-a-time")
    summary: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(run["mode"] for run in runs):
        mine = [run for run in runs if run["mode"] == name]
        seconds = sum(run["seconds"] for run in mine)
        tokens = sum(run["output_tokens"] for run in mine)
        summary[name] = {
            "output_tokens_per_second": tokens / seconds,
            "total_tokens_per_second": (tokens + sum(run["prompt_tokens"] for run in mine)) / seconds,
            "seconds": seconds,
            "runs_identical": sum(run["outputs"] == reference for run in mine),
            "runs": len(mine),
            "prompts_identical": min(sum(a == b for a, b in zip(run["outputs"], reference)) for run in mine),
            **{key: max(run[key] for run in mine) for key in
               ("peak_live_requests", "peak_kv_mb", "peak_rss_above_start_mb", "peak_vm_above_start_mb")},
        }
    base = summary["one-at-a-time"]["output_tokens_per_second"]
    for s in summary.values():
        s["ratio_to_one_at_a_time"] = s["output_tokens_per_second"] / base
    for run in runs:
        del run["outputs"]
    return {"summary": summary, "runs": runs}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("-n", "--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", default="16", help="batched runs, a comma list")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds (1: one at a time, then batched)")
    p.add_argument("--spec-type", default=None, help="speculative method for both modes (default: none, as LLM())")
    p.add_argument(
        "--input",
        default=None,
        help="Spec-Bench JSONL (default: ../shared/bench/spec_bench.jsonl, else the shipped subset)",
    )
    p.add_argument("--out", default=str(RESULTS / "offline_batch.json"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    batch_sizes = [int(x) for x in args.max_num_seqs.split(",")]
    spec = {"method": args.spec_type} if args.spec_type else None
    llm = LLM(model=args.model, dtype=args.dtype, speculative_config=spec)
    path = Path(args.input) if args.input else default_spec_bench()
    prompts = load_prompts(llm, path, args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    load_before = os.getloadavg()
    console.print(f"{len(prompts)} prompts ({sum(map(len, prompts))} tokens), max_tokens {args.max_tokens}, "
                  f"max_num_seqs {batch_sizes}, {args.rounds} round(s); load average {load_before[0]:.2f}")
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm up (kernels, curve)
    if spec is not None:
        llm.engine.cost_curve()
    eager = eager_allocation(llm, prompts)

    def progress(run: dict[str, Any]) -> None:
        console.print(
            f"  round {run['round']} {run['mode']:>14}: {run['output_tokens']} tokens in {run['seconds']:.1f} s = "
            f"{run['output_tokens_per_second']:.1f} tok/s; at most {run['peak_live_requests']} live requests, "
            f"{run['peak_kv_mb']:.0f} MB of KV cache, RSS +{run['peak_rss_above_start_mb']:.0f} MB, "
            f"virtual +{run['peak_vm_above_start_mb']:.0f} MB"
        )

    result = measure(llm, prompts, params, batch_sizes, args.rounds, progress)
    table = Table(title=f"LLM.generate over {len(prompts)} Spec-Bench prompts")
    for col in (
        "mode", "output tok/s", "x one-at-a-time", "identical prompts", "live requests", "KV MB", "RSS + MB",
        "virtual + MB"
    ):
        table.add_column(col, justify="right")

    def mem(s: dict[str, Any]) -> list[str]:
        return [
            str(s["peak_live_requests"]),
            f"{s['peak_kv_mb']:.0f}",
            f"{s['peak_rss_above_start_mb']:.0f}",
            f"{s['peak_vm_above_start_mb']:.0f}",
        ]

    for name, s in result["summary"].items():
        table.add_row(name, f"{s['output_tokens_per_second']:.1f}", f"{s['ratio_to_one_at_a_time']:.2f}x",
                      f"{s['prompts_identical']}/{len(prompts)}", *mem(s))
    table.add_row("all up front (old)", "-", "-", "-", *mem(eager))
    console.print(table)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "num_prompts": len(prompts),
            "prompt_tokens": sum(map(len, prompts)), "load_average_before": load_before,
            "load_average_after": os.getloadavg(), "cpus": os.cpu_count(), "eager_allocation": eager}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, **result}, indent=1))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
