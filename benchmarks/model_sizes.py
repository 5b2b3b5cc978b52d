"""tokenleap against llama.cpp at the sizes CPU users run (1B-8B GGUF files), on the same file.

For each GGUF (random weights in real models' shapes from `benchmarks/make_gguf.py`, quantized
by llama.cpp's own `llama-quantize`; decoding speed does not depend on the values), back to back
with the same threads:

* load: seconds from `LLM(model=FILE)` to a ready engine in a fresh process with the file in the
  page cache (one untimed load first), resident memory after the load and its peak;
* tg128: decode tokens/s, 128 forced tokens after a one-token prompt (mean of 3), against
  `llama-bench -p 0 -n 128 -r 3` run before and after tokenleap (mean of the two);
* pp512: one prefill forward of 512 tokens (mean of 3) against `llama-bench -p 512 -n 0 -r 3`;
* the memory floor: bytes of weights one decode step streams / the read bandwidth measured in
  the same run (`torch.sum` over 1 GiB, best of 5);
* verify cost: one forward of k rows at 256 cached tokens relative to one row (k = 2, 4, 8);
* replay drafts (`--replay`): a Spec-Bench prompt's greedy output is recorded, then decoded again
  with a drafter that proposes the known continuation, right every time (acceptance 1.0) or
  right with probability `--replay-p` per token; decode tokens/s against plain for draft lengths
  1-8 (the median ratio of `--replay-rounds` back-to-back pairs), and whether every output is
  identical to plain decoding.

    .venv/bin/python benchmarks/model_sizes.py benchmarks/.peer/models/llama-3.2-1b-Q4_K_M.gguf \\
        --llama-bench benchmarks/.peer/llama.cpp/build/bin/llama-bench --replay   # -> results/model_sizes.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from quant_decode import llama_bench  # noqa: E402

from tokenleap import LLM, SamplingParams, SpecConfig  # noqa: E402
from tokenleap.drafters.base import Draft, DraftRequest  # noqa: E402
from tokenleap.engine.speculation import _time_rows  # noqa: E402
from tokenleap.errors import TokenleapError  # noqa: E402

_LOAD_SCRIPT = r"""
import json, resource, sys, time
import psutil
t0 = time.perf_counter()
from tokenleap import LLM
t1 = time.perf_counter()
llm = LLM(model=sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "rss_gb": psutil.Process().memory_info().rss / 1e9,
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))
"""


def csv_of(kind: type) -> Callable[[str], list[Any]]:
    """An argparse type: a comma-separated list of `kind` (a bad item is a usage error)."""

    def parse(text: str) -> list[Any]:
        try:
            return [kind(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"comma-separated {kind.__name__} values, got {text!r}") from None

    return parse


def cpu_name() -> str:
    """The CPU as a benchmark row names it: model name, family / model, and the vector ISA the
    kernels pick from (AMD family 25 model 1 is Zen 3 Milan, model 17 Zen 4 Genoa)."""
    text = Path("/proc/cpuinfo").read_text()
    info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = set(info.get("flags", "").split())
    isa = "AVX2"
    if "avx512f" in flags:
        isa = "AVX-512" + "".join(f" {f}" for f, n in (("VNNI", "avx512_vnni"), ("BF16", "avx512_bf16")) if n in flags)
    if "amx_tile" in flags:
        isa += " AMX"
    return (
        f"{info.get('model name', platform.processor() or 'unknown')} "
        f"(family {info.get('cpu family', '?')}, model {info.get('model', '?')}; {isa})"
    )


def load_in_fresh_process(path: Path) -> dict[str, float]:
    """`LLM(model=path)` timed in a new interpreter, the second of two (the first warms the page
    cache and the tokenizer cache)."""
    result: dict[str, float] = {}
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _LOAD_SCRIPT, str(path)], capture_output=True, text=True, timeout=900
        )
        if proc.returncode != 0:
            raise RuntimeError(f"load failed: {proc.stderr[-1500:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def read_bandwidth(repeats: int = 5) -> float:
    """GB/s of `torch.sum` over a 1 GiB float32 tensor (best of `repeats`)."""
    x = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def tg(llm: LLM, tokens: int = 128, repeats: int = 3) -> float:
    """Decode tokens/s of `tokens` forced tokens after a one-token prompt (mean of `repeats`)."""
    prompt = llm.tokenizer.encode("Once")[:1]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    runs = []
    for _ in range(repeats):
        req = llm.engine.run(llm.engine.add_request(prompt, params))
        runs.append(req.metrics.num_decode_tokens / req.metrics.decode_seconds)
    return statistics.mean(runs)


def pp(llm: LLM, n: int = 512, repeats: int = 3) -> float:
    """Prompt tokens/s of one forward over `n` random tokens (mean of `repeats`)."""
    model = llm.model
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    times = []
    for _ in range(repeats):
        kv = model.new_kv_cache(n + 2)
        t0 = time.perf_counter()
        model.compute_logits(model.forward(ids, torch.arange(n), kv).hidden[-1:])
        times.append(time.perf_counter() - t0)
        kv.free()
    return n / statistics.mean(times)


class ReplayDrafter:
    """Proposes the recorded greedy continuation of a context: each token right with probability
    `p` (else another token, which the verifier rejects), from its own seeded generator."""

    name = "replay"
    needs_hidden_states = False

    def __init__(self, reference: Sequence[int], p: float = 1.0, seed: int = 0) -> None:
        self.reference, self.p, self.rng = list(reference), p, random.Random(seed)

    def begin(self, request: DraftRequest) -> None:
        return None

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        n = len(tokens)
        if list(tokens) != self.reference[:n]:
            return Draft([])
        out = []
        for t in self.reference[n : n + max_tokens]:
            out.append(t if self.rng.random() < self.p else (t + 1) % 1000)
        return Draft(out)

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        return None

    def end(self, request_id: str) -> None:
        return None


def replay(llm: LLM, prompt: str, tokens: int, lengths: Sequence[int], p: float, rounds: int = 3) -> dict[str, Any]:
    """Plain greedy decoding against replay drafts of each length (acceptance 1.0, and `p`):
    `rounds` back-to-back pairs of runs (plain, then speculative) per case; the speed-up is the
    median of the pairs' ratios (the host's read bandwidth moves within seconds, and the plain
    rate, memory-bound, moves with it)."""
    try:
        ids = llm.chat_token_ids([{"role": "user", "content": prompt}])
    except TokenleapError:  # no chat template (make_gguf's Mistral shape): the plain prompt
        ids = llm.tokenizer.encode(prompt)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    def run(spec: SpecConfig | None) -> tuple[list[int], float, float]:
        req = llm.engine.run(llm.engine.add_request(ids, params, speculative=spec or False))
        m = req.metrics
        return (
            list(req.output_ids),
            m.num_decode_tokens / m.decode_seconds,
            m.num_decode_tokens / max(1, m.num_forward_passes),
        )

    plain_ids, _, _ = run(None)  # the reference (and a warm-up)
    reference = ids + plain_ids
    rows: list[dict[str, Any]] = []
    for k in lengths:
        for prob in (1.0, p):
            pairs: list[tuple[float, float]] = []
            identical = True
            per_forward = 0.0
            for _ in range(rounds):
                _, plain_tps, _ = run(None)
                spec = SpecConfig(
                    method="custom", drafter=ReplayDrafter(reference, prob), num_speculative_tokens=k, adaptive=False
                )
                out, tps, per_forward = run(spec)
                identical = identical and out == plain_ids
                pairs.append((plain_tps, tps))
            speedup = statistics.median(s / b for b, s in pairs)
            rows.append(
                {
                    "k": k, "p": prob, "plain_tps": statistics.median(b for b, _ in pairs),
                    "spec_tps": statistics.median(s for _, s in pairs), "speedup": speedup,
                    "speedups": [s / b for b, s in pairs], "tokens_per_forward": per_forward, "identical": identical
                }
            )
            print(f"  replay k={k} p={prob}: {rows[-1]['spec_tps']:.1f} vs plain {rows[-1]['plain_tps']:.1f} tok/s, "
                  f"speed-up {speedup:.2f}x (median of {', '.join(f'{r:.2f}' for r in rows[-1]['speedups'])}), "
                  f"{per_forward:.2f} tokens/forward, identical={identical}", flush=True)
    return {"prompt_tokens": len(ids), "tokens": tokens, "rounds": rounds, "rows": rows}


def measure(path: Path, bench: str | None, threads: int) -> dict[str, Any]:
    row: dict[str, Any] = {"file": path.name, "file_gb": path.stat().st_size / 1e9}
    row.update(load_in_fresh_process(path))
    print(
        f"{path.name}: load {row['load_s']:.1f}s, rss {row['rss_gb']:.2f} GB (peak {row['peak_rss_gb']:.2f})",
        flush=True,
    )
    ref_before = llama_bench(bench, path, threads) if bench else None
    llm = LLM(model=str(path))
    model = llm.model
    row["tg128"] = tg(llm)
    row["pp512"] = pp(llm)
    row["verify_cost"] = dict(zip((1, 2, 4, 8), (_time_rows(model, 256, 8, 3)[k - 1] for k in (1, 2, 4, 8))))
    row["bytes_per_token"] = model.weight_bytes_per_token()
    del llm, model
    ref_after = llama_bench(bench, path, threads) if bench else None
    row["read_gbps"] = read_bandwidth()
    row["floor_tps"] = row["read_gbps"] * 1e9 / row["bytes_per_token"]
    if bench and ref_before and ref_after:
        row["llama_tg128"] = [ref_before, ref_after]
        row["tg_ratio"] = row["tg128"] / statistics.mean([ref_before, ref_after])
        pps = llama_bench(bench, path, threads, prompt="512", gen="0")
        row["llama_pp512"] = pps[512] if isinstance(pps, dict) else None
        row["pp_ratio"] = row["pp512"] / row["llama_pp512"] if row["llama_pp512"] else None
    print(
        f"  tg128 {row['tg128']:.1f} tok/s "
        f"(llama.cpp {row.get('llama_tg128')}, ratio {row.get('tg_ratio', float('nan')):.2f}), "
        f"floor {row['floor_tps']:.1f}; pp512 {row['pp512']:.1f} (llama.cpp {row.get('llama_pp512')}); "
        f"verify cost {row['verify_cost']}",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="GGUF files (benchmarks/make_gguf.py)")
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary (benchmarks/build_llamacpp.sh)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--replay", action="store_true", help="also measure replay drafts (speculation at size)")
    ap.add_argument("--replay-lengths", type=csv_of(int), default="1,2,4,8")
    ap.add_argument("--replay-p", type=float, default=0.7)
    ap.add_argument("--replay-tokens", type=int, default=96)
    ap.add_argument(
        "--replay-rounds", type=int, default=3, help="plain / replay pairs per case (the median ratio is reported)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "model_sizes.json")
    args = ap.parse_args(argv)
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)} (make them with benchmarks/make_gguf.py)")
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "threads": args.threads,
                              "command": " ".join(sys.argv), "rows": []}
    prompt = "Explain how a hash map works, with an example in Python."
    for path in args.files:
        row = measure(path, args.llama_bench, args.threads)
        if args.replay:
            row["replay"] = replay(LLM(model=str(path)), prompt, args.replay_tokens, args.replay_lengths, args.replay_p,
                                   args.replay_rounds)
        result["rows"].append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
