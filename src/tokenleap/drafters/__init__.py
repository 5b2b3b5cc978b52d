"""Drafters: the protocol, the registry of built-in methods, one module per family."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from tokenleap.config import SpecConfig
from tokenleap.drafters.chain import ChainDrafter
from tokenleap.drafters.base import Draft, Drafter, DrafterRegistry, DraftRequest, check_drafter
from tokenleap.drafters.draft_model import DraftModelDrafter, check_same_vocabulary
from tokenleap.drafters.ngram import NgramDrafter
from tokenleap.drafters.ngram_cache import NgramCacheDrafter, Stats
from tokenleap.drafters.ngram_map import NgramMapK4VDrafter, NgramMapKDrafter, NgramSimpleDrafter
from tokenleap.drafters.ngram_mod import NgramModDrafter, PoolStore
from tokenleap.drafters.suffix import SuffixConfig, SuffixDrafter


def _ngram(config: SpecConfig, **_: Any) -> Drafter:
    return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)


def _llamacpp_family(
    config: SpecConfig, *, pools: PoolStore, dynamic: dict[tuple[int, int], Stats], **_: Any
) -> Drafter:
    n, m, hits = config.ngram_size_n, config.ngram_size_m, config.ngram_min_hits
    if config.method == "ngram-simple":
        return NgramSimpleDrafter(n, m)
    if config.method == "ngram-map-k":
        return NgramMapKDrafter(n, m, hits)
    if config.method == "ngram-map-k4v":
        return NgramMapK4VDrafter(n, m, max(hits, 2))
    if config.method == "ngram-mod":  # one pool per (n, size) for every drafter of this registry
        size = config.ngram_mod_pool_size
        return NgramModDrafter(n, size, pool=pools.get(n, size))
    # ngram-cache: one engine-wide statistics table per (n_max, bound) for this registry's drafters
    n_max, bound = min(n, 4), config.ngram_cache_max_entries
    shared = dynamic.setdefault((n_max, bound), Stats(bound))
    return NgramCacheDrafter(n_max=n_max, static_path=config.ngram_cache_path, max_entries=bound, dynamic=shared)


def _draft_model(config: SpecConfig, *, target: Any, tokenizer: Any, target_path: Any = None, dtype: Any = None, **_: Any) -> Drafter:
    from tokenleap.models.loading import load_model
    from tokenleap.models.registry import resolve

    source = resolve(str(config.model))
    if target_path is not None and source.path.resolve() == target_path.resolve():
        model = target  # the target's own weights (shared, not copied)
    else:
        draft, draft_tok = load_model(source, target.dtype, use_kernels=target.kernels is not None)
        check_same_vocabulary(tokenizer, draft_tok, target, draft)
        model = draft
    if config.draft_layers is not None:
        model = model.with_layers(config.draft_layers)
    return DraftModelDrafter(model)


def _suffix(config: SpecConfig, **_: Any) -> Drafter:
    return SuffixDrafter(
        SuffixConfig(
            max_depth=config.suffix_decoding_max_tree_depth,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            min_token_prob=config.suffix_decoding_min_token_prob,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
        )
    )


def _chain(config: SpecConfig, *, registry: DrafterRegistry, **context: Any) -> Drafter:
    return ChainDrafter([registry.create(m, dataclasses.replace(config, method=m), **context) for m in config.chain])


def _custom(config: SpecConfig, **_: Any) -> Drafter:
    return check_drafter(config.drafter)


def default_registry() -> DrafterRegistry:
    """A fresh registry holding the built-in methods (no module-level mutable state). Drafters
    it creates share what may be shared (ngram-mod pools, ngram-cache's engine-wide statistics),
    chains included."""
    registry = DrafterRegistry()
    registry.register("ngram", _ngram)
    family = functools.partial(_llamacpp_family, pools=PoolStore(), dynamic={})
    for name in ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"):
        registry.register(name, family)
    registry.register("suffix", _suffix)
    registry.register("draft-model", _draft_model)
    registry.register("custom", _custom)
    registry.register("chain", functools.partial(_chain, registry=registry))
    return registry


__all__ = ["DraftModelDrafter", "Draft", "Drafter", "DraftRequest", "DrafterRegistry", "NgramDrafter", "default_registry", "check_drafter"]
