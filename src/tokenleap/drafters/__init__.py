"""Drafters: the protocol, the method records of the built-in methods, one module per family.

Every method is a `MethodRecord` (drafters/methods.py) defined beside its drafter and listed once
in `BUILTIN_METHODS` below; users add theirs with `tokenleap.register_method` or the
`tokenleap.methods` entry point group. The registry, the method names and aliases, the CLI's
flags and help, the server's per-request schema and the docs' table are derived from them.

An engine keeps one drafter per `drafter_key`: the method, the config fields it reads
(`method_fields()`, each record's `fields`: `method_options` for a method with options, `chain`,
`drafter`) and its options, so configs that differ only in per-request controls
(`CONTROL_FIELDS`: the draft length cap and floor, adaptive drafting) or in other methods'
options share a drafter and its state across requests. A user's drafter object is
keyed by identity. Draft models are loaded once per registry (`LoadedModels`), whatever the
number of drafters that use them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tokenleap.drafters import chain, custom, draft_model, head_methods, lookup_tree, ngram, ngram_cache, ngram_map, ngram_mod, suffix
from tokenleap.drafters.base import Draft, Drafter, DrafterRegistry, DraftRequest, check_drafter
from tokenleap.drafters.draft_model import DraftModelDrafter, LoadedModels
from tokenleap.drafters.methods import MethodRecord, all_methods, drafter_key, method_fields, register_method
from tokenleap.drafters.ngram import NgramDrafter

# The built-in methods, one line each, in the order they are listed (help, errors, docs).
BUILTIN_METHODS: tuple[MethodRecord, ...] = (
    ngram.METHOD,
    ngram_map.SIMPLE,
    ngram_map.MAP_K,
    ngram_map.MAP_K4V,
    ngram_mod.METHOD,
    ngram_cache.METHOD,
    suffix.METHOD,
    draft_model.METHOD,
    head_methods.EAGLE3,
    head_methods.EAGLE,
    head_methods.MEDUSA,
    head_methods.MTP,
    custom.METHOD,
    chain.METHOD,
    lookup_tree.METHOD,
)

# Per-request controls the engine itself reads never make a new drafter. tests/drafters/test_keys.py
# checks that every SpecConfig field is claimed by a method's `fields` or here, and that the
# factories read nothing else: a new field must be listed under the methods that read it.
CONTROL_FIELDS = ("num_speculative_tokens", "draft_min", "adaptive", "sampled_tree", "acceptance", "typical_threshold", "typical_alpha")


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
            from tokenleap.drafters.methods import find

            record = find(name)
            if record is not None and record.name == name:
                self.add(record)
        return super().create(name, config, **context)


def default_registry() -> DrafterRegistry:
    """A fresh registry holding every method (no module-level mutable state). Drafters it
    creates share what may be shared (ngram-mod pools, ngram-cache's engine-wide statistics,
    loaded draft models: `LoadedModels`, loaded heads), chains included."""
    return MethodRegistry()


__all__ = ["BUILTIN_METHODS", "CONTROL_FIELDS", "method_fields", "DraftModelDrafter", "Draft", "Drafter", "DraftRequest", "DrafterRegistry",
           "LoadedModels", "MethodRecord", "NgramDrafter", "default_registry", "drafter_key", "check_drafter", "register_method"]
