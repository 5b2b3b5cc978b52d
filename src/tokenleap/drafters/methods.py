"""Speculative methods as records: one `MethodRecord` per method, everything else derived.

A method is its name, its aliases, a one-line help, its own options (a frozen dataclass whose
fields are the option names with their defaults, made with `option(...)` to carry their help,
CLI spellings and server limits, and whose `__post_init__` validates them with a
`TokenleapError` naming the option), the factory, whether a server request may pick it and
whether it needs a model path. Each built-in method's record and options sit next to its drafter
and are listed once in `tokenleap.drafters.BUILTIN_METHODS`; a user's method comes in through
`register_method(record)` or the entry point group `tokenleap.methods` (each entry point loads a
MethodRecord; read lazily, once per process). `SpecConfig` keeps the engine-wide controls and one
options object per method it uses (`method_options`).

Derived from the records: the method names and aliases `SpecConfig` accepts
(`method_names`, `canonical`), the flat `speculative_config` option keys and their split between
a chain's members (`split_options`, `flat_options`), the drafter keys (`drafter_key`), the
drafter registry (`tokenleap.drafters.default_registry`), the CLI's `--spec-type` help and the
options' flags (`cli_options`, `flag_help`: declared spellings, shared by the methods that
declare them, else `--spec-<method>-<option>`; `own_flags`: a method's own spellings, as
llama.cpp's per-type `--spec-ngram-map-k-size-n`), the server's set of per-request methods and its
per-request schema of options (`options_json_schema`, `check_request_options`), and the methods
table in docs/speculative-decoding.md (`methods_table`).

This module imports nothing of the drafters at import time (the built-in list is read on first
use), so drafter modules, `config.py` and the engine can all import it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import math
import threading
import types
import typing
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tokenleap.errors import TokenleapError

logger = logging.getLogger(__name__)
_O = TypeVar("_O")

ENTRY_POINT_GROUP = "tokenleap.methods"
OPTIONS_FIELD = "method_options"  # the SpecConfig field holding the methods' options
CHAIN_SEPARATOR = "+"
CHAIN_SEPARATORS = ("+", ",")  # llama.cpp lists its types with commas (`--spec-type ngram-mod,draft-mtp`)
# llama.cpp's: the draft model, or a draft head's directory (option `model`); --spec-draft-model is its current spelling
MODEL_FLAGS = ("--model-draft", "-md", "--spec-draft-model")


def option(default: Any, *, help: str, flags: tuple[str, ...] = (), own_flags: tuple[str, ...] = (), per_request: bool = True,
           request_max: float | None = None) -> Any:
    """A field of a method's options dataclass with what the CLI and the server derive from it:
    `help` (the flag's help and the server schema's description), `flags` (the CLI spellings; the
    first is the flag's name, several methods may share one: the value goes to every method of the
    chosen `--spec-type` that has it; default `--spec-<method>-<option>`), `own_flags` (spellings
    that set this method's option only, as llama.cpp's per-type `--spec-ngram-map-k-size-n`; they
    win over a shared flag), `per_request` (False: a server request may not set it: files, memory
    bounds, operator choices) and `request_max` (the largest value a server request may ask for;
    the library takes larger ones)."""
    metadata = {"help": help, "flags": tuple(flags), "own_flags": tuple(own_flags), "per_request": per_request, "request_max": request_max}
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class MethodRecord:
    """One speculative method. `factory(config, **context)` returns a Drafter; `context` holds
    what the caller offers (target, tokenizer, target_path, target_name, ...) and the keyword
    arguments `shared(registry)` made once per drafter registry (records that name the same
    `shared` function share what it made). `options`: a frozen dataclass type of the method's own
    options (fields made with `option(...)` carry their help, CLI flags and server limits), read
    by the factory as `options_of(config, record.name)` (or `config.options_for(record.name)`);
    `fields` then lists `method_options` too."""

    name: str
    factory: Callable[..., Any]
    help: str
    fields: tuple[str, ...] = ()  # the SpecConfig fields the factory reads (what keys its drafters)
    options: type | None = None
    aliases: tuple[str, ...] = ()
    per_request: bool = True  # may a server request pick it (False: chosen by the server's operator only)
    needs_model: str = ""  # non-empty: what `speculative_config['model']` must name ("a draft model")
    shared: Callable[[Any], dict[str, Any]] | None = None
    doc: str = ""  # the docs table's "what drafts" cell (markdown; default: help)
    knobs: str = ""  # the docs table's knobs cell (default: the options and their flags)

    def __post_init__(self) -> None:
        name = self.name
        if not name or name != name.strip().lower() or CHAIN_SEPARATOR in name or "," in name or name in ("none", "off"):
            raise TokenleapError(f"a method name must be lowercase, without '+' or ',', and not 'none' / 'off', got {name!r}")
        if not callable(self.factory):
            raise TokenleapError(f"method {name!r}: factory must be callable, got {self.factory!r}")
        if self.options is not None and not (dataclasses.is_dataclass(self.options) and isinstance(self.options, type)):
            raise TokenleapError(f"method {name!r}: options must be a dataclass type, got {self.options!r}")
        fields = tuple(self.fields)
        if self.options is not None and OPTIONS_FIELD not in fields:  # the factory reads its options there (`options_of`)
            fields = (*fields, OPTIONS_FIELD)
        object.__setattr__(self, "fields", fields)
        object.__setattr__(self, "aliases", tuple(self.aliases))

    @property
    def option_fields(self) -> tuple[dataclasses.Field[Any], ...]:
        return dataclasses.fields(typing.cast(Any, self.options)) if self.options is not None else ()

    def default_options(self) -> Any:
        return make_options(self, {})


# --------------------------------------------------------------------------- the registry

_lock = threading.RLock()
_user: dict[str, MethodRecord] = {}  # registered by users and entry points, in order
_entry_points_loaded = False
_entry_point_failures: dict[str, str] = {}  # entry point name -> why it did not load


def _builtins() -> tuple[MethodRecord, ...]:
    from tokenleap.drafters import BUILTIN_METHODS

    return BUILTIN_METHODS


def load_entry_points(*, reload: bool = False) -> None:
    """Register the methods of the `tokenleap.methods` entry point group (once per process, or
    again with `reload`). A broken entry point is logged and remembered: asking for its method
    then says why it is missing; the other methods keep working."""
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded and not reload:
            return
        _entry_points_loaded = True
        try:
            eps: Iterable[Any] = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        except Exception as exc:  # noqa: BLE001  # a broken installation must not break the built-in methods
            logger.error("could not read the %s entry points: %s", ENTRY_POINT_GROUP, exc)
            return
        for ep in eps:
            try:
                loaded = ep.load()
                records = loaded if isinstance(loaded, (list, tuple)) else [loaded]
                for record in records:
                    if not isinstance(record, MethodRecord):
                        raise TokenleapError(f"it loads {type(record).__name__}, not a tokenleap.MethodRecord")
                    if _user.get(record.name) is not record:
                        register_method(record)
                _entry_point_failures.pop(ep.name, None)
            except Exception as exc:  # noqa: BLE001  # reported, not fatal: see the docstring
                why = f"entry point {ep.name!r} ({getattr(ep, 'value', '?')}) of group {ENTRY_POINT_GROUP!r} failed to load: {exc}"
                _entry_point_failures[ep.name] = why
                logger.error("%s", why)


def builtin_methods() -> tuple[MethodRecord, ...]:
    return _builtins()


def all_methods() -> tuple[MethodRecord, ...]:
    """Every method: the built-ins in their listed order, then the registered ones."""
    load_entry_points()
    with _lock:
        return (*_builtins(), *_user.values())


_cache: dict[str, Any] = {}  # the spellings table for the current set of methods


def _spellings() -> dict[str, MethodRecord]:
    records = all_methods()
    if _cache.get("records") != records:
        table: dict[str, MethodRecord] = {}
        for record in records:
            for spelling in (record.name, *record.aliases, record.name.replace("-", "_")):
                table.setdefault(spelling, record)
        _cache["records"], _cache["table"] = records, table
    return _cache["table"]


def register_method(record: MethodRecord, *, replace: bool = False) -> MethodRecord:
    """Add a speculative method: its name and aliases become valid `speculative_config`
    methods, its options dict keys, CLI flags (`--spec-<method>-<option>`) and server
    per-request fields. `replace=True` replaces a registered (not a built-in) method of that name."""
    if not isinstance(record, MethodRecord):
        raise TokenleapError(f"register_method takes a tokenleap.MethodRecord, got {type(record).__name__}")
    with _lock:
        builtin = {s for r in _builtins() for s in (r.name, *r.aliases, r.name.replace("-", "_"))}
        others = {s for r in _user.values() if r.name != record.name for s in (r.name, *r.aliases, r.name.replace("-", "_"))}
        for spelling in (record.name, *record.aliases):
            if spelling in builtin:
                raise TokenleapError(f"speculative method {spelling!r} is built in and cannot be registered again")
            if spelling in others:
                raise TokenleapError(f"speculative method {spelling!r} is already registered by another method")
        if record.name in _user and not replace and _user[record.name] is not record:
            raise TokenleapError(f"speculative method {record.name!r} is already registered (pass replace=True to replace it)")
        _user[record.name] = record
    return record


def unregister_method(name: str) -> None:
    """Remove a registered method (tests; built-ins cannot be removed)."""
    with _lock:
        _user.pop(name, None)


def find(name: str) -> MethodRecord | None:
    """The record for a method name or any of its spellings, None if unknown."""
    return _spellings().get(str(name).strip().lower())


def canonical(name: str) -> str:
    """A method's own name for any of its spellings; an unknown name unchanged."""
    record = find(name)
    return record.name if record is not None else name


def method_names() -> tuple[str, ...]:
    return tuple(r.name for r in all_methods())


def get(name: str) -> MethodRecord:
    record = find(name)
    if record is None:
        raise unknown_method(name)
    return record


def unknown_method(name: str) -> TokenleapError:
    failed = _entry_point_failures.get(name)
    note = f" ({failed})" if failed else ""
    return TokenleapError(f"unknown speculative method {name!r}; choose one of {', '.join(method_names())}{note}")


def split_chain(method: str) -> list[str]:
    """The names a method string lists, as given: one, or a chain's ("suffix+ngram", or
    llama.cpp's comma list "ngram-mod,draft-mtp")."""
    text = str(method).strip().lower()
    for sep in CHAIN_SEPARATORS[1:]:
        text = text.replace(sep, CHAIN_SEPARATOR)
    return [p.strip() for p in text.split(CHAIN_SEPARATOR) if p.strip()]


def members(method: str) -> tuple[str, ...]:
    """The methods a method string names: one, or a chain's members ("suffix+ngram", "ngram-mod,draft-mtp")."""
    return tuple(canonical(p) for p in split_chain(method))


# --------------------------------------------------------------------------- options


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _check_value(record: MethodRecord, option: str, value: Any, tp: Any) -> Any:
    """The value when it fits the option's annotation (int, float, bool, str, optional ones;
    other annotations are left to the options' own __post_init__), else a TokenleapError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_value(record, option, value, arg)
            except TokenleapError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return value
    ok = True
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
        if ok and not math.isfinite(value):
            raise TokenleapError(f"method {record.name!r}: option {option} must be a finite number, got {value!r}")
    elif tp is str:
        ok = isinstance(value, str)
    if not ok:
        raise TokenleapError(f"method {record.name!r}: option {option} must be {_type_name(tp)}, got {value!r}")
    return value


def option_types(record: MethodRecord) -> dict[str, Any]:
    """Each option's type, from the options dataclass's annotations."""
    if record.options is None:
        return {}
    try:
        hints = typing.get_type_hints(record.options)
    except Exception:  # noqa: BLE001  # unresolvable annotations: no type checks, the dataclass validates
        hints = {}
    return {f.name: hints.get(f.name, Any) for f in record.option_fields}


def make_options(record: MethodRecord, raw: Mapping[str, Any] | Any) -> Any:
    """The method's options from a mapping (or an instance, returned as is), type-checked
    against the annotations and validated by the options' __post_init__."""
    if record.options is None:
        if raw:
            raise TokenleapError(f"method {record.name!r} takes no options, got {', '.join(sorted(raw))}")
        return None
    if isinstance(raw, record.options):
        return raw
    if not isinstance(raw, Mapping):
        raise TokenleapError(f"method {record.name!r}: options must be a mapping of option names, got {raw!r}")
    names = [f.name for f in record.option_fields]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise TokenleapError(f"method {record.name!r} has no option(s) {', '.join(unknown)}; its options: {', '.join(names)}")
    tps = option_types(record)
    values = {k: _check_value(record, k, v, tps.get(k, Any)) for k, v in raw.items() if v is not None}
    try:
        return record.options(**values)
    except TypeError as exc:
        raise TokenleapError(f"method {record.name!r}: bad options: {exc}") from exc


def options_of(config: Any, name: str, cls: type[_O]) -> _O:
    """Method `name`'s options in `config` (read from its `method_options` field: what a factory
    reads, so the record's `fields` name it), as an instance of `cls`."""
    opts = next((o for m, o in getattr(config, OPTIONS_FIELD) if m == name), None)
    if opts is None:  # a config made without the method's options: the defaults
        opts = make_options(get(name), {})
    if not isinstance(opts, cls):
        raise TokenleapError(f"method {name!r}: options must be {cls.__name__}, got {type(opts).__name__}")
    return opts


def builtin_option_names() -> frozenset[str]:
    """Every option name of the built-in methods: `speculative_config` keys (and SpecConfig
    keyword arguments) taken whatever the method, as they were when SpecConfig held them all;
    options of methods a config does not use are validated and dropped."""
    return frozenset(f.name for r in _builtins() for f in r.option_fields)


def flat_options(method: str, flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Top-level option keys (`speculative_config`'s flat spelling) as {method: {option: value}}:
    the options of `method` (or its chain's members), and built-in options of methods it does not
    use, checked by those methods' options and dropped (an error if bad, as they always were).
    A key that is neither is a TokenleapError naming it."""
    options, rest = split_options(method, flat)
    others: dict[str, dict[str, Any]] = {}
    for key, value in rest.items():
        owners = [r for r in _builtins() if any(f.name == key for f in r.option_fields)]
        if not owners:
            raise TokenleapError(f"speculative method {method!r} has no option(s) {key}")
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
        out[name] = dict(value) if isinstance(value, Mapping) else dataclasses.asdict(typing.cast(Any, value)) if is_instance else value
    for name, opts in updates.items():
        out[canonical(name)] = {**out.get(canonical(name), {}), **opts}
    return out


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


# --------------------------------------------------------------------------- derived


def drafter_key(config: Any) -> tuple[Hashable, ...]:
    """What identifies the drafter serving `config`: its method, the fields the method reads
    and its options. A user's drafter object ("custom") is keyed by identity; a chain by its
    members' keys."""
    if config.method == "custom":
        return ("custom", id(config.drafter))  # the engine keeps the object alive with its drafter
    if config.method == "chain":
        return ("chain", *(drafter_key(dataclasses.replace(config, method=m)) for m in config.chain))
    record = get(config.method)
    key: tuple[Hashable, ...] = (config.method, *(getattr(config, f) for f in record.fields if f != OPTIONS_FIELD))
    if record.options is not None:
        key = (*key, config.options_for(config.method))
    return key


def method_fields() -> dict[str, tuple[str, ...]]:
    return {r.name: r.fields for r in all_methods()}


def server_side_methods() -> frozenset[str]:
    """Methods a server request may not pick (objects or files only the operator chooses)."""
    return frozenset(r.name for r in all_methods() if not r.per_request)


def model_methods() -> tuple[str, ...]:
    """Methods that read `speculative_config['model']` (the CLI's --model-draft)."""
    return tuple(r.name for r in all_methods() if reads_model(r))


def reads_model(record: MethodRecord) -> bool:
    """Whether a method reads `speculative_config['model']` (an option, or a field of a user's method)."""
    return "model" in record.fields or _field(record, "model") is not None


def _field(record: MethodRecord, option: str) -> dataclasses.Field[Any] | None:
    return next((f for f in record.option_fields if f.name == option), None)


def option_flags(record: MethodRecord, f: dataclasses.Field[Any]) -> tuple[str, ...]:
    """The CLI spellings of an option: its `flags` metadata, else `--spec-<method>-<option>`."""
    flags = tuple(f.metadata.get("flags") or ()) if f.metadata else ()
    return flags or (f"--spec-{record.name}-{f.name}".replace("_", "-"),)


def option_own_flags(record: MethodRecord, f: dataclasses.Field[Any]) -> tuple[str, ...]:
    """The spellings that set this method's option only (`option(own_flags=...)`)."""
    return tuple(f.metadata.get("own_flags") or ()) if f.metadata else ()


def option_flag(record: MethodRecord, option: str) -> str:
    f = _field(record, option)
    return option_flags(record, f)[0] if f is not None else f"--spec-{record.name}-{option}".replace("_", "-")


def option_dest(record: MethodRecord, option: str) -> str:
    return f"spec_option:{record.name}:{option}"


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default if f.default is not dataclasses.MISSING else None


def option_help(record: MethodRecord, f: dataclasses.Field[Any]) -> str:
    text = f.metadata.get("help") if f.metadata else None
    return f"{record.name}: {text or f.name.replace('_', ' ')} (default: {_default(f)})"


def cli_options() -> dict[str, list[tuple[MethodRecord, dataclasses.Field[Any]]]]:
    """Each CLI flag of the methods' options (its first spelling) -> the (method, option) pairs it
    sets, every method in order: a flag several methods share sets each of them."""
    out: dict[str, list[tuple[MethodRecord, dataclasses.Field[Any]]]] = {}
    for r in all_methods():
        for f in r.option_fields:
            out.setdefault(option_flags(r, f)[0], []).append((r, f))
    return out


def cli_own_options() -> dict[str, tuple[MethodRecord, dataclasses.Field[Any]]]:
    """Each method's own spellings (`own_flags`) -> the one (method, option) it sets. A spelling
    two methods declare, or one that is also a shared flag, is the first's (logged)."""
    shared = {s for owners in cli_options().values() for r, f in owners for s in option_flags(r, f)}
    out: dict[str, tuple[MethodRecord, dataclasses.Field[Any]]] = {}
    for r in all_methods():
        for f in r.option_fields:
            for flag in option_own_flags(r, f):
                if flag in out or flag in shared:
                    logger.warning("method %r: own flag %s of option %r is taken; ignored", r.name, flag, f.name)
                    continue
                out[flag] = (r, f)
    return out


def flag_help(owners: Sequence[tuple[MethodRecord, dataclasses.Field[Any]]]) -> str:
    """A shared flag's help: per meaning, the methods, the option's dict key where it is not the
    flag's, the help and the default (per method where they differ)."""
    groups: dict[tuple[str, str], list[tuple[MethodRecord, dataclasses.Field[Any]]]] = {}
    for r, f in owners:
        text = (f.metadata.get("help") if f.metadata else None) or f.name.replace("_", " ")
        groups.setdefault((text, f.name), []).append((r, f))
    parts = []
    several_keys = len({f.name for _, f in owners}) > 1
    for (text, name), members_ in groups.items():
        names = ", ".join(r.name for r, _ in members_)
        key = f" ({name})" if several_keys else ""
        defaults = [_default(f) for _, f in members_]
        if all(d is None for d in defaults):
            shown = ""  # no default, or the help tells it
        elif len(set(map(repr, defaults))) == 1:
            shown = f" (default: {defaults[0]})"
        else:
            shown = " (default: " + ", ".join(f"{r.name} {_default(f)}" for r, f in members_) + ")"
        parts.append(f"{names}{key}: {text}{shown}")
    return "; ".join(parts)


def is_per_request(f: dataclasses.Field[Any]) -> bool:
    return bool(f.metadata.get("per_request", True)) if f.metadata else True


def spec_type_help() -> str:
    """The CLI's --spec-type help: every method with its aliases, and chains."""
    parts = ["auto (suffix decoding: the default) | none (plain decoding)"]
    for r in all_methods():
        if r.name in ("custom", "chain"):
            continue  # custom: an object, the library's speculative_config only; chain: spelled a+b
        aliases = [a for a in r.aliases if a != r.name.replace("-", "_")]
        needs = " [--model-draft]" if r.needs_model else " [--model-draft: optional]" if reads_model(r) else ""
        parts.append(r.name + (f" (alias {', '.join(aliases)})" if aliases else "") + needs)
    return (" | ".join(parts) + " | a+b (a chain: the first that proposes; draftless methods before a draft model; llama.cpp's a,b and "
            "repeated --spec-type too). llama.cpp's underscore spellings (ngram_simple) and type names (draft-simple, draft-eagle3, "
            "draft-mtp) work too")


_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}


def _json_type(tp: Any) -> dict[str, Any]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {"anyOf": [_json_type(a) for a in args]}
    return {"type": _JSON_TYPES[tp]} if tp in _JSON_TYPES else {}


def per_request_options() -> dict[str, list[tuple[MethodRecord, dataclasses.Field[Any]]]]:
    """Option name -> (method, field) of every method a server request may pick."""
    out: dict[str, list[tuple[MethodRecord, dataclasses.Field[Any]]]] = {}
    for r in all_methods():
        if r.per_request:
            for f in r.option_fields:
                if is_per_request(f):
                    out.setdefault(f.name, []).append((r, f))
    return out


def check_request_options(flat: Mapping[str, Any]) -> None:
    """A server request's option values against their `request_max` (a ValueError naming it)."""
    owners = per_request_options()
    for key, value in flat.items():
        limit = request_max(owners.get(key, []))
        if limit is not None and isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit:
            raise ValueError(f"{key} must be <= {limit} in a request, got {value}")


def request_max(owners: Sequence[tuple[MethodRecord, dataclasses.Field[Any]]]) -> float | None:
    """The largest value a server request may give an option (the least of its methods' `request_max`)."""
    limits: list[float] = [f.metadata["request_max"] for _, f in owners if f.metadata and f.metadata.get("request_max") is not None]
    return min(limits) if limits else None


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


def _knobs_cell(r: MethodRecord) -> str:
    if r.knobs:
        return r.knobs
    cells = []
    for f in r.option_fields:
        value = _default(f)
        shown = f"2^{value.bit_length() - 1}" if isinstance(value, int) and value >= 1024 and value & (value - 1) == 0 else str(value)
        default = f" (default {shown})" if value is not None else ""
        server_side = " (not per request)" if r.per_request and not is_per_request(f) else ""
        flags = " or ".join(f"`{flag}`" for flag in (option_flag(r, f.name), *option_own_flags(r, f)))
        cells.append(f"`{f.name}` / {flags}{default}{server_side}")
    return ", ".join(cells) or "none"


def methods_table(records: Iterable[MethodRecord] | None = None) -> str:
    """The markdown table of methods (default: every method); docs/speculative-decoding.md holds
    the built-ins' (`builtin_methods()`), checked by tests/drafters/test_methods.py."""
    rows = ["| method | what drafts | knobs (dict key / CLI flag) | per request (server) |", "| --- | --- | --- | --- |"]
    for r in (all_methods() if records is None else records):
        spelled = f"`{r.name}`" + (f" ({', '.join(f'`{a}`' for a in r.aliases)})" if r.aliases else "")
        if r.name == "chain":
            spelled = "`a+b`, " + spelled
        rows.append(f"| {spelled} | {r.doc or r.help} | {_knobs_cell(r)} | {'yes' if r.per_request else 'no'} |")
    return "\n".join(rows) + "\n"


__all__ = ["ENTRY_POINT_GROUP", "MethodRecord", "canonical", "drafter_key", "find", "get", "load_entry_points", "make_options", "method_names",
           "all_methods", "methods_table", "option", "options_of", "register_method", "unregister_method"]
