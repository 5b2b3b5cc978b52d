"""load_model: a Hugging Face folder (tiny random Llama + the real tokenizer) becomes a runnable model and tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenleap.models.config import ModelConfig
from tokenleap.models.llama import LlamaModel
from tokenleap.models.loading import DTYPES, load_model
from tokenleap.models.registry import resolve
from tokenleap.tokenizer import Tokenizer

_HF_NAMES = {
    "attn_norm": "input_layernorm",
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def _write_hf_folder(folder: Path, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer) -> None:
    tensors = {"model.embed_tokens.weight": weights["embed"], "model.norm.weight": weights["norm"], "lm_head.weight": weights["lm_head"]}
    for key, t in weights.items():
        if key.startswith("layers."):
            _, idx, short = key.split(".")
            tensors[f"model.layers.{idx}.{_HF_NAMES[short]}.weight"] = t
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": %d, "hidden_size": %d, "intermediate_size": %d, '
        '"num_hidden_layers": %d, "num_attention_heads": %d, "num_key_value_heads": %d, "head_dim": %d, '
        '"rms_norm_eps": %g, "rope_theta": %g, "max_position_embeddings": %d, "tie_word_embeddings": false}'
        % (
            config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.head_dim, config.rms_norm_eps, config.rope_theta, config.max_position,
        )
    )
    tokenizer.hf.save_pretrained(str(folder))


def test_load_hf_folder_model_and_tokenizer(
    tmp_path: Path, tiny_config: ModelConfig, tiny_weights: dict[str, torch.Tensor], tiny_model: LlamaModel, tokenizer: Tokenizer
) -> None:
    _write_hf_folder(tmp_path, tiny_config, tiny_weights, tokenizer)
    source = resolve(str(tmp_path))
    model, tok = load_model(source, DTYPES["float32"])
    assert model.config == tiny_config
    assert tok.encode("hello world") == tokenizer.encode("hello world")
    assert tok.eos_token_ids == tokenizer.eos_token_ids
    ids = torch.arange(3, 43)
    a = model.compute_logits(model.forward(ids, torch.arange(40), model.new_kv_cache()).hidden)
    b = tiny_model.compute_logits(tiny_model.forward(ids, torch.arange(40), tiny_model.new_kv_cache()).hidden)
    assert torch.equal(a, b)


def test_load_model_dtype_and_kernels_switch(tmp_path: Path, tiny_config: ModelConfig, tiny_weights: dict[str, torch.Tensor], tokenizer: Tokenizer) -> None:
    _write_hf_folder(tmp_path, tiny_config, tiny_weights, tokenizer)
    model, _ = load_model(resolve(str(tmp_path)), DTYPES["bf16"], use_kernels=False)
    assert model.kernels is None
    assert model.embed.dtype == torch.bfloat16 and model.layers[0].wqkv.dtype == torch.bfloat16
    assert model.norm.dtype == torch.float32  # norms stay fp32
