"""Drafters: the protocol, the registry of built-in methods, one module per family."""

from __future__ import annotations

from typing import Any

from tokenleap.config import SpecConfig
from tokenleap.drafters.base import Draft, Drafter, DrafterRegistry, DraftRequest, check_drafter
from tokenleap.drafters.ngram import NgramDrafter


def _ngram(config: SpecConfig, **_: Any) -> Drafter:
    return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)


def _custom(config: SpecConfig, **_: Any) -> Drafter:
    return check_drafter(config.drafter)


def default_registry() -> DrafterRegistry:
    """A fresh registry holding the built-in methods (no module-level mutable state)."""
    registry = DrafterRegistry()
    registry.register("ngram", _ngram)
    registry.register("custom", _custom)
    return registry


__all__ = ["Draft", "Drafter", "DraftRequest", "DrafterRegistry", "NgramDrafter", "default_registry", "check_drafter"]
