"""The methods known: the built-in records (`drafters/builtin.py`), then those registered by
users (`register_method`) or by packages (the entry point group `tokenleap.methods`, each entry
point loading a MethodRecord; read lazily, once per process), and what is looked up among them:
a method by any spelling, the names, a chain's members. `MethodRegistry` is the drafter registry
an engine creates its drafters from, over the same records.

The registered methods are the process's one piece of shared state here (`_REGISTERED`, behind a
lock), as a plugin registry must be: a method registered once is a method for every LLM, CLI
command and server of the process.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenleap.drafters.base import Drafter, DrafterRegistry
from tokenleap.drafters.builtin import BUILTIN_METHODS
from tokenleap.drafters.methods import CHAIN_SEPARATOR, CHAIN_SEPARATORS, MethodRecord
from tokenleap.errors import TokenleapError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tokenleap.methods"


@dataclass
class _Registered:
    """The methods registered in this process, the entry points' outcome, and the spellings table
    of the current set of methods."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    records: dict[str, MethodRecord] = field(default_factory=dict)  # by name, in order
    entry_points_loaded: bool = False
    failures: dict[str, str] = field(default_factory=dict)  # entry point name -> why it did not load
    table: tuple[tuple[MethodRecord, ...], dict[str, MethodRecord]] = field(default_factory=lambda: ((), {}))


_REGISTERED = _Registered()


def load_entry_points(*, reload: bool = False) -> None:
    """Register the methods of the `tokenleap.methods` entry point group (once per process, or
    again with `reload`). A broken entry point is logged and remembered: asking for its method
    then says why it is missing; the other methods keep working."""
    reg = _REGISTERED
    with reg.lock:
        if reg.entry_points_loaded and not reload:
            return
        reg.entry_points_loaded = True
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
                    if reg.records.get(record.name) is not record:
                        register_method(record)
                reg.failures.pop(ep.name, None)
            except Exception as exc:  # noqa: BLE001  # reported, not fatal: see the docstring
                why = (
                    f"entry point {ep.name!r} ({getattr(ep, 'value', '?')}) of group {ENTRY_POINT_GROUP!r} "
                    f"failed to load: {exc}"
                )
                reg.failures[ep.name] = why
                logger.error("%s", why)


def builtin_methods() -> tuple[MethodRecord, ...]:
    return BUILTIN_METHODS


def all_methods() -> tuple[MethodRecord, ...]:
    """Every method: the built-ins in their listed order, then the registered ones."""
    load_entry_points()
    with _REGISTERED.lock:
        return (*BUILTIN_METHODS, *_REGISTERED.records.values())


def _spellings() -> dict[str, MethodRecord]:
    records = all_methods()
    with _REGISTERED.lock:
        known, table = _REGISTERED.table
        if known != records:
            table = {}
            for record in records:
                for spelling in record.spellings:
                    table.setdefault(spelling, record)
            _REGISTERED.table = (records, table)
        return table


def register_method(record: MethodRecord, *, replace: bool = False) -> MethodRecord:
    """Add a speculative method: its name and aliases become valid `speculative_config`
    methods, its options dict keys, CLI flags (`--spec-<method>-<option>`) and server
    per-request fields. `replace=True` replaces a registered (not a built-in) method of that name."""
    if not isinstance(record, MethodRecord):
        raise TokenleapError(f"register_method takes a tokenleap.MethodRecord, got {type(record).__name__}")
    reg = _REGISTERED
    with reg.lock:
        builtin = {s for r in BUILTIN_METHODS for s in r.spellings}
        others = {s for r in reg.records.values() if r.name != record.name for s in r.spellings}
        for spelling in (record.name, *record.aliases):
            if spelling in builtin:
                raise TokenleapError(f"speculative method {spelling!r} is built in and cannot be registered again")
            if spelling in others:
                raise TokenleapError(f"speculative method {spelling!r} is already registered by another method")
        if record.name in reg.records and not replace and reg.records[record.name] is not record:
            raise TokenleapError(
                f"speculative method {record.name!r} is already registered (pass replace=True to replace it)"
            )
        reg.records[record.name] = record
    return record


def unregister_method(name: str) -> None:
    """Remove a registered method (tests; built-ins cannot be removed)."""
    with _REGISTERED.lock:
        _REGISTERED.records.pop(name, None)


def find(name: str) -> MethodRecord | None:
    """The record for a method name or any of its spellings, None if unknown."""
    return _spellings().get(str(name).strip().lower())


def get(name: str) -> MethodRecord:
    record = find(name)
    if record is None:
        raise unknown_method(name)
    return record


def canonical(name: str) -> str:
    """A method's own name for any of its spellings; an unknown name unchanged."""
    record = find(name)
    return record.name if record is not None else name


def method_names() -> tuple[str, ...]:
    return tuple(r.name for r in all_methods())


def unknown_method(name: str) -> TokenleapError:
    failed = _REGISTERED.failures.get(name)
    note = f" ({failed})" if failed else ""
    return TokenleapError(f"unknown speculative method {name!r}; choose one of {', '.join(method_names())}{note}")


def method_fields() -> dict[str, tuple[str, ...]]:
    """Each method's `fields`: the SpecConfig fields its factory reads."""
    return {r.name: r.fields for r in all_methods()}


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


class MethodRegistry(DrafterRegistry):
    """A drafter registry over the method records: every method known when it was made, and a
    method registered later on first use. Each record's `shared(registry)` keyword arguments are
    made once per registry (records naming the same function share them)."""

    def __init__(self) -> None:
        super().__init__()
        self._shared: dict[Callable[[Any], dict[str, Any]], dict[str, Any]] = {}
        for record in all_methods():
            self.add(record)

    def add(self, record: MethodRecord) -> None:
        kwargs: dict[str, Any] = {}
        if record.shared is not None:
            if record.shared not in self._shared:
                self._shared[record.shared] = record.shared(self)
            kwargs = self._shared[record.shared]
        self.register(record.name, functools.partial(record.factory, **kwargs) if kwargs else record.factory)

    def create(self, name: str, config: Any, **context: Any) -> Drafter:
        if name not in self.factories:
            record = find(name)
            if record is not None and record.name == name:
                self.add(record)
        return super().create(name, config, **context)


def default_registry() -> DrafterRegistry:
    """A fresh registry holding every method (no state shared between registries). Drafters it
    creates share what may be shared (ngram-mod pools, ngram-cache's engine-wide statistics,
    loaded draft models: `LoadedModels`, loaded heads), chains included."""
    return MethodRegistry()


__all__ = [
    "ENTRY_POINT_GROUP", "MethodRegistry", "all_methods", "builtin_methods", "canonical", "default_registry", "find",
    "get", "load_entry_points", "members", "method_fields", "method_names", "register_method", "split_chain",
    "unknown_method", "unregister_method"
]
