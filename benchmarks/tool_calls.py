"""Tool calling under speculation: 24 chat requests with two tools (Hermes prompt built by
`server/tools.py`), `tool_choice` "required" and "auto", greedy, on the default model; plain
constrained decoding against suffix and ngram speculation (with grammar-forced drafts).

Checks: every "required" answer parses into calls of declared functions whose arguments validate
against the function's schema (`jsonschema`), and each speculative output is token for token the
plain one. Reports per method wall time, tokens/s, ratio to plain and mean acceptance length.

    .venv/bin/python benchmarks/tool_calls.py        # -> results/tool_calls.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import jsonschema

from tokenleap import LLM, SamplingParams
from tokenleap.server.tools import parse_tool_calls, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_flights",
        "description": "Flights between two cities on a date",
        "parameters": {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "maxLength": 24},
                "destination": {"type": "string", "maxLength": 24},
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            },
            "required": ["origin", "destination", "date"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, SEARCH]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Sydney"]
QUESTIONS = [f"What is the weather in {c} today?" for c in CITIES] + [
    f"Find me a flight from {a} to {b} on 2026-12-0{i + 1}."
    for i, (a, b) in enumerate(zip(CITIES, CITIES[1:] + CITIES[:1]))
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tool_calls.json")
    args = ap.parse_args()
    requests = []
    for choice in ("required", "auto"):
        plan = plan_tools(TOOLS, choice)
        for q in QUESTIONS:
            requests.append(
                (
                    choice,
                    plan,
                    plan.messages([{"role": "user", "content": q}], False),
                    SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=plan.constraint()),
                )
            )
    convs = [r[2] for r in requests]
    params = [r[3] for r in requests]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    results: dict[str, Any] = {}
    plain_ids: list[list[int]] | None = None
    for name, cfg in (("plain", None), ("suffix", {"method": "suffix"}), ("ngram", {"method": "ngram"})):
        llm = LLM(speculative_config=cfg, max_num_seqs=1)
        llm.chat(convs[:1], params[:1], use_tqdm=False)  # warm up
        t0 = time.perf_counter()
        outs = llm.chat(convs, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        ids = [o.outputs[0].token_ids for o in outs]
        valid = calls = 0
        for (choice, plan, _, _), o in zip(requests, outs):
            _, found = parse_tool_calls(o.outputs[0].text, plan)
            calls += bool(found)
            ok = all(
                jsonschema.Draft202012Validator(schemas[c["function"]["name"]]).is_valid(
                    json.loads(c["function"]["arguments"])
                )
                for c in found
            )
            valid += ok and (bool(found) or choice == "auto")
        tokens = sum(len(i) for i in ids)
        forwards = sum(o.metrics.num_forward_passes for o in outs)
        decode = sum(o.metrics.num_decode_tokens for o in outs)
        row = {"wall_s": round(wall, 2), "tokens": tokens, "tok_per_s": round(tokens / wall, 1),
               "answers_with_calls": calls, "valid": valid, "requests": len(outs),
               "acceptance_length": round(decode / forwards, 2) if forwards else 0.0}
        if plain_ids is None:
            plain_ids = ids
        else:
            row["identical_to_plain"] = sum(a == b for a, b in zip(ids, plain_ids))
            row["vs_plain"] = round(row["tok_per_s"] / results["plain"]["tok_per_s"], 2)
        results[name] = row
        print(name, row)
        del llm
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
