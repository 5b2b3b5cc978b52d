"""Structured output (JSON schema, regex, choice, Lark / GBNF grammar) through llguidance, exact
under speculation.

llguidance (Moskal et al., Microsoft's Guidance engine: an Earley parser over a lexer, computing a
token mask per step in tens of microseconds with no per-grammar precompilation) holds one matcher
per request, advanced along the committed tokens. Plain decoding masks each step's logits with the
matcher's allowed-token set. Speculation does exactly the same per verified position: the draft
is first cut at its first token the grammar forbids (so a forbidden token is never verified), then
the matcher walks the draft, filling one mask row per position, and rolls back; each verify row
is masked as plain decoding would mask that position, so greedy constrained speculation equals
greedy constrained decoding and sampled verification compares against the constrained target
distribution. Token trees are cut to their first path. Tokens the grammar forces (a fixed JSON
key, closing brackets) are proposed as the draft themselves: the mask leaves them the only
choice, so they are accepted and cost no guess.

JSON schemas are read strictly by default (`json_mode`, as vLLM's default backend and OpenAI's
strict mode do): an object schema that declares `properties` admits no others unless it says
`additionalProperties`, and the whitespace between JSON tokens is bounded, so a small model
cannot wander off into properties nobody asked for or pad forever; "lenient" reads a schema as
JSON Schema does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tokenleap.errors import TokenleapError

JsonMode = Literal["strict", "lenient"]
JSON_MODES: tuple[str, ...] = ("strict", "lenient")
# between JSON tokens: a few spaces, then at most one line break and an indent of at most 32
WHITESPACE = r"[ \t]{0,4}(?:\r?\n[ \t]{0,32})?"
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = (
    "additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
    "unevaluatedItems", "unevaluatedProperties"
)


def strict_schema(schema: Any) -> Any:
    """A copy of a JSON schema read strictly: every object schema that declares `properties` and
    says nothing of `additionalProperties` (nor `unevaluatedProperties`) gets
    `additionalProperties: false`, except where a sibling `allOf` / `anyOf` / `oneOf` / `$ref`
    or an enclosing `allOf` may add properties; and the top level gets bounded whitespace
    (`"x-guidance"`, unless the schema sets its own)."""
    out = _strict(schema, in_all_of=False)
    if isinstance(out, dict):
        out["x-guidance"] = {
            "whitespace_flexible": True,
            "whitespace_pattern": WHITESPACE,
            **(out.get("x-guidance") or {}),
        }
    return out


def _strict(schema: Any, in_all_of: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _strict(v, False) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_strict(v, False) for v in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_strict(v, len(out["allOf"]) > 1) for v in out["allOf"]]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key], False)
    if isinstance(out.get("items"), list):  # draft-04 tuples
        out["items"] = [_strict(v, False) for v in out["items"]]
    open_ended = in_all_of or any(
        k in out for k in ("allOf", "anyOf", "oneOf", "$ref", "additionalProperties", "unevaluatedProperties")
    )
    if isinstance(out.get("properties"), dict) and not open_ended:
        out["additionalProperties"] = False
    return out


def json_grammar_schema(schema: Any, mode: str) -> Any:
    """The schema llguidance compiles for `mode` ("strict" or "lenient")."""
    return strict_schema(schema) if mode == "strict" else schema


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams` (formerly `GuidedDecodingParams`): exactly one of these."""

    json: str | dict[str, Any] | None = None  # a JSON schema (dict or its text)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # llguidance's Lark dialect, or GBNF (a grammar with `::=`)
    json_object: bool = False  # any JSON object
    json_mode: JsonMode = "strict"  # how JSON schemas are read (the module's docstring)

    def __post_init__(self) -> None:
        if self.json_mode not in JSON_MODES:
            raise TokenleapError(f"json_mode must be 'strict' or 'lenient', got {self.json_mode!r}")
        if isinstance(self.json, dict):
            # key order kept: it is the order of the output's properties
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else tuple(self.choice)
            if not choice or any(not isinstance(c, str) or not c for c in choice):
                raise TokenleapError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choice)
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None] + (
            ["json_object"] if self.json_object else []
        )
        if len(given) != 1:
            raise TokenleapError(
                "structured outputs need exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}"
            )
        self.compile()  # a bad schema, regex or grammar fails here, before any work

    def compile(self) -> str:
        """The llguidance grammar (checked)."""
        import llguidance

        try:
            if self.json is not None:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json_grammar_schema(schema, self.json_mode))
            elif self.json_object:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    json_grammar_schema({"type": "object"}, self.json_mode)
                )
            elif self.regex is not None:
                grammar = llguidance.LLMatcher.grammar_from_regex(self.regex)
            elif self.choice is not None:
                grammar = llguidance.LLMatcher.grammar_from_regex(
                    "(" + "|".join(re.escape(c) for c in self.choice) + ")"
                )
            else:
                assert self.grammar is not None
                from llguidance.gbnf_to_lark import any_to_lark

                lark = any_to_lark(self.grammar)  # GBNF converted, Lark kept
                grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except Exception as exc:  # llguidance raises several kinds for a bad constraint  # noqa: BLE001
            raise TokenleapError(f"invalid structured output constraint: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar)  # "" when valid
        if error:
            raise TokenleapError(f"invalid structured output constraint: {error.strip()}")
        return grammar


class GrammarTokenizer:
    """llguidance's view of a model's tokenizer (built once per engine, on first use)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self.ll = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)


class GrammarState:
    """One request's matcher: masks for verify rows, cutting drafts, forced tokens, commits."""

    def __init__(
        self, tokenizer: GrammarTokenizer, params: StructuredOutputsParams, eos_ids: frozenset[int] = frozenset()
    ) -> None:
        import llguidance

        self.vocab = tokenizer.vocab_size
        self.eos_ids = eos_ids
        self.matcher = llguidance.LLMatcher(tokenizer.ll, params.compile())
        if self.matcher.is_error():
            raise TokenleapError(f"invalid structured output constraint: {self.matcher.get_error()}")

    def cut(self, draft: Sequence[int]) -> list[int]:
        """The longest prefix of `draft` the grammar allows."""
        draft = list(draft)
        return draft[: self.matcher.validate_tokens(draft)] if draft else draft

    def forced(self) -> list[int]:
        """Tokens the grammar allows as the only continuation from here."""
        return list(self.matcher.compute_ff_tokens())

    def masked(self, logits: torch.Tensor, draft: Sequence[int]) -> torch.Tensor:
        """`logits` `[len(draft) + 1, V]` with each row's forbidden tokens at -inf: row 0 at the
        committed state, row i after draft[:i] (`draft` must be allowed: see `cut`)."""
        import llguidance.torch as lt

        rows = len(draft) + 1
        bitmask = lt.allocate_token_bitmask(rows, self.vocab)
        lt.fill_next_token_bitmask(self.matcher, bitmask, 0)
        consumed = 0
        try:
            for i, tok in enumerate(draft):
                # Never walk past the end: consuming EOS (or anything once the grammar is complete)
                # leaves a state that rollback does not restore. Rows after it are never kept (the
                # request ends there), so they stay unmasked.
                if tok in self.eos_ids or self.matcher.is_stopped():
                    break
                if not self.matcher.consume_token(tok):
                    raise TokenleapError(f"draft token {tok} is not allowed by the grammar (the draft was not cut)")
                consumed += 1
                lt.fill_next_token_bitmask(self.matcher, bitmask, i + 1)
        finally:
            if consumed:
                self.matcher.rollback(consumed)
        out = logits.float().clone()
        lt.apply_token_bitmask_inplace(out, bitmask)
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance past committed tokens."""
        for tok in tokens:
            if not self.matcher.consume_token(tok):
                raise TokenleapError(f"committed token {tok} is not allowed by the grammar: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar admits nothing more (the text is complete)."""
        return bool(self.matcher.is_stopped())
