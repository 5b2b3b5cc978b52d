"""The methods' command-line face, derived from the method records: `--spec-type`'s help, and
one flag per spelling the options declare (`option(flags=...)`: several methods may share one,
and the value goes to every chosen method that has it; a user's option gets
`--spec-<method>-<option>`), plus each method's own spellings (`option(own_flags=...)`, as
llama.cpp's per-type `--spec-ngram-map-k-size-n`), with their help and defaults. `cli.py` builds
its parser and its `speculative_config` from these.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from tokenleap.drafters.methods import MethodRecord, field_default, field_help
from tokenleap.drafters.registry import all_methods

logger = logging.getLogger(__name__)

OptionOf = tuple[MethodRecord, dataclasses.Field[Any]]  # a method and one of its options


def reads_model(record: MethodRecord) -> bool:
    """Whether a method reads `speculative_config['model']` (an option, or a field of a user's method)."""
    return "model" in record.fields or record.option_field("model") is not None


def model_methods() -> tuple[str, ...]:
    """Methods that read `speculative_config['model']` (the CLI's --model-draft)."""
    return tuple(r.name for r in all_methods() if reads_model(r))


def option_flags(record: MethodRecord, f: dataclasses.Field[Any]) -> tuple[str, ...]:
    """The CLI spellings of an option: its `flags` metadata, else `--spec-<method>-<option>`."""
    flags = tuple(f.metadata.get("flags") or ()) if f.metadata else ()
    return flags or (f"--spec-{record.name}-{f.name}".replace("_", "-"),)


def option_own_flags(record: MethodRecord, f: dataclasses.Field[Any]) -> tuple[str, ...]:
    """The spellings that set this method's option only (`option(own_flags=...)`)."""
    return tuple(f.metadata.get("own_flags") or ()) if f.metadata else ()


def option_flag(record: MethodRecord, option: str) -> str:
    f = record.option_field(option)
    return option_flags(record, f)[0] if f is not None else f"--spec-{record.name}-{option}".replace("_", "-")


def option_help(record: MethodRecord, f: dataclasses.Field[Any]) -> str:
    return f"{record.name}: {field_help(f)} (default: {field_default(f)})"


def cli_options() -> dict[str, list[OptionOf]]:
    """Each CLI flag of the methods' options (its first spelling) -> the (method, option) pairs it
    sets, every method in order: a flag several methods share sets each of them."""
    out: dict[str, list[OptionOf]] = {}
    for r in all_methods():
        for f in r.option_fields:
            out.setdefault(option_flags(r, f)[0], []).append((r, f))
    return out


def cli_own_options() -> dict[str, OptionOf]:
    """Each method's own spellings (`own_flags`) -> the one (method, option) it sets. A spelling
    two methods declare, or one that is also a shared flag, is the first's (logged)."""
    shared = {s for owners in cli_options().values() for r, f in owners for s in option_flags(r, f)}
    out: dict[str, OptionOf] = {}
    for r in all_methods():
        for f in r.option_fields:
            for flag in option_own_flags(r, f):
                if flag in out or flag in shared:
                    logger.warning("method %r: own flag %s of option %r is taken; ignored", r.name, flag, f.name)
                    continue
                out[flag] = (r, f)
    return out


def flag_help(owners: Sequence[OptionOf]) -> str:
    """A shared flag's help: per meaning, the methods, the option's dict key where it is not the
    flag's, the help and the default (per method where they differ)."""
    groups: dict[tuple[str, str], list[OptionOf]] = {}
    for r, f in owners:
        groups.setdefault((field_help(f), f.name), []).append((r, f))
    parts = []
    several_keys = len({f.name for _, f in owners}) > 1
    for (text, name), members_ in groups.items():
        names = ", ".join(r.name for r, _ in members_)
        key = f" ({name})" if several_keys else ""
        defaults = [field_default(f) for _, f in members_]
        if all(d is None for d in defaults):
            shown = ""  # no default, or the help tells it
        elif len(set(map(repr, defaults))) == 1:
            shown = f" (default: {defaults[0]})"
        else:
            shown = " (default: " + ", ".join(f"{r.name} {field_default(f)}" for r, f in members_) + ")"
        parts.append(f"{names}{key}: {text}{shown}")
    return "; ".join(parts)


def spec_type_help() -> str:
    """The CLI's --spec-type help: every method with its aliases, and chains."""
    parts = ["auto (suffix decoding: the default) | none (plain decoding)"]
    for r in all_methods():
        if r.name in ("custom", "chain"):
            continue  # custom: an object, the library's speculative_config only; chain: spelled a+b
        aliases = [a for a in r.aliases if a != r.name.replace("-", "_")]
        needs = " [--model-draft]" if r.needs_model else " [--model-draft: optional]" if reads_model(r) else ""
        parts.append(r.name + (f" (alias {', '.join(aliases)})" if aliases else "") + needs)
    return (
        " | ".join(parts)
        + " | a+b (a chain: the first that proposes; draftless methods before a draft model; llama.cpp's a,b and "
        "repeated --spec-type too). llama.cpp's underscore spellings (ngram_simple) and type names (draft-simple, "
        "draft-eagle3, draft-mtp) work too"
    )


__all__ = [
    "cli_options", "cli_own_options", "flag_help", "model_methods", "option_flag", "option_flags", "option_help",
    "option_own_flags", "reads_model", "spec_type_help"
]
