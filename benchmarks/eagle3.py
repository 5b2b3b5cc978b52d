"""EAGLE-3 heads on the default model: the cost of a draft step against a target step, and (when
a trained head is given) acceptance length and tokens/s against plain decoding on Spec-Bench.

Cost: on the loaded bf16 target with its kernels, the fastest of `--repeats` timings at a
context of `--context` tokens of (a) a target decode step (one row through the 30 layers plus
the LM head), (b) one chain step of the head (one row through its layer plus its draft LM head),
(c) the draft LM head alone, (d) one tree level of `--topk` rows, (e) the head's fusion of the
three aux states (`fc`, once per committed token). The cost does not depend on the head's
weights, so without a trained head a random one of the same shape (`--draft-vocab`) is timed.

Quality and speed (only with a head, `--head`, default /work/heads/smollm2-eagle3): `--num-prompts`
Spec-Bench first turns, groups in turn, chat template, greedy, `--max-tokens` new tokens, run by
`tokenleap.bench.run_bench` (one shared cost curve, engines in rotated order per question) for
plain decoding, the head's chains, the head's trees (`--tree`, topk:depth), prompt lookup, the
suffix tree, and the chain suffix+eagle3 (the suffix tree's draft when it has one, else the head's);
every output is compared with plain decoding's.

    .venv/bin/python benchmarks/eagle3.py                    # -> results/eagle3.json
    .venv/bin/python benchmarks/eagle3.py --cost-only --draft-vocab 8192,32000
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tokenleap import LLM, SpecConfig
from tokenleap.bench import default_spec_bench, load_questions, run_bench, summarize
from tokenleap.heads.base import DraftHead, HeadKV
from tokenleap.heads.loader import load_eagle3

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_HEAD = Path("/work/heads/smollm2-eagle3")


def random_head_dir(model: Any, draft_vocab: int, folder: Path) -> Path:
    """A random-weight head in the EAGLE-3 layout shaped for `model` (for timing only)."""
    from safetensors.torch import save_file

    c = model.config
    h, inter, n = c.hidden_size, c.intermediate_size, c.num_layers
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)

    p = "midlayer."
    t = {
        "fc.weight": rnd(h, 3 * h), p + "input_layernorm.weight": torch.ones(h),
        p + "hidden_norm.weight": torch.ones(h), p + "self_attn.q_proj.weight": rnd(c.q_size, 2 * h),
        p + "self_attn.k_proj.weight": rnd(c.kv_size, 2 * h), p + "self_attn.v_proj.weight": rnd(c.kv_size, 2 * h),
        p + "self_attn.o_proj.weight": rnd(h, c.q_size), p + "post_attention_layernorm.weight": torch.ones(h),
        p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
        p + "mlp.down_proj.weight": rnd(h, inter), "norm.weight": torch.ones(h), "lm_head.weight": rnd(draft_vocab, h),
        "d2t": torch.zeros(draft_vocab, dtype=torch.int64)
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
              "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
              "max_position_embeddings": c.max_position, "hidden_act": "silu", "vocab_size": c.vocab_size,
              "draft_vocab_size": draft_vocab, "num_hidden_layers": 1, "tie_word_embeddings": False,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, n // 2, n - 3]}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _best(fn: Any, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def measure_costs(model: Any, head: DraftHead, context: int, topk: int, repeats: int) -> dict[str, float]:
    kv = model.new_kv_cache(context + 4)
    ids = torch.arange(context) % 1000 + 100
    model.forward(ids, torch.arange(context), kv)

    def target_step() -> None:
        kv.truncate(context)
        model.compute_logits(model.forward(torch.tensor([17]), torch.tensor([context]), kv).hidden)

    c = head.config
    hkv = HeadKV(c.num_kv_heads, c.head_dim, context + 64)
    g = torch.randn(context, c.hidden_size)
    head.layer(
        g,
        head.embed_tokens(ids.tolist()),
        torch.arange(context),
        hkv,
        torch.ones(context, context, dtype=torch.bool).tril(),
    )
    h1, hk = torch.randn(1, c.hidden_size), torch.randn(topk, c.hidden_size)

    def chain_step() -> None:
        hkv.truncate(context)
        head.logits(
            head.layer(
                h1, head.embed_tokens([17]), torch.tensor([context]), hkv, torch.ones(1, context + 1, dtype=torch.bool)
            )
        )

    def tree_level() -> None:
        hkv.truncate(context)
        vis = torch.ones(topk, context + topk, dtype=torch.bool)
        head.logits(head.layer(hk, head.embed_tokens([17] * topk), torch.full((topk,), context), hkv, vis))

    aux = torch.randn(1, 3 * c.target_hidden_size)
    t = {
        "target_step_ms": _best(target_step, repeats) * 1e3,
        "head_chain_step_ms": _best(chain_step, repeats) * 1e3,
        "head_lm_head_ms": _best(lambda: head.logits(h1), repeats) * 1e3,
        f"head_tree_level_{topk}_rows_ms": _best(tree_level, repeats) * 1e3,
        "head_fc_ms": _best(lambda: head.fuse(aux), repeats) * 1e3,
    }
    t["chain_step_over_target_step"] = t["head_chain_step_ms"] / t["target_step_ms"]
    t["lm_head_share_of_chain_step"] = t["head_lm_head_ms"] / t["head_chain_step_ms"]
    t["tree_level_over_target_step"] = t[f"head_tree_level_{topk}_rows_ms"] / t["target_step_ms"]
    kv.free()
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", type=Path, default=DEFAULT_HEAD)
    ap.add_argument(
        "--cost-only", action="store_true", help="only time the draft step (a random head when --head is absent)"
    )
    ap.add_argument(
        "--draft-vocab",
        default="2048,8192,32000,49152",
        help="draft vocabularies (comma list) of the random heads timed without --head",
    )
    ap.add_argument("--num-prompts", "-n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-max", type=int, default=6, help="chain length cap (num_speculative_tokens)")
    ap.add_argument("--tree", default="4:4:12", help="topk:depth:nodes of the tree config ('' for none)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, default=RESULTS / "eagle3.json")
    args = ap.parse_args(argv)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    llm = LLM(quantization="none")  # the bf16 target the heads here were trained and measured on
    model, tok = llm.model, llm.tokenizer
    have_head = args.head.is_dir()
    costs_by_vocab: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        vocabs = [0] if have_head else [int(v) for v in str(args.draft_vocab).split(",")]
        for v in vocabs:
            head_dir = args.head if have_head else random_head_dir(model, v, Path(tmp) / f"head{v}")
            head = load_eagle3(head_dir, model)
            costs_by_vocab[head.config.draft_vocab_size] = measure_costs(
                model, head, args.context, args.topk, args.repeats
            )
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "head": str(args.head) if have_head else "random weights (cost only)",
        "context": args.context,
        "costs_by_draft_vocab": costs_by_vocab,
    }
    print(json.dumps(costs_by_vocab, indent=1))
    if not have_head or args.cost_only:
        if not have_head:
            print(f"no head at {args.head}: acceptance and tokens/s await a trained head", file=sys.stderr)
    else:
        questions = load_questions(default_spec_bench(), args.num_prompts)
        by_group: dict[str, list[Any]] = {}
        for q in questions:
            by_group.setdefault(q.group, []).append(q)
        mixed = [q for i in range(args.num_prompts) for qs in by_group.values() if i < len(qs) for q in [qs[i]]][
            : args.num_prompts
        ]
        mixed = [type(q)(q.question_id, q.group, q.turns[:1], q.assistant_prefix, q.stop, q.max_tokens) for q in mixed]
        methods = {
            f"eagle3-chain{args.draft_max}": SpecConfig(
                method="eagle3", model=str(args.head), num_speculative_tokens=args.draft_max
            )
        }
        if args.tree:
            k, d, n = (int(x) for x in args.tree.split(":"))
            methods[f"eagle3-tree{k}x{d}n{n}"] = SpecConfig(
                method="eagle3", model=str(args.head), num_speculative_tokens=n, tree_topk=k, tree_depth=d
            )
        methods["ngram"] = SpecConfig(method="ngram", num_speculative_tokens=args.draft_max)
        methods["suffix"] = SpecConfig(method="suffix", num_speculative_tokens=args.draft_max)
        # the suffix tree where the text repeats, the head elsewhere
        methods["suffix+eagle3"] = SpecConfig(
            method="suffix+eagle3", model=str(args.head), num_speculative_tokens=args.draft_max
        )
        records = run_bench(model, tok, mixed, methods, args.max_tokens)
        summary = summarize(records)
        result["summary"] = summary
        result["records"] = [r.__dict__ for r in records]
        for name, fig in summary["overall"].items():
            print(
                f"{name:24s} acceptance {fig['mean_acceptance_length']:.2f}  tok/s {fig['tokens_per_second']:.1f}  "
                f"x{fig['speedup']:.2f} e2e  x{fig['decode_speedup']:.2f} decode  "
                f"matched {fig['matched_plain']}/{fig['prompts']}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
