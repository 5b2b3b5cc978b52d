"""Weight loaders: GGUF (through the `gguf` package) and Hugging Face folders (safetensors).

GGUF files written by llama.cpp's converter store the Q and K projections of Llama-family
models permuted for llama.cpp's interleaved ("GPT-J style") rotary embedding; we undo that
permutation so every source ends in Hugging Face's layout (half-split, "GPT-NeoX style" RoPE)
and one model implementation serves both. Quantized tensors (Q4_1, Q8_0, ...) are
dequantized to float32 at load time with `gguf.quants.dequantize`, or, with `keep_quantized`,
the linears' (and the LM head's) blocks in the formats the kernels read (`QUANT_TYPES`) are kept
as they are in the file (`QuantWeight`); the others are dequantized with a log line.

Both loaders return a `ModelConfig` and a dict of float32 tensors under canonical names:
`embed`, `norm`, `lm_head` (absent when tied) and `layers.{i}.{attn_norm, q, k, v, o,
q_bias, k_bias, v_bias, mlp_norm, gate, up, down}`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenleap.errors import ModelNotFoundError, TokenleapError
from tokenleap.models.config import ModelConfig

logger = logging.getLogger(__name__)

_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}

_HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.o_proj": "o",
    "post_attention_layernorm": "mlp_norm",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.down_proj": "down",
}


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's `permute` of Q/K rows (interleaved pairs -> half-split halves)."""
    out_dim = w.shape[0]
    rest = w.shape[1:]
    half = out_dim // n_heads // 2
    return w.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_gguf_config(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise TokenleapError("GGUF file has no general.architecture field")
    if arch not in ("llama", "qwen2", "mistral"):
        raise TokenleapError(
            f"GGUF architecture {arch!r} is not supported by the native runtime yet "
            "(supported: llama, qwen2, mistral)"
        )
    names = {t.name for t in reader.tensors}
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(_field(reader, f"{arch}.vocab_size", int(emb.shape[-1])))
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=n_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=int(_field(reader, f"{arch}.rope.dimension_count", hidden // n_heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
    )


_LINEARS = {"q", "k", "v", "o", "gate", "up", "down"}


def load_gguf(path: str | Path, *, keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, Any]]:
    """Read a GGUF file: config from its metadata, float32 weights under canonical names (with
    `keep_quantized`, `QuantWeight`s for linear weights in a kernel-readable format, and for a
    tied LM head a quantized `lm_head` beside the float `embed` used for lookups)."""
    import gguf

    from tokenleap.kernels import QUANT_TYPES, QuantWeight

    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises bare ValueErrors on bad files
        raise TokenleapError(f"{path} is not a readable GGUF file: {exc}") from exc
    config = read_gguf_config(reader)
    weights: dict[str, Any] = {}
    dequantized: dict[str, int] = {}
    for tensor in reader.tensors:
        out_dim, in_dim = (int(tensor.shape[1]), int(tensor.shape[0])) if len(tensor.shape) == 2 else (0, 0)
        key = _gguf_key(tensor.name)
        short = key.rsplit(".", 1)[-1].removesuffix("_bias") if key else None  # q_bias unpermutes like q
        quant_ok = keep_quantized and len(tensor.shape) == 2 and QuantWeight.fits(int(tensor.tensor_type), out_dim, in_dim)
        if quant_ok and (short in _LINEARS or key in ("lm_head", "embed")):
            raw = np.ascontiguousarray(tensor.data).reshape(out_dim, -1)
            if config.architecture == "llama" and short in ("q", "k"):
                raw = _unpermute_rope(raw, config.num_heads if short == "q" else config.num_kv_heads)
            qw = QuantWeight.from_blocks(raw, int(tensor.tensor_type), out_dim, in_dim)
            if key != "embed":
                weights[key] = qw
                continue
            if config.tie_word_embeddings:
                weights["lm_head"] = qw  # the LM head reads the blocks; lookups read `embed`
        elif keep_quantized and key and len(tensor.shape) == 2 and tensor.tensor_type.name not in ("F32", "F16", "BF16"):
            dequantized[tensor.tensor_type.name] = dequantized.get(tensor.tensor_type.name, 0) + 1
        if key is None:
            logger.debug("ignoring GGUF tensor %s", tensor.name)
            continue
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.array(array, dtype=np.float32, copy=True).reshape(
            [int(d) for d in reversed(tensor.shape.tolist())]
        )
        if config.architecture == "llama" and short in ("q", "k"):
            array = _unpermute_rope(array, config.num_heads if short == "q" else config.num_kv_heads)
        weights[key] = torch.from_numpy(np.ascontiguousarray(array))  # owns its memory
    for name, count in dequantized.items():
        logger.info("%s: %d %s tensors dequantized at load (the kernels read %s blocks)", path.name, count, name,
                    ", ".join(n for n, _ in QUANT_TYPES.values()))
    return config, weights


def _gguf_key(name: str) -> str | None:
    """The canonical name of a GGUF tensor (None: not one the runtime uses)."""
    if name == "token_embd.weight":
        return "embed"
    if name == "output_norm.weight":
        return "norm"
    if name == "output.weight":
        return "lm_head"
    if name.startswith("blk."):
        _, idx, part, kind = name.split(".", 3)
        if part in _GGUF_LAYER_NAMES:
            return f"layers.{idx}.{_GGUF_LAYER_NAMES[part]}" + ("_bias" if kind == "bias" else "")
    return None


def read_hf_config(folder: Path) -> ModelConfig:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelNotFoundError(f"{folder} has no config.json")
    try:
        return _parse_hf_config(json.loads(cfg_path.read_text()))
    except (KeyError, ValueError, TypeError) as exc:
        if isinstance(exc, TokenleapError):
            raise
        raise TokenleapError(f"{cfg_path} is not a usable model config ({type(exc).__name__}: {exc})") from exc


def _parse_hf_config(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type", "")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    if rope_type not in ("default", None):
        raise TokenleapError(f"rope scaling {rope_type!r} is not supported yet")
    n_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=n_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=int(raw.get("head_dim") or hidden // n_heads),
        rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
    )


def load_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face model folder (config.json + *.safetensors)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_hf_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            name = name.removeprefix("model.")
            if name == "embed_tokens.weight":
                key = "embed"
            elif name == "norm.weight":
                key = "norm"
            elif name == "lm_head.weight":
                key = "lm_head"
            elif name.startswith("layers."):
                _, idx, rest = name.split(".", 2)
                module, _, kind = rest.rpartition(".")
                if module not in _HF_LAYER_NAMES:
                    continue
                key = f"layers.{idx}.{_HF_LAYER_NAMES[module]}" + ("_bias" if kind == "bias" else "")
            else:
                continue
            weights[key] = tensor.float()
    if config.tie_word_embeddings:
        weights.pop("lm_head", None)
    return config, weights
