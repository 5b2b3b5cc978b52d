"""The Llama family's decoder block, written once in Python, and its rotary tables.

`decoder_layer` is the block of every architecture `models.config` describes (Touvron et al.,
2023, and its descendants): pre-RMSNorm, fused Q/K/V (with Qwen2's biases), QK-norm (Qwen3,
Gemma 3) and a query scale (Gemma 3), rotary embeddings + grouped-query attention, the output
linear, post-norms (Gemma 3), a SwiGLU or GeGLU MLP, residual adds. What a forward runs each piece
on is its `BlockOps`: the runtime's kernels per call, torch ops over the rows of one or several
sequences (`models.llama`), or torch over padded batches on any device (`train.torch_target`).
The activations between the pieces are float32 everywhere.

Written elsewhere, on purpose: the fused C path (`kernels/forward.h`: all layers in one call, and
its per-call reference loop in `LlamaModel._forward_fused`), whose bits are those of the
kernels' own fused epilogues (residual adds inside the linears), and the draft heads' layers
(`heads/`), whose inputs and residuals differ (fused features, one layer over their own cache).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenleap.kernels import Linear
from tokenleap.models.config import ModelConfig, RopeScaling


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights: norms in float32, the four (fused) linears each one `Linear`
    (dense in the model dtype, packed bf16 or GGUF blocks: as the forwards read them). It is the
    fused path's layer as it is (`kernels.fused.FusedLayer`)."""

    attn_norm: torch.Tensor  # [D]
    wqkv: Linear  # [Q + 2KV, D]
    bqkv: torch.Tensor | None  # [Q + 2KV]
    wo: Linear  # [D, Q]
    mlp_norm: torch.Tensor  # [D]
    w_gate_up: Linear  # [2F, D]
    w_down: Linear  # [D, F]
    q_norm: torch.Tensor | None = None  # [hd] QK-norm (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # [D] Gemma 3 post-norms
    post_mlp_norm: torch.Tensor | None = None

    def linears(self) -> tuple[Linear, Linear, Linear, Linear]:
        """The four weight matrices, in the order a forward reads them."""
        return self.wqkv, self.wo, self.w_gate_up, self.w_down


@dataclass(frozen=True)
class BlockOps:
    """What one forward runs the pieces of `decoder_layer` on. Each takes and returns float32."""

    # (x [.., in], weight, pre-norm weight or None) -> x @ W.T [.., out]
    linear: Callable[[torch.Tensor, Linear, torch.Tensor | None], torch.Tensor]
    # (qkv, layer) -> qkv with QK-norm and the query scale applied (in place or not)
    qk_norm: Callable[[torch.Tensor, LayerWeights], torch.Tensor]
    # (qkv, layer index) -> attention output [.., Q]: rotary embedding, K/V write, attention
    attention: Callable[[torch.Tensor, int], torch.Tensor]
    # (x, sublayer output, post-norm weight or None) -> the residual stream after the sublayer
    residual: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    # (gate | up, w_down) -> act(gate) * up @ w_down.T in one piece (the kernels' gated linear);
    # None: the gate in torch, then `linear`
    gated_down: Callable[[torch.Tensor, Linear], torch.Tensor] | None = None


def decoder_layer(x: torch.Tensor, layer: LayerWeights, idx: int, config: ModelConfig, ops: BlockOps) -> torch.Tensor:
    """One decoder layer of the Llama family over the residual stream `x` [.., D] (float32)."""
    qkv = ops.linear(x, layer.wqkv, layer.attn_norm)
    if layer.bqkv is not None:
        qkv = qkv + layer.bqkv
    qkv = ops.qk_norm(qkv, layer)
    a = ops.attention(qkv, idx)
    x = ops.residual(x, ops.linear(a, layer.wo, None), layer.post_attn_norm)
    gate_up = ops.linear(x, layer.w_gate_up, layer.mlp_norm)
    if ops.gated_down is not None:
        return ops.residual(x, ops.gated_down(gate_up, layer.w_down), layer.post_mlp_norm)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if config.activation == "gelu_tanh" else F.silu(gate)
    return ops.residual(x, ops.linear(act * up, layer.w_down, None), layer.post_mlp_norm)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, in float32."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps)


def torch_linear(
    x: torch.Tensor, w: Linear | torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:
    """float32 `[.., in]` (RMSNorm-ed first with `norm`) -> float32 `x @ w.T` in `w`'s dtype (a
    `Linear`'s dense weight)."""
    if isinstance(w, Linear):
        w = w.dense()
    if norm is not None:
        x = rms_norm(x, norm, eps)
    return F.linear(x.to(w.dtype), w).float()


def torch_qk_norm(qkv: torch.Tensor, layer: LayerWeights, config: ModelConfig) -> torch.Tensor:
    """QK-norm (RMSNorm over each head of Q and K) and the query scale, in place on float32 `qkv`."""
    c = config
    nq, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
    q_end, k_end = c.q_size, c.q_size + c.kv_size
    lead = qkv.shape[:-1]
    if layer.q_norm is not None:
        qkv[..., :q_end] = rms_norm(qkv[..., :q_end].view(*lead, nq, hd), layer.q_norm, c.rms_norm_eps).view(*lead, -1)
        qkv[..., q_end:k_end] = (
            rms_norm(qkv[..., q_end:k_end].view(*lead, nkv, hd), layer.k_norm, c.rms_norm_eps).view(*lead, -1)
        )
    q_mult = query_multiplier(c)
    if q_mult is not None:
        qkv[..., :q_end] *= q_mult
    return qkv


def query_multiplier(config: ModelConfig) -> float | None:
    """The factor on the queries that turns attention's head_dim ** -0.5 into the model's own
    scale (Gemma 3's `query_pre_attn_scalar`), or None."""
    return config.query_scale * config.head_dim**0.5 if config.query_scale is not None else None


def torch_residual(x: torch.Tensor, y: torch.Tensor, norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`x + y`, `y` RMSNorm-ed first when the architecture has post-norms."""
    return x + y if norm is None else x + rms_norm(y, norm, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (half-split "NeoX" layout) of `x` [.., hd], `cos` / `sin` broadcast to it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def rope_tables(
    config: ModelConfig, theta: float, positions: int, *, scaled: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[positions, head_dim]` (half-split layout) as transformers computes them:
    float32 `inv_freq = 1 / theta ** (2i / d)`, scaled per Llama 3.x (`rope_scaling`), divided
    by GGUF's `rope_freqs` and by a linear scaling factor when `scaled`, angles = float32
    position * inv_freq."""
    hd = config.head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if scaled and config.rope_scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, config.rope_scaling)
    if scaled and config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    if scaled and config.rope_linear_factor != 1.0:
        inv_freq = inv_freq / config.rope_linear_factor
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().contiguous(), emb.sin().contiguous()


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.x rope scaling (transformers' `_compute_llama3_parameters`): long wavelengths
    divided by `factor`, short ones kept, a smooth blend between."""
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
