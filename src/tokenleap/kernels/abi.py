"""The kernels' C structs as ctypes mirrors (the C ABI as structs, forward.h).

An entry point that takes many arguments takes one struct instead of a positional list: the
attention (`tl_attention_run`, `tl_attn_desc`) and a forward's decoder layers
(`tl_forward_layers`, `tl_forward_desc`, which embeds the attention's). Field order and types
must match forward.h exactly; tests/kernels/test_abi.py checks sizes and offsets against the
compiled library.
"""

from __future__ import annotations

import ctypes

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_i32 = ctypes.c_int32

LIN_F32, LIN_BF16, LIN_PACKED, LIN_QUANT = 0, 1, 2, 3  # tl_lin_desc.kind (TL_LIN_*)
GLU_SILU, GLU_GELU_TANH = 1, 2  # the MLP's gate (norms.h's TL_GLU_*): tl_forward_desc.glu, tl_linear_q's glu
GLU_KINDS = {"silu": GLU_SILU, "gelu_tanh": GLU_GELU_TANH}  # by `ModelConfig.activation`
ATTN_FP32 = 0  # tl_attn_desc.kv: fp32 caches (tl_attention); 1 + KV_* for blocked ones (tl_attention_bf16)


class LinDesc(ctypes.Structure):
    """tl_lin_desc: one linear's weights (w, bias), width, kind (LIN_*) and block format."""

    _fields_ = [("w", _p), ("bias", _p), ("out_dim", _i64), ("kind", _i32), ("format", _i32)]


class LayerDesc(ctypes.Structure):
    """tl_layer_desc: a decoder layer's four linears, norms, and whether it is a sliding-window layer."""

    _fields_ = [
        ("qkv", LinDesc), ("wo", LinDesc), ("gate_up", LinDesc), ("down", LinDesc), ("attn_norm", _p), ("mlp_norm", _p),
        ("q_norm", _p), ("k_norm", _p), ("post_attn_norm", _p), ("post_mlp_norm", _p), ("local", _i32),
    ]  # fmt: skip


class AttnDesc(ctypes.Structure):
    """tl_attn_desc: one layer's attention over a forward's rows (`CpuKernels.attention_desc`)."""

    _fields_ = [
        ("kv", _i32), ("rows", _i64), ("heads", _i64), ("kv_heads", _i64), ("hd", _i64),
        ("pos", _p), ("cos", _p), ("sin", _p), ("kv_base", _p), ("cap", _p), ("wslot", _p), ("qbuf", _p),
        ("slot_end", _p), ("slot_off", _p), ("slot_idx", _p), ("slot_lo", _p), ("mask_start", _p),
        ("mask", _p), ("mask_w", _i64), ("tail", _p), ("tail_slots", _i64), ("chunk", _p),
        ("scratch", _p), ("max_slots", _i64),
    ]  # fmt: skip


class ForwardDesc(ctypes.Structure):
    """tl_forward_desc: a forward's residual stream, layers, MLP gate, work buffers and attention
    (global and sliding-window layers')."""

    _fields_ = [
        ("x", _p), ("rows", _i64), ("dim", _i64), ("inter", _i64), ("eps", ctypes.c_float),
        ("q_mult", ctypes.c_float), ("glu", _i32),
        ("n_layers", _i64), ("layers", _p), ("hidden_out", _p),
        ("qkv", _p), ("a", _p), ("gu", _p), ("tmp", _p), ("acc", _p), ("scratch", _p),
        ("attn", AttnDesc), ("attn_local", AttnDesc),
    ]  # fmt: skip
