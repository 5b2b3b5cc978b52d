"""Drafters: the protocol, the registry of built-in methods, one module per family.

An engine keeps one drafter per `drafter_key`: the config fields its method reads
(`METHOD_FIELDS`), so configs that differ only in per-request controls (`CONTROL_FIELDS`: the
draft length cap and floor, adaptive drafting) or in other methods' knobs share a drafter and its
state across requests. A user's drafter object is keyed by identity. Draft models are loaded once
per registry (`LoadedModels`), whatever the number of drafters that use them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Hashable
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tokenleap.config import SpecConfig
from tokenleap.drafters.chain import ChainDrafter
from tokenleap.drafters.base import Draft, Drafter, DrafterRegistry, DraftRequest, check_drafter
from tokenleap.drafters.cross_tokenizer import CrossTokenizerDrafter
from tokenleap.drafters.draft_model import DraftModelDrafter, same_vocabulary
from tokenleap.drafters.lookup_tree import LookupTreeDrafter
from tokenleap.drafters.ngram import NgramDrafter
from tokenleap.drafters.ngram_cache import NgramCacheDrafter, Stats
from tokenleap.drafters.ngram_map import NgramMapK4VDrafter, NgramMapKDrafter, NgramSimpleDrafter
from tokenleap.drafters.ngram_mod import NgramModDrafter, PoolStore
from tokenleap.drafters.suffix import SuffixConfig, SuffixDrafter
from tokenleap.errors import TokenleapError

logger = logging.getLogger(__name__)


def _ngram(config: SpecConfig, **_: Any) -> Drafter:
    return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)


def _ngram_tree(config: SpecConfig, **_: Any) -> Drafter:
    return LookupTreeDrafter(config.prompt_lookup_min, config.prompt_lookup_max)


def _llamacpp_family(
    config: SpecConfig, *, pools: PoolStore, dynamic: dict[tuple[int, int], Stats], **_: Any
) -> Drafter:
    n, m, hits = config.ngram_size_n, config.ngram_size_m, config.ngram_min_hits
    if config.method == "ngram-simple":
        return NgramSimpleDrafter(n, m)
    if config.method == "ngram-map-k":  # min hits: as given, else the drafter's own default
        return NgramMapKDrafter(n, m, NgramMapKDrafter.DEFAULT_MIN_HITS if hits is None else hits)
    if config.method == "ngram-map-k4v":
        return NgramMapK4VDrafter(n, m, NgramMapK4VDrafter.DEFAULT_MIN_HITS if hits is None else hits)
    if config.method == "ngram-mod":  # one pool per (n, size) for every drafter of this registry
        size = config.ngram_mod_pool_size
        return NgramModDrafter(n, size, pool=pools.get(n, size))
    # ngram-cache: one engine-wide statistics table per (n_max, bound) for this registry's drafters
    n_max, bound = min(n, 4), config.ngram_cache_max_entries
    shared = dynamic.setdefault((n_max, bound), Stats(bound))
    return NgramCacheDrafter(n_max=n_max, static_path=config.ngram_cache_path, max_entries=bound, dynamic=shared)


class LoadedModels:
    """Draft models loaded by one registry's drafters, by resolved path, dtype and kernel use:
    drafters for the same model under other settings (another cap, another layer count) share
    one copy of its weights instead of loading another on the engine thread."""

    def __init__(self) -> None:
        self._models: dict[tuple[Path, Any, bool, str | None], Any] = {}

    def get(self, config: SpecConfig, *, target: Any, tokenizer: Any, target_path: Any = None) -> tuple[Any, Any]:
        """The draft model, and its tokenizer when its vocabulary differs from the target's
        (None when they share one: the draft then speaks the target's ids)."""
        from tokenleap.models import loading
        from tokenleap.models.registry import resolve

        source = resolve(str(config.model))
        path = source.path.resolve()
        if target_path is not None and path == Path(target_path).resolve():
            return target, None  # the target's own weights (shared, not copied)
        # a GGUF draft keeps its blocks quantized when the target does, and is dequantized when it is not
        quantization = (getattr(target, "quantization", None) or "none") if source.kind == "gguf" else None
        key = (path, target.dtype, target.kernels is not None, quantization)
        if key not in self._models:
            draft, draft_tok = loading.load_model(source, target.dtype, use_kernels=target.kernels is not None, quantization=quantization)
            same = same_vocabulary(tokenizer, draft_tok, target, draft)
            if not same:
                logger.info("the draft model %s has another tokenizer than the target: drafting by text re-tokenization", source.name)
            self._models[key] = (draft, None if same else draft_tok)
        return self._models[key]


def _draft_model(config: SpecConfig, *, target: Any, tokenizer: Any, target_path: Any = None, models: LoadedModels | None = None,
                 **_: Any) -> Drafter:
    model, draft_tok = (models or LoadedModels()).get(config, target=target, tokenizer=tokenizer, target_path=target_path)
    if config.draft_layers is not None:
        model = model.with_layers(config.draft_layers)
    if draft_tok is not None:
        return CrossTokenizerDrafter(model, draft_tok, tokenizer)
    return DraftModelDrafter(model)


def _eagle3(config: SpecConfig, *, target: Any, heads: dict[tuple[Path, int], Any] | None = None,
            target_name: str | None = None, **_: Any) -> Drafter:
    from tokenleap.drafters.eagle3 import Eagle3Drafter, TreeShape, load_eagle3, measure_step_cost

    if not config.model:  # the head shipped for this model (tokenleap/heads)
        from tokenleap.heads import shipped_head, shipped_heads

        path = shipped_head("eagle3", target_name)
        if path is None:
            have = ", ".join(shipped_heads()) or "none"
            raise TokenleapError(
                f"no EAGLE-3 head ships for model {target_name!r} (shipped: {have}): train one with "
                f"`tokenleap train-drafter -o DIR` and pass speculative_config['model'] = DIR (CLI: --model-draft DIR)"
            )
        config = dataclasses.replace(config, model=str(path))
    heads = heads if heads is not None else {}
    key = (Path(str(config.model)).expanduser().resolve(), id(target))
    if key not in heads:  # one copy of a head's weights (and its measured step cost) per registry and target
        head = load_eagle3(str(config.model), target)
        heads[key] = (head, measure_step_cost(head))
    head, step = heads[key]
    tree = TreeShape(config.eagle_tree_topk, config.eagle_tree_depth)
    # per draft token: a chain runs one head step per token; a tree one step (of k rows, about the
    # cost of one row on this CPU) per depth for up to k nodes
    per_token = step / tree.topk
    return Eagle3Drafter(head, tree, relative_draft_cost=per_token)


def _mtp(config: SpecConfig, *, target: Any, target_path: Any = None, heads: dict[tuple[Path, int], Any] | None = None,
         **_: Any) -> Drafter:
    """A checkpoint's own MTP layer (MiMo) drafting for it: the target's folder unless `model` names one."""
    from tokenleap.drafters.eagle3 import Eagle3Drafter, TreeShape, measure_step_cost
    from tokenleap.drafters.mtp import load_mtp

    folder = config.model or (str(target_path) if target_path is not None and Path(target_path).is_dir() else None)
    if folder is None:
        raise TokenleapError("method 'mtp' reads the MTP layers of the target's Hugging Face folder; this target is not one "
                             "(a GGUF file's nextn tensors are not read): pass speculative_config['model'] = a folder holding them")
    heads = heads if heads is not None else {}
    key = (Path(folder).expanduser().resolve(), id(target))
    if key not in heads:
        head = load_mtp(folder, target)
        heads[key] = (head, measure_step_cost(head))  # type: ignore[arg-type]  # an MtpHead (Eagle1Head) has the Eagle3Head methods it calls; no head protocol yet
    head, step = heads[key]
    tree = TreeShape(config.eagle_tree_topk, config.eagle_tree_depth)
    return Eagle3Drafter(head, tree, relative_draft_cost=step / tree.topk)


def _medusa(config: SpecConfig, *, target: Any, **_: Any) -> Drafter:
    from tokenleap.drafters.medusa import MedusaDrafter, load_medusa

    return MedusaDrafter(load_medusa(str(config.model), target), topk=config.eagle_tree_topk)


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
    return ChainDrafter([registry.create(m, dataclasses.replace(config, method=m), **context) for m in config.chain], names=config.chain)


def _custom(config: SpecConfig, **_: Any) -> Drafter:
    return check_drafter(config.drafter)


# The SpecConfig fields each method's factory (above) reads: an engine keeps one drafter per
# distinct (method, these values). Per-request controls the engine itself reads never make a new
# drafter. tests/drafters/test_keys.py checks that every SpecConfig field is claimed here and that
# the factories read nothing else: a new field must be listed under the methods that read it.
CONTROL_FIELDS = ("num_speculative_tokens", "draft_min", "adaptive", "sampled_tree", "acceptance", "typical_threshold", "typical_alpha")
_LLAMACPP = ("ngram_size_n", "ngram_size_m", "ngram_min_hits")  # `_llamacpp_family` reads all three
METHOD_FIELDS: MappingProxyType[str, tuple[str, ...]] = MappingProxyType({
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "ngram-tree": ("prompt_lookup_min", "prompt_lookup_max"),
    "ngram-simple": _LLAMACPP,
    "ngram-map-k": _LLAMACPP,
    "ngram-map-k4v": _LLAMACPP,
    "ngram-mod": (*_LLAMACPP, "ngram_mod_pool_size"),
    "ngram-cache": (*_LLAMACPP, "ngram_cache_path", "ngram_cache_max_entries"),
    "suffix": ("suffix_decoding_max_tree_depth", "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
               "suffix_decoding_max_cached_requests"),
    "draft-model": ("model", "draft_layers"),
    "eagle3": ("model", "eagle_tree_topk", "eagle_tree_depth"),
    "eagle": ("model", "eagle_tree_topk", "eagle_tree_depth"),  # EAGLE-1/2 heads, same loader (it tells the layouts apart)
    "mtp": ("model", "eagle_tree_topk", "eagle_tree_depth"),  # MiMo MTP layers (model None: the target's own folder)
    "medusa": ("model", "eagle_tree_topk"),
    "custom": ("drafter",),  # keyed by the object's identity (it may be unhashable)
    "chain": ("chain",),  # and each member's own fields
})


def drafter_key(config: SpecConfig) -> tuple[Hashable, ...]:
    """What identifies the drafter serving `config`: its method and the fields the method reads."""
    if config.method == "custom":
        return ("custom", id(config.drafter))  # the engine keeps the object alive with its drafter
    if config.method == "chain":
        return ("chain", *(drafter_key(dataclasses.replace(config, method=m)) for m in config.chain))
    return (config.method, *(getattr(config, f) for f in METHOD_FIELDS[config.method]))


def default_registry() -> DrafterRegistry:
    """A fresh registry holding the built-in methods (no module-level mutable state). Drafters
    it creates share what may be shared (ngram-mod pools, ngram-cache's engine-wide statistics,
    loaded draft models: `LoadedModels`), chains included."""
    registry = DrafterRegistry()
    registry.register("ngram", _ngram)
    registry.register("ngram-tree", _ngram_tree)
    family = functools.partial(_llamacpp_family, pools=PoolStore(), dynamic={})
    for name in ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"):
        registry.register(name, family)
    registry.register("suffix", _suffix)
    registry.register("draft-model", functools.partial(_draft_model, models=LoadedModels()))
    heads: dict[tuple[Path, int], Any] = {}
    registry.register("eagle3", functools.partial(_eagle3, heads=heads))
    registry.register("eagle", functools.partial(_eagle3, heads=heads))
    registry.register("medusa", _medusa)
    registry.register("mtp", functools.partial(_mtp, heads={}))
    registry.register("custom", _custom)
    registry.register("chain", functools.partial(_chain, registry=registry))
    return registry


__all__ = ["CONTROL_FIELDS", "METHOD_FIELDS", "DraftModelDrafter", "Draft", "Drafter", "DraftRequest", "DrafterRegistry", "LoadedModels",
           "NgramDrafter", "default_registry", "drafter_key", "check_drafter"]
