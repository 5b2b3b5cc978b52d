"""One kernel call for a forward's layers (`FusedLayers`, kernels/fused.py) against the per-call
loop it replaced (five to seven ctypes calls per layer), on the default model or `--model`.

`--against per_call` (the default): the fused path's own per-call reference loop (`fused` None,
the same bits); `--against blocks`: the per-op decoder block (`ExecutionPath.KERNELS`:
`models.layers.decoder_layer` on the kernels, torch ops between them), which served Gemma 3 and
Mistral before they took the fused path. One process per weight form (`--quantization gguf`,
the default: the GGUF's blocks kept; `none`: bf16), the two settings alternating ABBA over
`--rounds` rounds:
- plain greedy decoding (`LLM.generate`, EOS ignored, one request at a time) of `--max-tokens`
  tokens after each of `--prompts` Spec-Bench first turns: decode tokens/s (prefill excluded, as `tokenleap bench`
  splits it) and whether both settings give the same tokens;
- the target forward of 1 and of 8 new rows after 300 tokens of context (the verify-cost
  ratio), median of `--reps` forwards each, the rows rolled back after every forward.

    .venv/bin/python benchmarks/fused_layers.py                    # -> results/fused_layers.json
    .venv/bin/python benchmarks/fused_layers.py --quantization none --out results/fused_layers_bf16.json
    .venv/bin/python benchmarks/fused_layers.py --model benchmarks/.peer/models/gemma3-4b-Q4_K_M.gguf --against blocks \
        --max-tokens 32 --out results/fused_layers_gemma3_4b.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from tokenleap import LLM, SamplingParams
from tokenleap.bench import default_spec_bench, load_questions
from tokenleap.kv.cache import KVCache
from tokenleap.models.llama import ExecutionPath, LlamaModel

sys.path.insert(0, str(Path(__file__).parent))
from model_sizes import cpu_name  # noqa: E402

ROOT = Path(__file__).resolve().parent


def _forward_ms(model: LlamaModel, kv: KVCache, ids: torch.Tensor, rows: int, context: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.forward(ids[:rows], torch.arange(context, context + rows), kv)
        times.append(time.perf_counter() - t0)
        kv.truncate(context)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a registered model or a GGUF path (default: the default model)")
    ap.add_argument("--against", default="per_call", choices=["per_call", "blocks"])
    ap.add_argument("--quantization", default="gguf", choices=["gguf", "none"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "fused_layers.json")
    args = ap.parse_args(argv)
    llm = LLM(model=args.model, quantization=args.quantization) if args.model else LLM(quantization=args.quantization)
    model = llm.model
    fused, path = model.fused, model.path
    if fused is None:
        raise SystemExit("this model does not take the fused path (no kernels?)")
    prompts = [q.turns[0] for q in load_questions(default_spec_bench(), per_group=1)[: args.prompts]]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    ids = torch.randint(0, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    kv = model.new_kv_cache(512)
    model.forward(ids, torch.arange(300), kv)
    other = args.against
    names = ["fused", other]
    stats = {n: {"decode_s": 0.0, "decode_tokens": 0, "f1_ms": [], "f8_ms": []} for n in names}
    outputs: dict[str, list[list[int]]] = {}
    load_before = os.getloadavg()
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            if name == "per_call":
                model.fused = None
            elif name == "blocks":
                model.path = ExecutionPath.KERNELS
            try:
                outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one stream at a time
                for o in outs:
                    stats[name]["decode_s"] += o.metrics.decode_seconds
                    stats[name]["decode_tokens"] += o.metrics.num_generation_tokens - 1
                outputs.setdefault(name, [list(o.outputs[0].token_ids) for o in outs])
                stats[name]["f1_ms"].append(_forward_ms(model, kv, ids, 1, 300, args.reps))
                stats[name]["f8_ms"].append(_forward_ms(model, kv, ids, 8, 300, args.reps))
            finally:
                model.fused, model.path = fused, path
    result: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": cpu_name(),
        "command": " ".join(sys.argv),
        "model": args.model or "default",
        "against": other,
        "kernels": model.kernels.variant,
        "quantization": args.quantization,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "identical": outputs["fused"] == outputs[other],
    }
    for name in names:
        s = stats[name]
        f1, f8 = statistics.median(s["f1_ms"]), statistics.median(s["f8_ms"])
        result[name] = {
            "decode_tok_s": round(s["decode_tokens"] / s["decode_s"], 1),
            "forward_1_row_ms": round(f1, 3),
            "forward_8_rows_ms": round(f8, 3),
            "verify_cost_8_over_1": round(f8 / f1, 2),
        }
    fu, ot = result["fused"], result[other]
    assert isinstance(fu, dict) and isinstance(ot, dict)
    result["decode_speedup"] = round(fu["decode_tok_s"] / ot["decode_tok_s"], 3)
    result["forward_1_row_speedup"] = round(ot["forward_1_row_ms"] / fu["forward_1_row_ms"], 3)
    result["forward_8_rows_speedup"] = round(ot["forward_8_rows_ms"] / fu["forward_8_rows_ms"], 3)
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
