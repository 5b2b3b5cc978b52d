"""Structured output under speculation: 50 constrained requests on the default model, plain
constrained decoding against suffix and prompt-lookup speculation (with grammar-forced drafts).

Requests: 48 JSON-schema requests (six schemas of nested objects, enums, arrays and bounded
strings, eight prompts each), one regex and one choice request; chat template, greedy,
`--max-tokens` (default 160). Checks: every JSON output parses and validates against its schema
(`jsonschema`), the regex and choice outputs match, and each speculative output is token for token
the plain one. Reports per method wall time, tokens/s and ratio to plain, mean acceptance length,
and the grammar's cost: llguidance mask time per masked row (one row per verified position).

    .venv/bin/python benchmarks/structured_outputs.py            # -> results/structured_outputs.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path

import jsonschema
import torch

from tokenleap import LLM, SamplingParams
from tokenleap.structured import GrammarState, StructuredOutputsParams

S = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": S,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"product": S, "quantity": {"type": "integer", "minimum": 1}},
                    "required": ["product", "quantity"],
                    "additionalProperties": False,
                },
            },
            "status": {"type": "string", "enum": ["pending", "shipped", "delivered"]},
        },
        "required": ["id", "items", "status"],
        "additionalProperties": False,
    },
    "city": {
        "type": "object",
        "properties": {
            "city": S,
            "country": S,
            "population": {"type": "integer"},
            "landmarks": {"type": "array", "items": S, "maxItems": 3},
        },
        "required": ["city", "country", "population", "landmarks"],
        "additionalProperties": False,
    },
    "book": {
        "type": "object",
        "properties": {
            "title": S,
            "author": {
                "type": "object",
                "properties": {"first": S, "last": S},
                "required": ["first", "last"],
                "additionalProperties": False,
            },
            "year": {"type": "integer"},
            "genres": {
                "type": "array",
                "items": {"type": "string", "enum": ["fiction", "science", "history", "poetry"]},
                "maxItems": 2,
            },
        },
        "required": ["title", "author", "year", "genres"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "name": S,
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "online": {"type": "boolean"},
        },
        "required": ["name", "date", "online"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "product": S,
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "pros": {"type": "array", "items": S, "maxItems": 2},
            "cons": {"type": "array", "items": S, "maxItems": 2},
        },
        "required": ["product", "rating", "pros", "cons"],
        "additionalProperties": False,
    },
}
TOPICS = [
    "a software engineer in Berlin", "a busy online shop", "a small coastal town", "a classic novel",
    "a science conference", "a new smartphone", "a family restaurant", "a mountain hiking trip"
]
REGEX = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]


def requests() -> list[tuple[str, list[dict[str, str]], StructuredOutputsParams, object]]:
    out = []
    for name, schema in SCHEMAS.items():
        for topic in TOPICS:
            msg = [{"role": "user", "content": f"Write a JSON object ({name}) about {topic}."}]
            out.append((name, msg, StructuredOutputsParams(json=schema), schema))
    out.append(("regex", [{"role": "user", "content": "Make up a US phone number."}],
                StructuredOutputsParams(regex=REGEX), REGEX))
    out.append(("choice", [{"role": "user", "content": "Sentiment of 'I loved this film'?"}],
                StructuredOutputsParams(choice=CHOICES), CHOICES))
    return out


def valid(kind: str, text: str, check: object) -> bool:
    if kind == "regex":
        return re.fullmatch(str(check), text) is not None
    if kind == "choice":
        return text in check  # type: ignore[operator]
    try:
        jsonschema.validate(json.loads(text), check)  # type: ignore[arg-type]
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "structured_outputs.json")
    args = ap.parse_args(argv)
    reqs = requests()
    convs = [m for _, m, _, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=so) for _, _, so, _ in reqs]
    mask = {"seconds": 0.0, "rows": 0}
    real = GrammarState.masked

    def timed(self: GrammarState, logits: torch.Tensor, draft: Sequence[int]) -> torch.Tensor:
        t0 = time.perf_counter()
        out = real(self, logits, draft)
        mask["seconds"] += time.perf_counter() - t0
        mask["rows"] += len(draft) + 1
        return out

    GrammarState.masked = timed  # type: ignore[method-assign]
    results = {}
    plain_ids = None
    for label, cfg in (("plain", None), ("suffix", {"method": "suffix"}), ("ngram", {"method": "ngram"})):
        llm = LLM(speculative_config=cfg, max_num_seqs=1)  # one at a time: tokens/s per request
        llm.chat(convs[:1], params[:1], use_tqdm=False)  # warm up (llguidance builds its tokenizer view)
        mask["seconds"], mask["rows"] = 0.0, 0
        t0 = time.perf_counter()
        outs = llm.chat(convs, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        ids = [o.outputs[0].token_ids for o in outs]
        tokens = sum(len(i) for i in ids)
        forwards = sum(o.metrics.num_forward_passes for o in outs)
        decode = sum(o.metrics.num_decode_tokens for o in outs)
        results[label] = {
            "valid": sum(valid(k, o.outputs[0].text, c) for (k, _, _, c), o in zip(reqs, outs)),
            "identical_to_plain": None if plain_ids is None else sum(a == b for a, b in zip(ids, plain_ids)),
            "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "acceptance_length": decode / forwards if forwards else 1.0,
            "mask_us_per_row": 1e6 * mask["seconds"] / max(1, mask["rows"]), "mask_share": mask["seconds"] / wall,
        }
        if plain_ids is None:
            plain_ids = ids
    GrammarState.masked = real  # type: ignore[method-assign]
    base = results["plain"]["tokens_per_s"]
    print(
        f"{'method':8s} {'valid':>6s} {'same':>5s} {'tok/s':>7s} {'vs plain':>8s} "
        f"{'acc.len':>7s} {'mask us/row':>11s} {'mask share':>10s}"
    )
    for label, r in results.items():
        same = "-" if r["identical_to_plain"] is None else f"{r['identical_to_plain']}"
        print(
            f"{label:8s} {r['valid']:>3d}/{len(reqs)} {same:>5s} "
            f"{r['tokens_per_s']:7.1f} {r['tokens_per_s'] / base:7.2f}x "
            f"{r['acceptance_length']:7.2f} {r['mask_us_per_row']:11.0f} {100 * r['mask_share']:9.1f}%"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"requests": len(reqs), "results": results, "meta": {k: str(v) for k, v in vars(args).items()}}, indent=1
        )
    )
    ok = all(r["valid"] == len(reqs) for r in results.values()) and all(
        r["identical_to_plain"] in (None, len(reqs)) for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
