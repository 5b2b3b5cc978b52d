"""Gemma 3 270M decode speed: tokenleap in its default dtype (bfloat16) against transformers bf16.

Both load the registered `gemma3-270m` GGUF: tokenleap by default keeps its Q4_K / Q6_K / Q5_0 /
Q8_0 blocks (`--quantization none` dequantizes to bf16), transformers dequantizes it to bf16. Prompts: Spec-Bench first
turns (`--num-prompts`, default 4, one per group), raw text, the same token ids for both sides;
each side generates exactly `--max-tokens` tokens greedily (EOS ignored / unset). One process,
the sides alternate ABBA per round (`--rounds`, default 2) so drift on a shared machine hits both
alike. Reported per side, summed over all prompts and rounds, and their ratios:
- decode: tokens after the first per second of decoding (prefill excluded). tokenleap: its
  `RequestOutput.metrics`; transformers: (N - 1) / (t(N) - t(1)), t(n) the wall time of
  `generate(max_new_tokens=n)` on the same prompt (one more prefill per prompt and round);
- end to end: generated tokens per wall second of `generate`, prefill included (one Spec-Bench
  prompt of the four is ~690 tokens: prefill is a large share there).
Torch threads: the process default for both.

    .venv/bin/python benchmarks/gemma_decode.py                    # -> results/gemma_decode.json
    .venv/bin/python benchmarks/gemma_decode.py -n 1 --max-tokens 16 --rounds 1 --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tokenleap import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from gemma_exactness import prompts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--quantization", choices=["gguf", "none"], default=None, help="tokenleap's (default: its own default)"
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gemma_decode.json")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    llm = LLM(model="gemma3-270m", quantization=args.quantization)  # default dtype
    path = llm.source.path
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    ids_list = [llm.tokenizer.encode(t) for t in prompts(args.num_prompts)]

    def run_ours() -> tuple[int, float, int, float]:
        """Generated tokens and wall seconds; decode-phase tokens and seconds."""
        t0 = time.perf_counter()
        outs = [llm.generate([ids], params, use_tqdm=False)[0] for ids in ids_list]
        wall = time.perf_counter() - t0
        dec_n = sum(o.metrics.num_generation_tokens - 1 for o in outs)
        return sum(len(o.outputs[0].token_ids) for o in outs), wall, dec_n, sum(o.metrics.decode_seconds for o in outs)

    def hf_generate(ids: list[int], n: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=n, pad_token_id=0)
        return out.shape[1] - len(ids), time.perf_counter() - t0

    def run_hf() -> tuple[int, float, int, float]:
        n = dec_n = 0
        wall = dec_s = 0.0
        with torch.inference_mode():
            for ids in ids_list:
                _, first = hf_generate(ids, 1)  # prefill and the first token
                k, s = hf_generate(ids, args.max_tokens)
                n, wall, dec_n, dec_s = n + k, wall + s, dec_n + k - 1, dec_s + max(s - first, 1e-9)
        return n, wall, dec_n, dec_s

    run_ours(), run_hf()  # warm-up (kernels, caches, allocator)
    totals = {"tokenleap": [0, 0.0, 0, 0.0], "transformers": [0, 0.0, 0, 0.0]}
    for r in range(args.rounds):  # ABBA: A B, then B A
        order = [("tokenleap", run_ours), ("transformers", run_hf)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            got = fn()
            totals[name] = [a + b for a, b in zip(totals[name], got)]
            print(
                f"round {r} {name:12s} end to end {got[0] / got[1]:6.1f} tok/s, decode {got[2] / got[3]:6.1f} tok/s",
                flush=True,
            )
    tps = {k: v[0] / v[1] for k, v in totals.items()}
    dec = {k: v[2] / v[3] for k, v in totals.items()}
    ratio, dec_ratio = tps["tokenleap"] / tps["transformers"], dec["tokenleap"] / dec["transformers"]
    kept = "GGUF blocks kept" if llm.model.quantization else "dequantized"
    print(f"tokenleap {llm.config.dtype} ({kept}) against transformers bf16: decode {dec['tokenleap']:.1f} vs "
          f"{dec['transformers']:.1f} tok/s = {dec_ratio:.2f}x; end to end {tps['tokenleap']:.1f} vs "
          f"{tps['transformers']:.1f} tok/s = {ratio:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"max_tokens": args.max_tokens, "prompts": len(ids_list), "rounds": args.rounds,
                                    "tokens_per_second": tps, "ratio": ratio, "decode_tokens_per_second": dec,
                                    "decode_ratio": dec_ratio, "threads": torch.get_num_threads(),
                                    "tokenleap_quantization": llm.model.quantization}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
