"""The methods' server face, derived from the method records: the methods a request may pick
(`MethodRecord.per_request`), the options it may set (`option(per_request=...)`) as JSON schema
properties of the per-request `speculative` object, and their per-request limits
(`option(request_max=...)`). `server/protocol.py` and `server/handlers.py` read these.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from tokenleap.drafters.cli_flags import OptionOf, option_help
from tokenleap.drafters.methods import is_per_request, option_types
from tokenleap.drafters.registry import all_methods

_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}


def request_methods() -> tuple[str, ...]:
    """The methods a server request may pick."""
    return tuple(r.name for r in all_methods() if r.per_request)


def server_side_methods() -> frozenset[str]:
    """Methods a server request may not pick (objects or files only the operator chooses)."""
    return frozenset(r.name for r in all_methods() if not r.per_request)


def per_request_options() -> dict[str, list[OptionOf]]:
    """Option name -> (method, field) of every method a server request may pick."""
    out: dict[str, list[OptionOf]] = {}
    for r in all_methods():
        if r.per_request:
            for f in r.option_fields:
                if is_per_request(f):
                    out.setdefault(f.name, []).append((r, f))
    return out


def request_max(owners: Sequence[OptionOf]) -> float | None:
    """The largest value a server request may give an option (the least of its methods' `request_max`)."""
    limits: list[float] = [
        f.metadata["request_max"] for _, f in owners if f.metadata and f.metadata.get("request_max") is not None
    ]
    return min(limits) if limits else None


def check_request_options(flat: Mapping[str, Any]) -> None:
    """A server request's option values against their `request_max` (a ValueError naming it)."""
    owners = per_request_options()
    for key, value in flat.items():
        limit = request_max(owners.get(key, []))
        if limit is not None and isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit:
            raise ValueError(f"{key} must be <= {limit} in a request, got {value}")


def _json_type(tp: Any) -> dict[str, Any]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {"anyOf": [_json_type(a) for a in args]}
    return {"type": _JSON_TYPES[tp]} if tp in _JSON_TYPES else {}


def options_json_schema() -> dict[str, dict[str, Any]]:
    """The server's per-request schema of method options: a JSON schema property per option."""
    props: dict[str, dict[str, Any]] = {}
    for option, owners in per_request_options().items():
        r, f = owners[0]
        prop = dict(_json_type(option_types(r).get(option)))
        prop["description"] = "; ".join(option_help(rec, fld) for rec, fld in owners)
        if f.default is not dataclasses.MISSING:
            prop["default"] = f.default
        limit = request_max(owners)
        if limit is not None:
            prop["maximum"] = limit
        props[option] = prop
    return props


__all__ = [
    "check_request_options", "options_json_schema", "per_request_options", "request_max", "request_methods",
    "server_side_methods"
]
