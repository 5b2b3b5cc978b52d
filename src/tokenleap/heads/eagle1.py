"""EAGLE-1 / EAGLE-2 draft heads (Li et al., 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty"; EAGLE-2 uses the same weights with dynamic trees).

The head regresses the target's top feature: at position i it fuses the embedding of x_{i+1}
with f_i, the target's final hidden state (after its final norm), `x = fc(cat(embed, f))` (with
a bias unless the checkpoint has none), runs one Llama decoder layer *without* an input norm,
and the target's own LM head reads its output directly (no final norm) over the full
vocabulary; that output is the next draft step's feature. Layout (`yuhuili/EAGLE-*`): `fc.weight`
[H, 2H], `fc.bias`, `layers.0.self_attn.{q,k,v,o}_proj.weight` (Qwen2 heads: q/k/v biases),
`layers.0.post_attention_layernorm.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`, a
LlamaConfig with `num_hidden_layers: 1`. It is a `DraftHead` (`base.FinalHiddenHead`), run by
`drafters/head_drafter.HeadDrafter` like the others (own KV cache, rebuilt from true features,
chains or trees); the engine hands it the target's final hidden states (`FINAL_HIDDEN` in
`hidden_layers`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tokenleap.errors import TokenleapError
from tokenleap.heads.base import FinalHiddenHead, HeadKV, final_hidden_shape, head_linear
from tokenleap.kernels import Linear
from tokenleap.models.base import CausalLM


def is_eagle1_layout(weights: dict[str, torch.Tensor], hidden_size: int) -> bool:
    """An EAGLE-1/2 head: `fc` over [embedding, feature] (2H inputs) and no `hidden_norm`."""
    fc = weights.get("fc.weight")
    has_hidden_norm = any(k.endswith("hidden_norm.weight") for k in weights)
    return fc is not None and fc.dim() == 2 and fc.shape[1] == 2 * hidden_size and not has_hidden_norm


class Eagle1Head(FinalHiddenHead):
    """The EAGLE-1/2 head's weights and forward: a `DraftHead`."""

    kind = "EAGLE-1/2"

    def __init__(self, raw: dict[str, Any], weights: dict[str, torch.Tensor], target: CausalLM) -> None:
        tc = target.config
        c = final_hidden_shape(raw, tc, "EAGLE head")
        h = c.hidden_size
        if h != tc.hidden_size:
            raise TokenleapError(f"EAGLE-1/2 head hidden size {h} differs from the target's {tc.hidden_size}")
        if c.vocab_size != tc.vocab_size:
            raise TokenleapError(f"EAGLE-1/2 head vocab_size {c.vocab_size} differs from the target's {tc.vocab_size}")
        p = "layers.0."
        qs, ks = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        expect = {
            "fc.weight": (h, 2 * h),
            p + "self_attn.q_proj.weight": (qs, h),
            p + "self_attn.k_proj.weight": (ks, h),
            p + "self_attn.v_proj.weight": (ks, h),
            p + "self_attn.o_proj.weight": (h, qs),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, h),
            p + "mlp.up_proj.weight": (c.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, c.intermediate_size),
        }
        for name, shape in expect.items():
            if name not in weights:
                raise TokenleapError(f"EAGLE-1/2 checkpoint lacks tensor {name!r}")
            if tuple(weights[name].shape) != shape:
                raise TokenleapError(
                    f"EAGLE-1/2 tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape}"
                )
        dtype = target.dtype
        emb = weights.get("embed_tokens.weight")
        super().__init__(
            c, target, emb.to(dtype).contiguous() if emb is not None and tuple(emb.shape) == (c.vocab_size, h) else None
        )

        def lin(*names: str) -> Linear:
            return head_linear(weights, names, dtype, self.kernels)

        def bias(*names: str) -> torch.Tensor | None:
            if not any(n in weights for n in names):
                return None
            return torch.cat(
                [
                    weights[n].float() if n in weights else torch.zeros(weights[n.replace("bias", "weight")].shape[0])
                    for n in names
                ]
            ).contiguous()

        self.fc, self.fc_bias = lin("fc.weight"), bias("fc.bias")
        self.wqkv = lin(*(f"{p}self_attn.{n}_proj.weight" for n in "qkv"))
        self.bqkv = bias(*(f"{p}self_attn.{n}_proj.bias" for n in "qkv"))
        self.wo = lin(p + "self_attn.o_proj.weight")
        self.post_norm = weights[p + "post_attention_layernorm.weight"].float().contiguous()
        self.w_gate_up = lin(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        self.w_down = lin(p + "mlp.down_proj.weight")

    def layer(
        self, g: torch.Tensor, e: torch.Tensor, positions: torch.Tensor, kv: HeadKV, visible: torch.Tensor
    ) -> torch.Tensor:
        x = self._linear(torch.cat([e, g], dim=-1), self.fc, self.fc_bias)
        h = x + self._attention(x, positions, kv, visible)  # no input norm in layer 0
        gate, up = self._linear(self._rms(h, self.post_norm), self.w_gate_up).chunk(2, dim=-1)
        return h + self._linear(F.silu(gate) * up, self.w_down)
