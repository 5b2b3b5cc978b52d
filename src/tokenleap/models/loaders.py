"""Weight loaders: GGUF (read by `models/gguf_file.py`) and Hugging Face folders (safetensors).

GGUF files written by llama.cpp's converter store the Q and K projections of Llama-family
models permuted for llama.cpp's interleaved ("GPT-J style") rotary embedding; we undo that
permutation so every source ends in Hugging Face's layout (half-split, "GPT-NeoX style" RoPE)
and one model implementation serves both. Quantized tensors (Q4_1, Q8_0, ...) are
dequantized to float32 at load time with `gguf.quants.dequantize`, or, with `keep_quantized`,
the linears', the token table's and the LM head's blocks in the formats the kernels read
(`kernels.FORMATS`) are kept in the file's values and bytes (`QuantWeight`, repacked once; the mapped
pages of each tensor are released once it is copied); the others are dequantized with a log line.

Both loaders return a `ModelConfig` and a dict of float32 tensors under canonical names:
`embed`, `norm`, `lm_head` (absent when tied) and `layers.{i}.{attn_norm, q, k, v, o,
q_bias, k_bias, v_bias, q_norm, k_norm, post_attn_norm, mlp_norm, gate, up, down, post_mlp_norm}`
(norm weights as multipliers: Gemma's `1 + w` is folded in, as llama.cpp's converter does).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from tokenleap.errors import ModelNotFoundError, TokenleapError
from tokenleap.models.config import ModelConfig, RopeScaling
from tokenleap.models.gguf_file import GgufFile

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
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "post_attention_norm": "post_attn_norm",
    "post_ffw_norm": "post_mlp_norm",
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
    "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm",
}

# Gemma 3 has four norms per layer: its `post_attention_layernorm` is a post-norm
_HF_GEMMA_LAYER_NAMES = {
    **_HF_LAYER_NAMES,
    "post_attention_layernorm": "post_attn_norm",
    "pre_feedforward_layernorm": "mlp_norm",
    "post_feedforward_layernorm": "post_mlp_norm",
}


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's `permute` of Q/K rows (interleaved pairs -> half-split halves)."""
    out_dim = w.shape[0]
    rest = w.shape[1:]
    half = out_dim // n_heads // 2
    return w.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value of a `GgufFile` (or of a `gguf.GGUFReader`)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents() if hasattr(field, "contents") else field


_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")


def read_gguf_config(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise TokenleapError("GGUF file has no general.architecture field")
    if arch not in _GGUF_ARCHITECTURES:
        raise TokenleapError(
            f"GGUF architecture {arch!r} is not supported by the native runtime yet "
            f"(supported: {', '.join(_GGUF_ARCHITECTURES)})"
        )
    names = {t.name for t in reader.tensors}

    def required(key: str) -> int:
        value = _field(reader, key)
        if value is None:
            raise TokenleapError(f"GGUF file has no {key} field")
        return int(value)

    n_heads = required(f"{arch}.attention.head_count")
    hidden = required(f"{arch}.embedding_length")
    num_layers = required(f"{arch}.block_count")
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(_field(reader, f"{arch}.vocab_size", int(emb.shape[-1])))
    head_dim = int(
        _field(reader, f"{arch}.attention.key_length", 0)
        or _field(reader, f"{arch}.rope.dimension_count", hidden // n_heads)
    )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if scaling not in (None, "none", "linear"):
        raise TokenleapError(
            f"GGUF {arch}: rope scaling {scaling!r} (factor {factor}) is not supported by the native runtime"
        )
    linear_factor = factor if scaling == "linear" else 1.0
    freq_factors = None
    if "rope_freqs.weight" in names:  # Llama 3.x scaling, precomputed by llama.cpp's converter
        import gguf

        tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1)
        freq_factors = tuple(float(v) for v in values)
    extra: dict[str, Any] = {}
    if arch == "qwen3":
        extra = dict(qk_norm=True)
    elif arch == "gemma3":
        window = _field(reader, f"{arch}.attention.sliding_window")
        if window is None:
            raise TokenleapError("GGUF gemma3: no attention.sliding_window field")
        extra = dict(
            qk_norm=True,
            sliding_window=int(window),
            sliding_layers=tuple((i + 1) % 6 != 0 for i in range(num_layers)),  # llama.cpp's fixed pattern
            rope_local_theta=float(_field(reader, f"{arch}.rope.freq_base_swa", 10000.0)),  # llama.cpp's default: 10k
            embed_scale=hidden**0.5,
            post_norms=True,
            activation="gelu_tanh",
            # llama.cpp: 27B (62 layers) scales by hidden / heads, the others by head_dim
            query_scale=(hidden / n_heads) ** -0.5 if num_layers == 62 else None,
            final_logit_softcap=_field(reader, f"{arch}.final_logit_softcapping"),
        )
        if _field(reader, f"{arch}.attn_logit_softcapping") is not None:
            raise TokenleapError("GGUF gemma3: attn_logit_softcapping is not supported")
    elif _field(reader, f"{arch}.attention.sliding_window") is not None:
        extra = dict(sliding_window=int(_field(reader, f"{arch}.attention.sliding_window")))
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=required(f"{arch}.feed_forward_length"),
        num_layers=num_layers,
        num_heads=n_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_freq_factors=freq_factors,
        rope_linear_factor=linear_factor,
        **extra,
    )


_LINEARS = {"q", "k", "v", "o", "gate", "up", "down"}


def load_gguf(path: str | Path, *, keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, Any]]:
    """Read a GGUF file: config from its metadata, float32 weights under canonical names (with
    `keep_quantized`, `QuantWeight`s for the linears, the token table and the LM head in a
    kernel-readable format; a tied LM head is the token table's `QuantWeight`)."""
    import gguf

    from tokenleap.kernels import QuantWeight, format_names

    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    reader = GgufFile(path)
    config = read_gguf_config(reader)
    weights: dict[str, Any] = {}
    dequantized: dict[str, int] = {}
    # a progress bar for files that take seconds (on a terminal only: tqdm's disable=None)
    tensors = tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", leave=False,
                   disable=None if path.stat().st_size > 1 << 30 else True)
    for tensor in tensors:
        out_dim, in_dim = (int(tensor.shape[1]), int(tensor.shape[0])) if len(tensor.shape) == 2 else (0, 0)
        key = _gguf_key(tensor.name)
        short = key.rsplit(".", 1)[-1].removesuffix("_bias") if key else None  # q_bias unpermutes like q
        quant_ok = (
            keep_quantized and len(tensor.shape) == 2 and QuantWeight.fits(int(tensor.tensor_type), out_dim, in_dim)
        )
        if quant_ok and key is not None and (short in _LINEARS or key in ("lm_head", "embed")):
            raw = np.ascontiguousarray(tensor.data).reshape(out_dim, -1)
            if config.architecture == "llama" and short in ("q", "k"):
                raw = unpermute_rope(raw, config.num_heads if short == "q" else config.num_kv_heads)
            qw = QuantWeight.from_blocks(raw, int(tensor.tensor_type), out_dim, in_dim)
            reader.release(tensor)
            weights[key] = qw  # the token table too: lookups decode its rows (QuantWeight.rows)
            if key == "embed" and config.tie_word_embeddings:
                weights["lm_head"] = qw  # one copy of the blocks for both
            continue
        elif (
            keep_quantized and key and len(tensor.shape) == 2 and tensor.tensor_type.name not in ("F32", "F16", "BF16")
        ):
            dequantized[tensor.tensor_type.name] = dequantized.get(tensor.tensor_type.name, 0) + 1
        if key is None:
            logger.debug("ignoring GGUF tensor %s", tensor.name)
            continue
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.array(array, dtype=np.float32, copy=True).reshape(
            [int(d) for d in reversed(list(tensor.shape))]
        )
        if config.architecture == "llama" and short in ("q", "k"):
            array = unpermute_rope(array, config.num_heads if short == "q" else config.num_kv_heads)
        weights[key] = torch.from_numpy(np.ascontiguousarray(array))  # owns its memory
        reader.release(tensor)
    for name, count in dequantized.items():
        logger.info("%s: %d %s tensors dequantized at load (the kernels read %s blocks)", path.name, count, name,
                    format_names())
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


_HF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mistral": "mistral",
    "gemma3_text": "gemma3",
}


def _rope_params(raw: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rope parameters of a config (`rope_scaling`, or transformers 5's `rope_parameters`,
    possibly keyed by layer type), with `rope_theta` filled in."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if layer_type is not None and layer_type in rope:
        rope = rope[layer_type]
    rope = dict(rope or {})
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = raw.get("rope_theta") or 10000.0
    rope.setdefault("rope_type", rope.get("type") or "default")
    return rope


def _rope_linear_factor(rope: dict[str, Any]) -> float:
    """The factor of a "linear" rope scaling (1.0 for any other kind)."""
    return float(rope.get("factor") or 1.0) if (rope.get("rope_type") or "default") == "linear" else 1.0


def _rope_scaling(rope: dict[str, Any], model_type: str) -> RopeScaling | None:
    """Llama 3.x scaling; None for none and for "linear" (`_rope_linear_factor`)."""
    kind = rope.get("rope_type") or "default"
    if kind in ("default", "linear"):
        return None
    if kind == "llama3":
        return RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position=int(rope["original_max_position_embeddings"]),
        )
    raise TokenleapError(
        f"{model_type}: rope scaling {kind!r} is not supported by the native runtime (supported: llama3, linear)"
    )


def _parse_hf_config(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type", "")
    if model_type == "gemma3" and "text_config" in raw:
        raise TokenleapError("gemma3 (multimodal) folders are not supported; use a text-only gemma3_text model")
    arch = _HF_ARCHITECTURES.get(model_type)
    if arch is None:
        raise TokenleapError(
            f"model_type {model_type!r} is not supported by the native runtime "
            f"(supported: {', '.join(_HF_ARCHITECTURES)})"
        )
    if raw.get("use_sliding_window"):
        raise TokenleapError(f"{model_type}: use_sliding_window (sliding window on some layers only) is not supported")
    n_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    num_layers = int(raw["num_hidden_layers"])
    head_dim = int(raw.get("head_dim") or hidden // n_heads)
    gemma = arch == "gemma3"
    rope = _rope_params(raw, "full_attention" if gemma else None)
    extra: dict[str, Any] = {}
    if gemma:
        if raw.get("attn_logit_softcapping") is not None:
            raise TokenleapError("gemma3: attn_logit_softcapping is not supported")
        if raw.get("use_bidirectional_attention"):
            raise TokenleapError("gemma3: use_bidirectional_attention is not supported")
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise TokenleapError(f"gemma3: hidden_activation {act!r} is not supported (supported: gelu_pytorch_tanh)")
        layer_types = raw.get("layer_types")
        if layer_types is None:
            pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
            layer_types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
            ]
        # transformers 5 keys rope parameters by layer type; 4.x's `rope_scaling` (Gemma 3 4B+:
        # linear, factor 8) is the global layers' alone, the local ones use rope_local_base_freq
        keyed = "sliding_attention" in (raw.get("rope_parameters") or {})
        local = _rope_params(raw, "sliding_attention") if keyed else {"rope_type": "default"}
        if _rope_scaling(local, model_type) is not None or _rope_linear_factor(local) != 1.0:
            raise TokenleapError("gemma3: rope scaling on the sliding-window layers is not supported")
        local_theta = local["rope_theta"] if keyed else raw.get("rope_local_base_freq", 10000.0)
        qpas = raw.get("query_pre_attn_scalar")
        extra = dict(
            qk_norm=True,
            sliding_window=int(raw["sliding_window"]),
            sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
            rope_local_theta=float(local_theta),
            embed_scale=hidden**0.5,
            post_norms=True,
            activation="gelu_tanh",
            query_scale=float(qpas) ** -0.5 if qpas is not None else None,
            final_logit_softcap=raw.get("final_logit_softcapping"),
        )
    elif arch == "qwen3":
        extra = dict(qk_norm=True)
    elif arch == "mistral" and raw.get("sliding_window"):
        extra = dict(sliding_window=int(raw["sliding_window"]))
    tie_default = gemma
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=n_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        rope_theta=float(rope["rope_theta"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", tie_default)),
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        rope_scaling=_rope_scaling(rope, model_type),
        rope_linear_factor=_rope_linear_factor(rope),
        **extra,
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
    gemma = config.architecture == "gemma3"
    layer_names = _HF_GEMMA_LAYER_NAMES if gemma else _HF_LAYER_NAMES
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
                if module not in layer_names:
                    continue
                key = f"layers.{idx}.{layer_names[module]}" + ("_bias" if kind == "bias" else "")
            else:
                continue
            weights[key] = tensor.float()
            if gemma and key.endswith("norm"):
                weights[key] = weights[key] + 1.0  # Gemma's RMSNorm scales by (1 + weight), as GGUF stores it
    if config.tie_word_embeddings:
        weights.pop("lm_head", None)
    return config, weights
