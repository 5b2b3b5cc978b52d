"""Token-mask cost of three grammar engines on JSON schemas with the default model's tokenizer:
llguidance (Earley parser over a lexer, masks computed on the fly; tokenleap's backend), xgrammar
(pushdown automaton with a precompiled adaptive token-mask cache) and outlines-core (regex
compiled from the schema into a token-level DFA index).

For each schema a valid instance is tokenized with the model's tokenizer; each backend compiles
the schema (timed: the first request's extra latency), then walks the instance computing one
full-vocabulary mask per token before consuming it (timed: the per-token cost, the part paid at
every decoded or verified position). Min of `--repeats` walks. xgrammar and outlines-core are not
dependencies: install them only to run this (`pip install xgrammar outlines-core`); a missing
one is reported as skipped.

    .venv/bin/python benchmarks/grammar_backends.py     # -> results/grammar_backends.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

S = {"type": "string", "maxLength": 24}
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "person": (
        {
            "type": "object",
            "properties": {
                "name": S,
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "role": {"type": "string", "enum": ["admin", "user", "guest"]},
            },
            "required": ["name", "age", "role"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "role": "admin"},
    ),
    "order": (
        {
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
        {
            "id": 1042,
            "items": [{"product": "keyboard", "quantity": 2}, {"product": "mouse", "quantity": 1}],
            "status": "shipped",
        },
    ),
    "city": (
        {
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
        {
            "city": "Paris",
            "country": "France",
            "population": 2102650,
            "landmarks": ["Eiffel Tower", "Louvre", "Notre-Dame"],
        },
    ),
}

Walk = Callable[[], int]  # walks the instance once, returns masks computed


def _bytes_vocab(hf: Any, vocab_size: int) -> dict[bytes, list[int]]:
    """Token id -> raw bytes for a byte-level BPE tokenizer (GPT-2 byte alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), 256))
    )
    chars, n = list(printable), 0
    for b in range(256):  # GPT-2's byte -> printable character map, inverted
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    dec = {chr(c): b for b, c in zip(printable, chars)}
    out: dict[bytes, list[int]] = {}
    special = set(hf.all_special_ids)
    for i in range(min(vocab_size, len(hf))):
        if i in special:
            continue
        tok = hf.convert_ids_to_tokens(i)
        try:
            b = bytes(dec[c] for c in tok)
        except KeyError:
            b = tok.encode()
        out.setdefault(b, []).append(i)
    return out


def llguidance_backend(hf: Any, vocab: int) -> Callable[[dict[str, Any], list[int]], tuple[float, Walk]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)

    def prepare(schema: dict[str, Any], ids: list[int]) -> tuple[float, Walk]:
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = llguidance.LLMatcher(tok, grammar)
        lt.fill_next_token_bitmask(matcher, lt.allocate_token_bitmask(1, vocab))
        compile_s = time.perf_counter() - t0
        bitmask = lt.allocate_token_bitmask(1, vocab)

        def walk() -> int:
            matcher.reset()
            for t in ids:
                lt.fill_next_token_bitmask(matcher, bitmask)
                assert matcher.consume_token(t), matcher.get_error()
            return len(ids)

        return compile_s, walk

    return prepare


def xgrammar_backend(hf: Any, vocab: int) -> Callable[[dict[str, Any], list[int]], tuple[float, Walk]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def prepare(schema: dict[str, Any], ids: list[int]) -> tuple[float, Walk]:
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        matcher = xgr.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - t0
        bitmask = xgr.allocate_token_bitmask(1, vocab)

        def walk() -> int:
            matcher.reset()
            for t in ids:
                matcher.fill_next_token_bitmask(bitmask)
                assert matcher.accept_token(t)
            return len(ids)

        return compile_s, walk

    return prepare


def outlines_backend(hf: Any, vocab: int) -> Callable[[dict[str, Any], list[int]], tuple[float, Walk]]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    vocabulary = Vocabulary(hf.eos_token_id, _bytes_vocab(hf, vocab))

    def prepare(schema: dict[str, Any], ids: list[int]) -> tuple[float, Walk]:
        t0 = time.perf_counter()
        index = Index(build_regex_from_schema(json.dumps(schema)), vocabulary)
        compile_s = time.perf_counter() - t0
        mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

        def walk() -> int:
            guide = Guide(index)
            for t in ids:
                guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
                guide.advance(t)
            return len(ids)

        return compile_s, walk

    return prepare


BACKENDS = {"llguidance": llguidance_backend, "xgrammar": xgrammar_backend, "outlines-core": outlines_backend}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "grammar_backends.json")
    args = ap.parse_args()
    from tokenleap import LLM

    llm = LLM()  # the default model's tokenizer and vocabulary size
    hf, vocab = llm.tokenizer.hf, llm.model.config.vocab_size
    results: dict[str, Any] = {}
    for name, make in BACKENDS.items():
        try:
            prepare = make(hf, vocab)
        except ImportError as exc:
            print(f"{name}: skipped ({exc})")
            results[name] = {"skipped": str(exc)}
            continue
        rows = {}
        for case, (schema, instance) in CASES.items():
            ids = hf.encode(json.dumps(instance), add_special_tokens=False)
            compile_s, walk = prepare(schema, ids)
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                n = walk()
                best = min(best, (time.perf_counter() - t0) / n)
            rows[case] = {
                "tokens": len(ids),
                "compile_ms": round(compile_s * 1e3, 2),
                "mask_us_per_token": round(best * 1e6, 1),
            }
            print(
                f"{name:14s} {case:8s} tokens {len(ids):3d}  compile {compile_s * 1e3:8.2f} ms  "
                f"mask+advance {best * 1e6:8.1f} us/token"
            )
        mean = sum(r["mask_us_per_token"] for r in rows.values()) / len(rows)
        results[name] = {"cases": rows, "mean_mask_us_per_token": round(mean, 1),
                         "mean_compile_ms": round(sum(r["compile_ms"] for r in rows.values()) / len(rows), 2)}
        print(f"{name:14s} mean mask+advance {mean:.1f} us/token, mean compile {results[name]['mean_compile_ms']} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"vocab_size": vocab, "repeats": args.repeats, "backends": results}, indent=2) + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
