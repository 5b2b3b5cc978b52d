"""Weights kept quantized against dequantized bf16, and against llama.cpp, back to back.

One process loads the default model twice: `LLM()` (the GGUF dequantized to bf16) and
`LLM(quantization="gguf")` (its Q4_1 linears and Q8_0 LM head read in their blocks by the
kernels' int8 path). On Spec-Bench first turns (`--per-group` per group, chat template, greedy,
`--max-tokens` forced new tokens with `ignore_eos`), the two run alternately per prompt (the
order rotates), and the script reports decode tokens/s (`RequestOutput.metrics`, prefill
excluded), end-to-end tokens/s, their ratio, and how many greedy outputs match token for token
(they need not: the quantized path rounds activations to int8 blocks). Then, per engine, the
verify cost curve: one forward of k = 1..16 rows at ~`--context` cached tokens relative to one
row (fastest of interleaved rounds, as the engine's own cost curve), and one [3072, 576] linear
per weight format at 1, 4 and 8 rows (30 distinct weights, cold). With `--llama-bench PATH`
(built by `benchmarks/build_llamacpp.sh`), llama.cpp's `llama-bench -p 0 -n 128 -t THREADS -r 3`
on the same GGUF file runs before and after tokenleap, and tokenleap's own tg128 (128 forced tokens after a
one-token prompt, decode steps only, as llama-bench times them) is the comparable figure; decode
tokens/s on Spec-Bench prompts (contexts up to ~900 tokens) is reported beside it. JSON to
`benchmarks/results/quant_decode.json`. `--prefill-only` measures prompt tokens/s of one forward
over 64 / 256 / 700 tokens per engine (and, with `--llama-bench`, llama-bench's pp64/256/512).

    .venv/bin/python benchmarks/quant_decode.py --llama-bench benchmarks/.peer/llama.cpp/build/bin/llama-bench
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from tokenleap import LLM, SamplingParams  # noqa: E402
from tokenleap.engine.speculation import _time_rows  # noqa: E402
from tokenleap.kernels import PackedWeight, QuantWeight  # noqa: E402

BENCH = ROOT.parent / "shared" / "bench" / "spec_bench.jsonl"


def spec_bench_prompts(path: Path, per_group: int) -> list[str]:
    groups: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        q = json.loads(line)
        cat = q.get("category", "")
        group = (
            "mt_bench"
            if cat in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
            else cat
        )
        if len(groups.setdefault(group, [])) < per_group:
            groups[group].append(q["turns"][0])
    return [p for g in sorted(groups) for p in groups[g]]


def llama_bench(binary: str, model: Path, threads: int, prompt: str = "0", gen: str = "128", depth: int = 0,
                repeats: int = 3, extra: tuple[str, ...] = ()) -> float | dict[int, float] | None:
    """llama-bench's tokens/s: tg128 by default; with `prompt` lengths (e.g. "64,256,512") and
    `gen` "0", its pp figures as {prompt length: tokens/s}; `depth`: decode after that many
    tokens of context (`-d`); `extra`: more flags (e.g. "-ctk", "q8_0")."""
    cmd = [
        binary, "-m", str(model), "-p", prompt, "-n", gen, "-t", str(threads), "-r", str(repeats), "-o", "json", *extra
    ]
    if depth:
        cmd += ["-d", str(depth)]
    # tokenleap sets OMP_WAIT_POLICY=passive for torch; llama.cpp's OpenMP threads would inherit it
    # and run at ~55 % of their speed (measured: 72-77 against 129-134 tok/s from a shell)
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        print(f"llama-bench failed ({proc.returncode}): {proc.stderr[-500:]}", file=sys.stderr)
        return None
    rows = json.loads(proc.stdout)
    if prompt != "0":
        return {int(r["n_prompt"]): float(r["avg_ts"]) for r in rows}
    return float(rows[0]["avg_ts"])


def tg128(llm: LLM, tokens: int = 128, repeats: int = 3) -> float:
    """llama-bench's tg128 in tokenleap: `tokens` forced tokens decoded after a one-token prompt
    (llama-bench decodes from an empty context), decode tokens/s of the best of `repeats`."""
    prompt = llm.tokenizer.encode("Once")[:1]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    best = 0.0
    for _ in range(repeats):
        req = llm.engine.run(llm.engine.add_request(prompt, params))
        best = max(best, req.metrics.num_decode_tokens / req.metrics.decode_seconds)
    return best


def prefill_speed(llm: LLM, lengths: tuple[int, ...] = (64, 256, 700), repeats: int = 3) -> dict[int, float]:
    """Prompt tokens/s of one forward over a random prompt of each length (fastest of `repeats`)."""
    model = llm.model
    out: dict[int, float] = {}
    for n in lengths:
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        best = float("inf")
        for _ in range(repeats):
            kv = model.new_kv_cache(n + 2)
            t0 = time.perf_counter()
            model.forward(ids, torch.arange(n), kv)
            best = min(best, time.perf_counter() - t0)
            kv.free()
        out[n] = n / best
    return out


def linear_micro(llm: LLM, rows_list: tuple[int, ...] = (1, 4, 8), copies: int = 30) -> dict[str, dict[int, float]]:
    """Microseconds per call of one gate+up-shaped linear ([3072, 576]) over `copies` distinct
    weights (cold in cache, as in a forward), per weight format, fastest of 5 rounds."""
    import gguf
    import numpy as np

    kernels = llm.model.kernels
    rng = np.random.default_rng(0)
    dense = [(rng.standard_normal((3072, 576)) * 0.05).astype(np.float32) for _ in range(copies)]
    formats = {
        "bf16 packed": [PackedWeight.pack(torch.from_numpy(d).bfloat16()) for d in dense] if kernels.packed else [],
        "Q4_1": [
            QuantWeight.from_blocks(gguf.quants.quantize(d, gguf.GGMLQuantizationType.Q4_1), 3, 3072, 576)
            for d in dense
        ],
        "Q8_0": [
            QuantWeight.from_blocks(gguf.quants.quantize(d, gguf.GGMLQuantizationType.Q8_0), 8, 3072, 576)
            for d in dense
        ],
        "Q5_0": [
            QuantWeight.from_blocks(gguf.quants.quantize(d, gguf.GGMLQuantizationType.Q5_0), 6, 3072, 576)
            for d in dense
        ],
    }
    out: dict[str, dict[int, float]] = {}
    for name, weights in formats.items():
        if not weights:
            continue
        out[name] = {}
        for rows in rows_list:
            x = torch.randn(rows, 576)
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for w in weights:
                    kernels.linear(x, w)
                best = min(best, (time.perf_counter() - t0) / len(weights))
            out[name][rows] = best * 1e6
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-group", type=int, default=2, help="Spec-Bench questions per group (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=300, help="cached tokens for the verify cost curve")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bench", default=None, help="path of a llama-bench binary to run on the same file")
    ap.add_argument("--bench-file", type=Path, default=BENCH)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quant_decode.json")
    ap.add_argument("--prefill-only", action="store_true", help="only the prompt prefill speeds (to --out)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
                    "cpu_flags_avx512": "avx512f" in Path("/proc/cpuinfo").read_text(), "load_before": os.getloadavg()}
    engines = {"bf16": LLM(quantization="none"), "gguf": LLM(quantization="gguf")}
    if args.prefill_only:
        rounds = [{n: prefill_speed(e) for n, e in engines.items()} for _ in range(2)]
        best = {n: {k: max(r[n][k] for r in rounds) for k in rounds[0][n]} for n in engines}
        if args.llama_bench:  # llama.cpp's prompt processing (pp) on the same file, after tokenleap's
            best["llama.cpp pp"] = (
                llama_bench(args.llama_bench, engines["bf16"].source.path, args.threads, "64,256,512", "0") or {}
            )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"date": result["date"], "cpu_flags_avx512": result["cpu_flags_avx512"], "prefill_tok_s": best},
                indent=1,
            )
        )
        for n, by_len in best.items():
            print(f"prefill {n}: " + ", ".join(f"{k} tokens {v:.0f} tok/s" for k, v in by_len.items()))
        return 0
    model_file = engines["bf16"].source.path
    result["kernels"] = engines["gguf"].model.kernels.variant if engines["gguf"].model.kernels else None
    result["quant_vnni"] = engines["gguf"].model.kernels.quant_vnni() if engines["gguf"].model.kernels else None
    result["bytes_per_token"] = {n: e.model.weight_bytes_per_token() for n, e in engines.items()}
    if args.llama_bench:
        result["llama_bench_before"] = llama_bench(args.llama_bench, model_file, args.threads)
        print(f"llama-bench tg128 (before): {result['llama_bench_before']}")
    prompts = spec_bench_prompts(args.bench_file, args.per_group)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    totals = {n: {"decode_s": 0.0, "decode_tokens": 0, "e2e_s": 0.0, "tokens": 0} for n in engines}
    outputs: dict[str, list[list[int]]] = {n: [] for n in engines}
    names = list(engines)
    for i, prompt in enumerate(prompts):
        order = names[i % 2 :] + names[: i % 2]
        for name in order:
            t0 = time.perf_counter()
            out = engines[name].chat([{"role": "user", "content": prompt}], params)[0]
            tot = totals[name]
            tot["e2e_s"] += time.perf_counter() - t0
            tot["tokens"] += len(out.outputs[0].token_ids)
            tot["decode_s"] += out.metrics.decode_seconds
            tot["decode_tokens"] += out.metrics.num_decode_tokens
            outputs[name].append(list(out.outputs[0].token_ids))
        print(
            f"[{i + 1}/{len(prompts)}] "
            + ", ".join(f"{n} {totals[n]['decode_tokens'] / totals[n]['decode_s']:.1f}" for n in names)
            + " decode tok/s"
        )
    for name, tot in totals.items():
        tot["decode_tps"] = tot["decode_tokens"] / tot["decode_s"]
        tot["e2e_tps"] = tot["tokens"] / tot["e2e_s"]
    result["decode"] = totals
    result["gguf_over_bf16_decode"] = totals["gguf"]["decode_tps"] / totals["bf16"]["decode_tps"]
    result["gguf_over_bf16_e2e"] = totals["gguf"]["e2e_tps"] / totals["bf16"]["e2e_tps"]
    result["identical_outputs"] = sum(a == b for a, b in zip(outputs["bf16"], outputs["gguf"]))
    result["prompts"] = len(prompts)
    result["tg128"] = {n: tg128(e) for n, e in engines.items()}
    print(
        "tokenleap tg128 (decode tok/s after a one-token prompt): "
        + ", ".join(f"{n} {v:.1f}" for n, v in result["tg128"].items())
    )
    result["verify_cost"] = {n: _time_rows(e.model, args.context, 16, 5) for n, e in engines.items()}
    result["linear_us_3072x576"] = linear_micro(engines["gguf"])
    if args.llama_bench:
        result["llama_bench_after"] = llama_bench(args.llama_bench, model_file, args.threads)
        peer = [v for v in (result["llama_bench_before"], result["llama_bench_after"]) if v]
        if peer:
            result["llama_bench_tg128"] = sum(peer) / len(peer)
            result["gguf_over_llamacpp_decode"] = totals["gguf"]["decode_tps"] / result["llama_bench_tg128"]
            result["gguf_tg128_over_llamacpp_tg128"] = result["tg128"]["gguf"] / result["llama_bench_tg128"]
    result["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("verify_cost", "linear_us_3072x576")}, indent=1))
    for n, per_rows in result["linear_us_3072x576"].items():
        print(f"linear [3072, 576] {n}: " + " ".join(f"{r} rows {us:.0f} us" for r, us in per_rows.items()))
    for n, curve in result["verify_cost"].items():
        print(f"verify cost {n}: " + " ".join(f"{k + 1}:{c:.2f}" for k, c in enumerate(curve)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
