"""The built-in methods, one line each, in the order they are listed (help, errors, docs): each
record is defined beside its drafter. A new built-in is its module and one line here."""

from __future__ import annotations

from tokenleap.drafters import (
    chain,
    custom,
    draft_model,
    head_methods,
    lookup_tree,
    ngram,
    ngram_cache,
    ngram_map,
    ngram_mod,
    recycling,
    suffix,
)
from tokenleap.drafters.methods import MethodRecord

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
    recycling.METHOD,
)
