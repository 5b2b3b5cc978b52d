"""load_model: a Hugging Face folder (tiny random Llama + the real tokenizer) becomes a runnable model and tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenleap.models.config import ModelConfig
from tokenleap.models.llama import LlamaModel
from tokenleap.models.loading import DTYPES, load_model
from tokenleap.models.registry import resolve
from tokenleap.tokenizer import Tokenizer


def test_load_hf_folder_model_and_tokenizer(
    tiny_hf_folder: Path, tiny_config: ModelConfig, tiny_model: LlamaModel, tokenizer: Tokenizer
) -> None:
    source = resolve(str(tiny_hf_folder))
    assert source.kind == "hf"
    model, tok = load_model(source, DTYPES["float32"])
    assert model.config == tiny_config
    assert model.kernels is tiny_model.kernels
    assert tok.encode("hello world") == tokenizer.encode("hello world")
    assert tok.eos_token_ids == tokenizer.eos_token_ids
    ids = torch.arange(3, 43)
    a = model.compute_logits(model.forward(ids, torch.arange(40), model.new_kv_cache()).hidden)
    b = tiny_model.compute_logits(tiny_model.forward(ids, torch.arange(40), tiny_model.new_kv_cache()).hidden)
    assert torch.equal(a, b)


def test_load_model_dtype_and_kernels_switch(tiny_hf_folder: Path) -> None:
    model, _ = load_model(resolve(str(tiny_hf_folder)), DTYPES["bf16"], use_kernels=False)
    assert model.kernels is None
    assert (
        model.embed.dtype == torch.bfloat16
        and isinstance(w := model.layers[0].wqkv.weight, torch.Tensor)
        and w.dtype == torch.bfloat16
    )
    assert model.lm_head.dtype == torch.bfloat16
    assert model.norm.dtype == torch.float32 and model.layers[0].attn_norm.dtype == torch.float32
    assert model.kv_dtype == torch.float32


def test_default_quantization_keeps_gguf_blocks_only_in_bf16_on_the_kernels(tmp_path: Path) -> None:
    from tokenleap.models.loading import resolve_quantization
    from tokenleap.models.registry import ModelSource

    gguf, folder = ModelSource("m", "gguf", tmp_path / "m.gguf"), ModelSource("f", "hf", tmp_path)
    kernels = object()  # only its presence matters
    assert resolve_quantization(gguf, torch.bfloat16, kernels, None) == "gguf"  # the default: the file's own blocks
    assert resolve_quantization(gguf, torch.float32, kernels, None) is None  # reference precision
    assert resolve_quantization(gguf, torch.bfloat16, None, None) is None  # the torch path reads dense weights
    assert resolve_quantization(folder, torch.bfloat16, kernels, None) is None
    assert resolve_quantization(gguf, torch.bfloat16, kernels, "none") is None
    assert resolve_quantization(gguf, torch.float32, kernels, "gguf") == "gguf"


def test_weight_cache_drops_entries_of_gone_or_changed_files_and_the_least_recently_used(tmp_path: Path) -> None:
    import os

    from safetensors.torch import save_file

    from tokenleap.models.loading import prune_weight_cache
    from tokenleap.paths import source_identity

    cache = tmp_path / "weights"
    cache.mkdir()

    def entry(name: str, gguf: Path | None, age: float) -> Path:
        f = cache / f"{name}.safetensors"
        save_file({"w": torch.zeros(2)}, str(f), metadata=source_identity(gguf) if gguf else {"config": "{}"})
        os.utime(f, (1e9 - age, 1e9 - age))
        return f

    ggufs = []
    for i in range(6):
        g = tmp_path / f"m{i}.gguf"
        g.write_bytes(b"x" * (i + 1))
        ggufs.append(g)
    keep = entry("keep", ggufs[0], 100)
    current = [entry(f"c{i}", ggufs[i], i) for i in range(1, 6)]  # c1 the most recently used
    old = entry("old", None, 0)  # written before entries recorded their source
    deleted = tmp_path / "deleted.gguf"
    deleted.write_bytes(b"y")
    gone = entry("gone", deleted, 0)
    deleted.unlink()
    changed = entry("changed", ggufs[5], 0)
    ggufs[5].write_bytes(b"longer now")  # so c5 is stale too
    removed = prune_weight_cache(cache, keep, limit=2)
    assert set(removed) == {gone, changed, old, current[4], current[2], current[3]}
    assert sorted(p.name for p in cache.iterdir()) == ["c1.safetensors", "c2.safetensors", "keep.safetensors"]
