"""EAGLE-3 heads in llama.cpp's GGUF layout (architecture `eagle3`, written by its
`convert_hf_to_gguf.py` from an EAGLE / SpecForge checkpoint): tensors `fc`, `d2t`, `output`,
`output_norm`, optional `token_embd`, and one block `blk.0.{hidden_norm, attn_norm, attn_q, attn_k,
attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}` with Q/K rows permuted for llama.cpp's
interleaved rotary embedding (undone here); metadata `eagle3.embedding_length`,
`eagle3.feed_forward_length`, `eagle3.attention.*`, `eagle3.rope.freq_base`,
`eagle3.context_length`, the aux layer ids under `eagle3.target_layers` (older converters:
`eagle3.extract_layers`), `eagle3.target_hidden_size` and `eagle3.norm_before_residual`.
Weights in any GGUF type the `gguf` package dequantizes load as the head's dtype.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenleap.errors import TokenleapError
from tokenleap.heads.base import HeadShape
from tokenleap.heads.eagle3 import Eagle3Head, default_aux_layers
from tokenleap.models.base import CausalLM
from tokenleap.models.loaders import unpermute_rope

logger = logging.getLogger(__name__)

_NAMES = {
    "fc.weight": "fc.weight",
    "d2t": "d2t",
    "d2t.weight": "d2t",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "norm.weight",
    "token_embd.weight": "embed_tokens.weight",
    "blk.0.hidden_norm.weight": "midlayer.hidden_norm.weight",
    "blk.0.attn_norm.weight": "midlayer.input_layernorm.weight",
    "blk.0.attn_q.weight": "midlayer.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "midlayer.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "midlayer.self_attn.v_proj.weight",
    "blk.0.attn_output.weight": "midlayer.self_attn.o_proj.weight",
    "blk.0.ffn_norm.weight": "midlayer.post_attention_layernorm.weight",
    "blk.0.ffn_gate.weight": "midlayer.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "midlayer.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "midlayer.mlp.down_proj.weight",
}


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (half-split halves -> interleaved pairs)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(v: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999975e-06)."""
    return float(f"{float(v):.7g}")


def load_eagle3_gguf(path: str | Path, target: CausalLM) -> Eagle3Head:
    import gguf

    path = Path(path).expanduser()
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises bare ValueErrors on bad files
        raise TokenleapError(f"{path} is not a readable GGUF file: {exc}") from exc

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "eagle3":
        raise TokenleapError(f"{path} is a GGUF of architecture {arch!r}, not an EAGLE-3 head ('eagle3')")

    def required(key: str) -> Any:
        v = field(f"eagle3.{key}")
        if v is None:
            raise TokenleapError(f"EAGLE-3 GGUF {path.name} lacks metadata eagle3.{key}")
        return v

    hidden, heads = int(required("embedding_length")), int(required("attention.head_count"))
    kv_heads = int(field("eagle3.attention.head_count_kv", heads))
    aux = field("eagle3.target_layers", field("eagle3.extract_layers"))
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _NAMES.get(t.name)
        if name is None:
            logger.debug("ignoring EAGLE-3 GGUF tensor %s", t.name)
            continue
        shape = [int(d) for d in reversed(t.shape.tolist())]
        array: np.ndarray
        if t.tensor_type.name in ("I8", "I16", "I32", "I64"):  # d2t: integer offsets (IQ* names are quant types)
            array = np.array(t.data, dtype=np.int64).reshape(shape)
        else:
            array = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if name.endswith("q_proj.weight"):
            array = unpermute_rope(array, heads)
        elif name.endswith("k_proj.weight"):
            array = unpermute_rope(array, kv_heads)
        weights[name] = torch.from_numpy(np.ascontiguousarray(array))
    if "lm_head.weight" not in weights:
        raise TokenleapError(f"EAGLE-3 GGUF {path.name} lacks tensor output.weight")
    tokens = field("tokenizer.ggml.tokens")
    vocab = int(field("eagle3.vocab_size", len(tokens) if tokens else target.config.vocab_size))
    config = HeadShape(
        hidden_size=hidden,
        intermediate_size=int(required("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(field("eagle3.attention.key_length", hidden // heads)),
        vocab_size=vocab,
        draft_vocab_size=int(weights["lm_head.weight"].shape[0]),
        target_hidden_size=int(field("eagle3.target_hidden_size", hidden)),
        aux_layers=tuple(int(x) for x in aux) if aux is not None else default_aux_layers(target.config.num_layers),
        rms_norm_eps=_f32(field("eagle3.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(field("eagle3.rope.freq_base", 10000.0)),
        max_position=int(field("eagle3.context_length", 8192)),
        norm_before_residual=bool(field("eagle3.norm_before_residual", False)),
    )
    if aux is None:
        logger.warning(
            "EAGLE-3 GGUF %s names no aux layers; using the default (inputs of layers %s)", path.name, config.aux_layers
        )
    head = Eagle3Head(config, weights, target)
    logger.info(
        "EAGLE-3 head %s (llama.cpp GGUF): aux layers %s (inputs of those target layers), draft vocabulary %d of %d",
        path,
        list(config.aux_layers),
        config.draft_vocab_size,
        config.vocab_size,
    )
    return head
