"""Teacher-forced replay of a trained EAGLE-3 head on Spec-Bench: how often each draft step agrees
with the target's greedy continuation, per group, next to the same figure on the trainer's own
held-out chats (OUTPUT/eval.json). This is the per-step accuracy the training loss optimises,
measured where the speed is measured (the chain's acceptance length follows from it).

For each of `--num-prompts` Spec-Bench first turns per group (chat template, greedy,
`--max-tokens` new tokens), one target forward over prompt + answer gives the aux states; the
head's training-time-test forward (`TrainableEagle3.ttt_logits`, proven equal to the runtime
chain by tests/train/test_trainer.py) predicts x_{i+k+2} at every answer position i for k < 4.

    .venv/bin/python benchmarks/head_replay.py --head /work/heads/smollm2-eagle3   # -> results/head_replay.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from tokenleap import LLM, SamplingParams
from tokenleap.bench import default_spec_bench, load_questions
from tokenleap.train.eagle3_head import TrainableEagle3
from tokenleap.train.trainer import forward_features

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", type=Path, required=True)
    ap.add_argument("--num-prompts", "-q", type=int, default=4, help="first turns per group")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=RESULTS / "head_replay.json")
    args = ap.parse_args(argv)

    llm = LLM()
    model = llm.engine.model
    head, d2t = TrainableEagle3.from_head(args.head, model)
    questions = load_questions(default_spec_bench(), args.num_prompts)
    convs = [[{"role": "user", "content": q.turns[0]}] for q in questions]
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
    hits: dict[str, list[int]] = {}
    counts: dict[str, int] = {}
    for q, conv, out in zip(questions, convs, outs):
        prompt = llm.chat_token_ids(conv)
        seq = prompt + out.outputs[0].token_ids
        f = forward_features(model, seq, head.shape.aux_layers)
        with torch.no_grad():
            logits = head.ttt_logits(f.aux.float()[None], torch.tensor([seq]), args.steps)
        rows = range(len(prompt) - 1, len(seq) - args.steps - 1)  # answer positions with every step's label
        h = hits.setdefault(q.group, [0] * args.steps)
        for k, lg in enumerate(logits):
            pred = d2t[lg[0].argmax(-1)]
            h[k] += sum(int(pred[i]) == seq[i + k + 2] for i in rows)
        counts[q.group] = counts.get(q.group, 0) + len(rows)
    by_group = {g: [h / counts[g] for h in hits[g]] for g in hits}
    total = [sum(hits[g][k] for g in hits) / sum(counts.values()) for k in range(args.steps)]
    heldout = None
    eval_file = args.head / "eval.json"
    if eval_file.is_file():
        heldout = json.loads(eval_file.read_text()).get("heldout_top1")
    result = {"date": datetime.date.today().isoformat(), "head": str(args.head), "prompts_per_group": args.num_prompts,
              "max_tokens": args.max_tokens, "spec_bench_top1_per_step": total, "by_group": by_group,
              "trainer_heldout_top1_per_step": heldout}
    for g, acc in by_group.items():
        print(f"{g:24s} " + " ".join(f"{a:.3f}" for a in acc))
    print(f"{'spec-bench overall':24s} " + " ".join(f"{a:.3f}" for a in total))
    if heldout:
        print(f"{'trainer held-out chats':24s} " + " ".join(f"{a:.3f}" for a in heldout))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
