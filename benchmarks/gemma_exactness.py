"""Gemma 3 270M: tokenleap's fp32 greedy output against transformers' fp32 greedy output.

Both read the registered `gemma3-270m` GGUF (Q4_K_M, dequantized to float32 at load by each).
Prompts: Spec-Bench first turns (`--num-prompts`, default 12: two per group), as raw text (the
base model has no chat template), tokenized once by tokenleap's tokenizer (BOS included) and fed
as the same ids to both. Each side generates exactly `--max-tokens` tokens greedily (EOS does not
stop either: tokenleap with `ignore_eos`, transformers with its generation config's EOS unset,
so no logit is altered). The run fails (exit 1) unless every output is identical token for token.

    .venv/bin/python benchmarks/gemma_exactness.py                 # -> results/gemma_exactness.json
    .venv/bin/python benchmarks/gemma_exactness.py -n 2 --max-tokens 16 --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tokenleap import LLM, SamplingParams
from tokenleap.bench import default_spec_bench, load_questions


def prompts(num: int) -> list[str]:
    per_group = max(1, -(-num // 6))
    questions = load_questions(default_spec_bench(), per_group)
    by_group: dict[str, list[str]] = {}
    for q in questions:
        by_group.setdefault(q.group, []).append(q.turns[0])
    ordered = [texts[i] for i in range(per_group) for texts in by_group.values() if i < len(texts)]
    return ordered[:num]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gemma_exactness.json")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    llm = LLM(model="gemma3-270m", dtype="float32")
    path = llm.source.path
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    records = []
    for i, text in enumerate(prompts(args.num_prompts)):
        ids = llm.tokenizer.encode(text)
        t0 = time.perf_counter()
        ours = list(llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids)
        t_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=args.max_tokens, pad_token_id=0)
        t_hf = time.perf_counter() - t0
        theirs = out[0, len(ids):].tolist()
        first_diff = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        same = ours == theirs
        records.append({"prompt": i, "prompt_tokens": len(ids), "identical": same, "first_difference": first_diff,
                        "tokens": len(ours), "tokenleap_s": round(t_ours, 3), "transformers_s": round(t_hf, 3)})
        print(f"prompt {i:2d} ({len(ids):4d} tokens): {'identical' if same else f'DIFFERS at {first_diff}'}"
              f"  tokenleap {t_ours:.2f} s, transformers {t_hf:.2f} s", flush=True)
    identical = sum(r["identical"] for r in records)
    print(f"{identical}/{len(records)} outputs identical ({args.max_tokens} tokens each, fp32)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"max_tokens": args.max_tokens, "identical": identical, "records": records}, indent=1)
    )
    return 0 if identical == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
