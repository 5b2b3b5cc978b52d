"""A draft model at the sizes users run: SmolLM2-135M drafting for a SmolLM2-1.7B-shaped target
(same tokenizer), issue "real model sizes" item 6(b).

The target is a random-weight GGUF in SmolLM2-1.7B's shape (`benchmarks/make_gguf.py --shape
smollm2-1.7b`): its speed is real, its text is not, so the draft model's real acceptance on it is
about 0. What the benchmark measures, in one process, back to back:

* costs: the target's one-row decode step, its verify cost curve (k+1 rows against one), and the
  draft model's decode step relative to the target's (`d`, paid per draft token);
* the break-even acceptance of each draft length k: the per-token acceptance alpha at which
  E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) tokens per step pay for c(k) + k d (Leviathan
  et al., 2023), and the draft length the engine's adaptive controller (`DraftController`) picks
  for each alpha given the measured costs;
* measured speedups with the draft model's real cost: a drafter that runs the 135M draft model
  for every proposal (paying its full cost, cache kept in sync) and then proposes the recorded
  greedy continuation, right with probability p per token: decode tokens/s against plain, for
  fixed k and for the adaptive controller, and whether the output stays identical to plain;
* the real draft model on the random target (acceptance ~0): what speculation costs when it
  loses, with the adaptive controller switching it off.

    .venv/bin/python benchmarks/draft_at_size.py benchmarks/.peer/models/smollm2-1.7b-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name, csv_of  # noqa: E402

from tokenleap import LLM, SamplingParams, SpecConfig  # noqa: E402
from tokenleap.drafters.base import Draft, DraftRequest  # noqa: E402
from tokenleap.drafters.draft_model import DraftModelDrafter  # noqa: E402
from tokenleap.engine.speculation import CostCurve, DraftController, expected_tokens, measure_cost_curve  # noqa: E402
from tokenleap.models.llama import LlamaModel  # noqa: E402


class CostedReplayDrafter:
    """Runs a real draft model for every proposal (its cost, its cache), then proposes the
    recorded greedy continuation instead, each token right with probability `p`."""

    name = "costed-replay"
    needs_hidden_states = False

    def __init__(self, inner: DraftModelDrafter, reference: Sequence[int], p: float, seed: int = 0) -> None:
        self.inner, self.reference, self.p, self.rng = inner, list(reference), p, random.Random(seed)

    def begin(self, request: DraftRequest) -> None:
        self.inner.begin(request)

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        drafted = self.inner.propose(request_id, tokens, max_tokens).tokens
        n = len(tokens)
        if list(tokens) != self.reference[:n]:
            return Draft([])
        truth = self.reference[n : n + len(drafted)]
        return Draft([t if self.rng.random() < self.p else (t + 1) % 1000 for t in truth])

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        self.inner.accept(request_id, tokens, num_accepted)

    def end(self, request_id: str) -> None:
        self.inner.end(request_id)


def step_seconds(model: LlamaModel, context: int, repeats: int = 10) -> float:
    """One decode step (a row, its logits) at `context` tokens: the fastest of `repeats`."""
    kv = model.new_kv_cache(context + 2)
    model.forward(torch.arange(context) % model.config.vocab_size, torch.arange(context), kv)
    best = float("inf")
    for _ in range(repeats):
        kv.truncate(context)
        t0 = time.perf_counter()
        model.compute_logits(model.forward(torch.tensor([17]), torch.tensor([context]), kv).hidden)
        best = min(best, time.perf_counter() - t0)
    kv.free()
    return best


def break_even(curve: CostCurve, d: float, k: int, context: int) -> float | None:
    """The smallest alpha (to 0.01) at which a k-token draft beats plain decoding."""
    for i in range(101):
        alpha = i / 100
        if expected_tokens(alpha, k) > curve.cost(k, context) + k * d:
            return alpha
    return None


def controller_choice(curve: CostCurve, d: float, alpha: float, cap: int, context: int) -> tuple[int, float]:
    """The adaptive controller's draft length and expected speedup at a settled `alpha`."""
    ctl = DraftController(curve=curve, cap=cap, draft_cost=d, accepted=alpha * 1000, trials=1000.0)
    k = ctl.choose(cap, context)
    return k, (expected_tokens(alpha, k) / ctl.step_cost(k, context) if k else 1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path, help="SmolLM2-1.7B-shaped GGUF (benchmarks/make_gguf.py --shape smollm2-1.7b)")
    ap.add_argument("--draft", default="smollm2-135m-instruct", help="the draft model (default: the default model)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per run")
    ap.add_argument("--lengths", type=csv_of(int), default="2,4,6", help="fixed draft lengths to run")
    ap.add_argument("--probs", type=csv_of(float), default="1.0,0.8,0.6", help="replay acceptance probabilities to run")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "draft_at_size.json")
    args = ap.parse_args(argv)
    if not args.target.is_file():
        ap.error(
            f"no such file: {args.target} (make it with benchmarks/make_gguf.py --shape smollm2-1.7b --types Q4_K_M)"
        )
    lengths, probs = args.lengths, args.probs
    target = LLM(model=str(args.target))
    draft = LLM(model=args.draft)
    if target.tokenizer.hf.get_vocab() != draft.tokenizer.hf.get_vocab():
        ap.error("the draft model's tokenizer differs from the target's (this benchmark needs a shared vocabulary)")
    context, cap = 256, max(8, max(lengths))
    t_target = step_seconds(target.model, context)
    t_draft = step_seconds(draft.model, context)
    d = t_draft / t_target
    curve = measure_cost_curve(target.model, cap, repeats=3)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "command": " ".join(sys.argv),
                              "target": args.target.name, "draft": args.draft, "target_step_ms": t_target * 1e3,
                              "draft_step_ms": t_draft * 1e3, "draft_cost": d,
                              "verify_cost": {k: curve.cost(k, context) for k in range(1, cap + 1)}}
    print(
        f"target step {t_target * 1e3:.1f} ms, draft step {t_draft * 1e3:.2f} ms: d = {d:.3f} per draft token; "
        f"verify cost k=1..{cap}: {', '.join(f'{curve.cost(k, context):.2f}' for k in range(1, cap + 1))}",
        flush=True,
    )
    result["break_even"] = {k: break_even(curve, d, k, context) for k in range(1, cap + 1)}
    result["controller"] = {}
    for alpha in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        k, gain = controller_choice(curve, d, alpha, cap, context)
        result["controller"][alpha] = {"k": k, "expected_speedup": gain}
    print("break-even alpha by k: " + ", ".join(f"{k}: {a}" for k, a in result["break_even"].items()))
    print(
        "controller: "
        + ", ".join(f"alpha {a}: k={v['k']} ({v['expected_speedup']:.2f}x)" for a, v in result["controller"].items()),
        flush=True,
    )

    ids = target.chat_token_ids(
        [{"role": "user", "content": "Explain how a hash map works, with an example in Python."}]
    )
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def run(spec: SpecConfig | None) -> tuple[list[int], float, Any]:
        req = target.engine.run(target.engine.add_request(ids, params, speculative=spec or False))
        m = req.metrics
        return list(req.output_ids), m.num_decode_tokens / m.decode_seconds, m

    plain_ids, _, _ = run(None)
    reference = ids + plain_ids
    rows: list[dict[str, Any]] = []
    for p in probs:
        for k in [*lengths, 0]:  # 0: adaptive, capped at max(lengths)
            _, plain_tps, _ = run(None)
            drafter = CostedReplayDrafter(DraftModelDrafter(draft.model), reference, p)
            spec = SpecConfig(
                method="custom", drafter=drafter, num_speculative_tokens=k or max(lengths), adaptive=k == 0
            )
            out, tps, m = run(spec)
            row = {
                "p": p,
                "k": k or "adaptive",
                "plain_tps": plain_tps,
                "spec_tps": tps,
                "speedup": tps / plain_tps,
                "tokens_per_forward": m.mean_acceptance_length,
                "mean_draft_len": m.spec.num_draft_tokens / max(1, m.num_forward_passes),
                "identical": out == plain_ids,
            }
            rows.append(row)
            print(
                f"  p={p} k={row['k']}: {tps:.1f} vs plain {plain_tps:.1f} tok/s ({row['speedup']:.2f}x), "
                f"{row['tokens_per_forward']:.2f} tokens/forward, mean draft {row['mean_draft_len']:.2f}, "
                f"identical={row['identical']}",
                flush=True,
            )
    _, plain_tps, _ = run(None)
    out, tps, m = run(SpecConfig(method="draft-model", model=args.draft, num_speculative_tokens=max(lengths)))
    rows.append(
        {
            "p": "real draft model",
            "k": "adaptive",
            "plain_tps": plain_tps,
            "spec_tps": tps,
            "speedup": tps / plain_tps,
            "tokens_per_forward": m.mean_acceptance_length,
            "acceptance_rate": m.spec.acceptance_rate,
            "mean_draft_len": m.spec.num_draft_tokens / max(1, m.num_forward_passes),
            "identical": out == plain_ids,
        }
    )
    print(f"  real draft model (acceptance {m.spec.acceptance_rate:.2f}): {tps:.1f} vs plain {plain_tps:.1f} tok/s "
          f"({tps / plain_tps:.2f}x), identical={out == plain_ids}", flush=True)
    result["runs"] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
