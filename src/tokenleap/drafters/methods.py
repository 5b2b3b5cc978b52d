"""A speculative method as one record: `MethodRecord`, and the options dataclass it declares.

A method is its name, its aliases, a one-line help, its own options (a frozen dataclass whose
fields are the option names with their defaults, made with `option(...)` to carry their help,
CLI spellings and server limits, and whose `__post_init__` validates them with a
`TokenleapError` naming the option), the factory, whether a server request may pick it and
whether it needs a model path. Each built-in method's record and options sit next to its drafter
(`drafters/builtin.py` lists them); a user's comes in through `register_method`
(`drafters/registry.py`). This module is the record alone: it knows no method, holds no state and
imports nothing of the drafters, so every drafter module can import it. What is derived from the
records lives beside it: the registry and lookups (`registry.py`), `speculative_config`'s flat
keys (`options.py`), `SpecConfig` (`spec.py`), the CLI's flags (`cli_flags.py`), the server's
per-request schema (`server_schema.py`) and the docs table (`docs_table.py`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tokenleap.errors import TokenleapError

_O = TypeVar("_O")

OPTIONS_FIELD = "method_options"  # the SpecConfig field holding the methods' options
CHAIN_SEPARATOR = "+"
CHAIN_SEPARATORS = ("+", ",")  # llama.cpp lists its types with commas (`--spec-type ngram-mod,draft-mtp`)
# llama.cpp's: the draft model, or a draft head's directory (option `model`); --spec-draft-model is its current spelling
MODEL_FLAGS = ("--model-draft", "-md", "--spec-draft-model")


def option(
    default: Any,
    *,
    help: str,
    flags: tuple[str, ...] = (),
    own_flags: tuple[str, ...] = (),
    per_request: bool = True,
    request_max: float | None = None,
    renamed_from: tuple[str, ...] = (),
) -> Any:
    """A field of a method's options dataclass with what the CLI and the server derive from it:
    `help` (the flag's help and the server schema's description), `flags` (the CLI spellings; the
    first is the flag's name, several methods may share one: the value goes to every method of the
    chosen `--spec-type` that has it; default `--spec-<method>-<option>`), `own_flags` (spellings
    that set this method's option only, as llama.cpp's per-type `--spec-ngram-map-k-size-n`; they
    win over a shared flag), `per_request` (False: a server request may not set it: files, memory
    bounds, operator choices), `request_max` (the largest value a server request may ask for;
    the library takes larger ones) and `renamed_from` (former names of the option: given, they are
    an error that names the new one)."""
    metadata = {
        "help": help, "flags": tuple(flags), "own_flags": tuple(own_flags), "per_request": per_request,
        "request_max": request_max, "renamed_from": tuple(renamed_from)
    }
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
        if (
            not name
            or name != name.strip().lower()
            or CHAIN_SEPARATOR in name
            or "," in name
            or name in ("none", "off")
        ):
            raise TokenleapError(
                f"a method name must be lowercase, without '+' or ',', and not 'none' / 'off', got {name!r}"
            )
        if not callable(self.factory):
            raise TokenleapError(f"method {name!r}: factory must be callable, got {self.factory!r}")
        if self.options is not None and not (dataclasses.is_dataclass(self.options) and isinstance(self.options, type)):
            raise TokenleapError(f"method {name!r}: options must be a dataclass type, got {self.options!r}")
        fields = tuple(self.fields)
        # the factory reads its options there (`options_of`)
        if self.options is not None and OPTIONS_FIELD not in fields:
            fields = (*fields, OPTIONS_FIELD)
        object.__setattr__(self, "fields", fields)
        object.__setattr__(self, "aliases", tuple(self.aliases))

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every name the method answers to: its own, its aliases, llama.cpp's underscore spelling."""
        return tuple(dict.fromkeys((self.name, *self.aliases, self.name.replace("-", "_"))))

    @property
    def option_fields(self) -> tuple[dataclasses.Field[Any], ...]:
        return dataclasses.fields(typing.cast(Any, self.options)) if self.options is not None else ()

    def option_field(self, option: str) -> dataclasses.Field[Any] | None:
        return next((f for f in self.option_fields if f.name == option), None)

    def default_options(self) -> Any:
        return make_options(self, {})


# --------------------------------------------------------------------------- an option's metadata


def field_default(f: dataclasses.Field[Any]) -> Any:
    return f.default if f.default is not dataclasses.MISSING else None


def field_help(f: dataclasses.Field[Any]) -> str:
    return (f.metadata.get("help") if f.metadata else None) or f.name.replace("_", " ")


def is_per_request(f: dataclasses.Field[Any]) -> bool:
    return bool(f.metadata.get("per_request", True)) if f.metadata else True


def renamed_options(record: MethodRecord) -> dict[str, str]:
    """A former option name -> its name now (`option(renamed_from=...)`)."""
    return {
        old: f.name
        for f in record.option_fields
        for old in (f.metadata.get("renamed_from") or () if f.metadata else ())
    }


def renamed_note(keys: Any, renamed: Mapping[str, str]) -> str:
    """' (X is now Y)' for the given keys that are former option names, else ''."""
    hits = [f"{k} is now {renamed[k]}" for k in sorted(keys) if k in renamed]
    return f" ({'; '.join(hits)})" if hits else ""


# --------------------------------------------------------------------------- options: types and values


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
        raise TokenleapError(
            f"method {record.name!r} has no option(s) "
            f"{', '.join(unknown)}{renamed_note(unknown, renamed_options(record))}; "
            f"its options: {', '.join(names)}"
        )
    tps = option_types(record)
    values = {k: _check_value(record, k, v, tps.get(k, Any)) for k, v in raw.items() if v is not None}
    try:
        return record.options(**values)
    except TypeError as exc:
        raise TokenleapError(f"method {record.name!r}: bad options: {exc}") from exc


def options_of(config: Any, name: str, cls: type[_O]) -> _O:
    """Method `name`'s options in `config` (read from its `method_options` field: what a factory
    reads, so the record's `fields` name it), as an instance of `cls` (its defaults when the
    config holds none)."""
    opts = next((o for m, o in getattr(config, OPTIONS_FIELD) if m == name), None)
    if opts is None:  # a config made without the method's options: the defaults
        opts = cls()
    if not isinstance(opts, cls):
        raise TokenleapError(f"method {name!r}: options must be {cls.__name__}, got {type(opts).__name__}")
    return opts


__all__ = [
    "CHAIN_SEPARATOR", "MODEL_FLAGS", "OPTIONS_FIELD", "MethodRecord", "field_default", "field_help", "is_per_request",
    "make_options", "option", "option_types", "options_of", "renamed_note", "renamed_options"
]
