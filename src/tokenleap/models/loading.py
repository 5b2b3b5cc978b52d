"""Load a resolved model source into a runnable model and its tokenizer.

Dequantizing a GGUF takes seconds; the float32 result is cached once as safetensors in the user
cache (keyed by the file's path, size and mtime) and memory-mapped on later loads. Entries whose
GGUF is gone or changed are dropped, and only the few most recently used others kept.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from tokenleap.errors import TokenleapError
from tokenleap.kernels import load_kernels
from tokenleap.models.config import ModelConfig
from tokenleap.models.llama import LlamaModel
from tokenleap.models.loaders import load_gguf, load_hf_folder
from tokenleap.models.registry import ModelSource
from tokenleap.paths import cache_dir, source_identity, still_current
from tokenleap.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


WEIGHT_CACHE_KEEP = 4  # dequantized models kept in the cache beside the one in use (the most recently used)


def prune_weight_cache(folder: Path, keep: Path, limit: int = WEIGHT_CACHE_KEEP) -> list[Path]:
    """Drop the cached weights of GGUF files that are gone or changed (a deleted clone, a
    temporary copy: each would otherwise leave its float32 copy behind for good), then all but
    the `limit` most recently used others; `keep` stays. Returns what was removed."""
    from safetensors import safe_open

    removed: list[Path] = []
    current: list[Path] = []
    for f in folder.glob("*.safetensors"):
        if f == keep:
            continue
        try:
            with safe_open(str(f), "pt") as h:
                fresh = still_current(h.metadata() or {})
        except Exception:  # unreadable, or an entry from before sources were recorded
            fresh = False
        (current if fresh else removed).append(f)
    current.sort(key=lambda f: f.stat().st_mtime, reverse=True)
    removed += current[limit:]
    for f in removed:
        f.unlink(missing_ok=True)
    return removed


def _load_gguf_cached(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file, save_file

    source = source_identity(path)
    key = hashlib.sha256(f"v3:{source['source']}:{source['size']}:{source['mtime']}".encode()).hexdigest()[:16]
    cached = cache_dir() / "weights" / f"{key}.safetensors"
    if cached.is_file():
        try:
            from safetensors import safe_open

            with safe_open(str(cached), "pt") as f:
                meta = f.metadata()
            config, weights = ModelConfig.from_dict(json.loads(meta["config"])), load_file(str(cached))
            os.utime(cached)  # most recently used (prune_weight_cache keeps those)
            return config, weights
        except Exception as exc:  # a damaged cache file: rebuild it
            logger.warning("ignoring unreadable weight cache %s: %s", cached, exc)
    config, weights = load_gguf(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        save_file(weights, str(tmp), metadata={"config": json.dumps(dataclasses.asdict(config)), **source})
        os.replace(tmp, cached)
        for gone in prune_weight_cache(cached.parent, cached):
            logger.info("removed cached weights %s (their GGUF is gone or changed, or unused for longest)", gone.name)
    except OSError as exc:  # a read-only or full cache only costs speed
        logger.warning("could not cache dequantized weights: %s", exc)
    return config, weights


def _release_free_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's `malloc_trim`). A load frees many
    blocks of a few MB (a fused linear's parts once stacked) that malloc keeps below its
    dynamic mmap threshold: without this they stay resident (measured: 0.3 GB at 3B)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def resolve_quantization(source: ModelSource, dtype: torch.dtype, kernels: Any, quantization: str | None) -> str | None:
    """What `quantization=None` (the default) means: keep a GGUF file's blocks ("gguf") when the
    model runs in bfloat16 on the kernels, since that measured faster end to end (BENCHMARKS.md,
    "GGUF weights kept quantized": decode 1.18x, Spec-Bench end to end 1.10x, prefill 0.75-0.83x,
    a third of the bytes per token); float32 asks for reference precision, and the torch path
    reads dense weights, so both dequantize. "none" always dequantizes."""
    if quantization is not None:
        return None if quantization == "none" else quantization
    if source.kind == "gguf" and kernels is not None and dtype == torch.bfloat16:
        return "gguf"
    return None


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    *,
    use_kernels: bool = True,
    quantization: str | None = None,
    kv_cache_type: str = "auto",
) -> tuple[LlamaModel, Tokenizer]:
    """The model and its tokenizer. `quantization="gguf"` keeps a GGUF's quantized linears in
    their blocks (the kernels' quantized path); without kernels they are dequantized, with a
    warning. "none" dequantizes to `dtype`; None decides (`resolve_quantization`).
    `kv_cache_type`: "auto", "bf16" or "q8_0" (`LlamaModel`)."""
    kernels = load_kernels() if use_kernels else None
    quantization = resolve_quantization(source, dtype, kernels, quantization)
    if quantization == "gguf" and source.kind != "gguf":
        raise TokenleapError(f"quantization='gguf' needs a .gguf model; {source.name} is a {source.kind} source")
    if quantization == "gguf" and kernels is None:
        logger.warning(
            "quantization='gguf' needs tokenleap's kernels; dequantizing %s to %s instead", source.name, dtype
        )
        quantization = None
    if source.kind == "gguf" and quantization == "gguf":
        config, weights = load_gguf(source.path, keep_quantized=True)
        tokenizer = Tokenizer.from_gguf(source.path)
    elif source.kind == "gguf":
        config, weights = _load_gguf_cached(source.path)
        tokenizer = Tokenizer.from_gguf(source.path)
    else:
        config, weights = load_hf_folder(source.path)
        tokenizer = Tokenizer.from_folder(source.path)
    model = LlamaModel(config, weights, dtype, kernels, consume_weights=True, kv_cache_type=kv_cache_type)
    del weights
    _release_free_heap()
    logger.info(
        "loaded %s: %d layers, %.0fM parameters, %s%s",
        source.name,
        config.num_layers,
        config.num_parameters() / 1e6,
        dtype,
        ", linears kept in their GGUF blocks" if model.quantization else "",
    )
    return model, tokenizer
