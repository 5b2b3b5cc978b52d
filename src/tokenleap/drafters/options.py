"""`speculative_config`'s flat option keys and the methods they belong to.

A method's options are a dataclass of its own (`MethodRecord.options`); users and the server give
them as top-level keys (`{"method": "ngram", "prompt_lookup_max": 3}`) or per method
(`method_options={"ngram": {...}}`). This module splits flat keys between a method (or a chain's
members: a key two members share goes to both), merges them over given options, and freezes the
result into `SpecConfig.method_options`' form, one options instance per involved method. A key of
a built-in method the config does not use is validated by that method and dropped, as when
`SpecConfig` held every option; a former option name is an error that names the new one.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from tokenleap.drafters.methods import make_options, renamed_note, renamed_options
from tokenleap.drafters.registry import all_methods, builtin_methods, canonical, find, get, members
from tokenleap.errors import TokenleapError


def builtin_option_names() -> frozenset[str]:
    """Every option name of the built-in methods: `speculative_config` keys (and SpecConfig
    keyword arguments) taken whatever the method, as they were when SpecConfig held them all;
    options of methods a config does not use are validated and dropped."""
    return frozenset(f.name for r in builtin_methods() for f in r.option_fields)


def renamed() -> dict[str, str]:
    """Every method's former option names -> their names now."""
    return {old: new for r in all_methods() for old, new in renamed_options(r).items()}


def unknown_keys_note(keys: Iterable[str]) -> str:
    """' (X is now Y)' for keys that are former option names, else ''."""
    return renamed_note(keys, renamed())


def option_owners(method: str) -> dict[str, list[str]]:
    """Option name -> the involved methods (`method`, or a chain's members) that have it."""
    owners: dict[str, list[str]] = {}
    for name in members(method):
        record = find(name)
        if record is not None:
            for f in record.option_fields:
                owners.setdefault(f.name, []).append(record.name)
    return owners


def split_options(method: str, flat: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Top-level `speculative_config` keys that are options of `method` (or of a chain's
    members: a key two members share goes to both) as {method: {option: value}}, and the rest."""
    owners = option_owners(method)
    options: dict[str, dict[str, Any]] = {}
    rest: dict[str, Any] = {}
    for key, value in flat.items():
        if key in owners:
            for name in owners[key]:
                options.setdefault(name, {})[key] = value
        else:
            rest[key] = value
    return options, rest


def flat_options(method: str, flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Top-level option keys (`speculative_config`'s flat spelling) as {method: {option: value}}:
    the options of `method` (or its chain's members), and built-in options of methods it does not
    use, checked by those methods' options and dropped (an error if bad, as they always were).
    A key that is neither is a TokenleapError naming it."""
    options, rest = split_options(method, flat)
    others: dict[str, dict[str, Any]] = {}
    for key, value in rest.items():
        owners = [r for r in builtin_methods() if r.option_field(key) is not None]
        if not owners:
            raise TokenleapError(f"speculative method {method!r} has no option(s) {key}{unknown_keys_note([key])}")
        for r in owners:
            others.setdefault(r.name, {})[key] = value
    for name, raw in others.items():
        make_options(get(name), raw)
    return options


def normalize_options(involved: Iterable[str], given: Any) -> tuple[tuple[str, Any], ...]:
    """`SpecConfig.method_options` in its frozen form: (method, options instance) for every
    involved method that has options, in order, defaults filled in. `given` maps method names
    (any spelling) to option mappings or instances; options of registered methods not involved
    are dropped (a chain's member config), unknown method names are an error."""
    pairs = given.items() if isinstance(given, Mapping) else (given or ())
    by_name: dict[str, Any] = {}
    for key, value in pairs:
        record = find(key)
        if record is None or record.options is None:
            raise TokenleapError(f"method_options: {key!r} is not a method with options")
        by_name[record.name] = value
    out = []
    for name in dict.fromkeys(involved):
        record = find(name)
        if record is not None and record.options is not None:
            out.append((record.name, make_options(record, by_name.get(record.name, {}))))
    return tuple(out)


def merge_options(given: Any, updates: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """`given` (method_options in any accepted form, or None) with `updates` ({method: {option:
    value}}) laid over it, as {method: {option: value}}."""
    pairs = given.items() if isinstance(given, Mapping) else (given or ())
    out: dict[str, dict[str, Any]] = {}
    for key, value in pairs:
        name = canonical(key)
        is_instance = dataclasses.is_dataclass(value) and not isinstance(value, type)
        out[name] = (
            dict(value)
            if isinstance(value, Mapping)
            else dataclasses.asdict(typing.cast(Any, value))
            if is_instance
            else value
        )
    for name, opts in updates.items():
        out[canonical(name)] = {**out.get(canonical(name), {}), **opts}
    return out


__all__ = [
    "builtin_option_names", "flat_options", "merge_options", "normalize_options", "option_owners", "renamed",
    "split_options", "unknown_keys_note"
]
