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
    assert model.embed.dtype == torch.bfloat16 and model.layers[0].wqkv.dtype == torch.bfloat16
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
