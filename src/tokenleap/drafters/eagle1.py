"""EAGLE-1 / EAGLE-2 draft heads (Li et al., 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty"; EAGLE-2 uses the same weights with dynamic trees).

The head regresses the target's top feature: at position i it fuses the embedding of x_{i+1}
with f_i, the target's final hidden state (after its final norm), `x = fc(cat(embed, f))` (with
a bias unless the checkpoint has none), runs one Llama decoder layer *without* an input norm,
and the target's own LM head reads its output directly (no final norm) over the full
vocabulary; that output is the next draft step's feature. Layout (`yuhuili/EAGLE-*`): `fc.weight`
[H, 2H], `fc.bias`, `layers.0.self_attn.{q,k,v,o}_proj.weight` (Qwen2 heads: q/k/v biases),
`layers.0.post_attention_layernorm.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`, a
LlamaConfig with `num_hidden_layers: 1`. It plugs into `Eagle3Drafter` (same runtime: own KV
cache, rebuilt from true features, chains or trees); the engine hands it the target's final
hidden states (layer id -1 in `hidden_layers`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tokenleap.drafters.eagle3 import Eagle3Config, HeadKV, head_linear, head_rope
from tokenleap.errors import TokenleapError

FINAL_HIDDEN = -1  # `hidden_layers` id of the target's final (normed) hidden state


def is_eagle1_layout(weights: dict[str, torch.Tensor], hidden_size: int) -> bool:
    """An EAGLE-1/2 head: `fc` over [embedding, feature] (2H inputs) and no `hidden_norm`."""
    fc = weights.get("fc.weight")
    has_hidden_norm = any(k.endswith("hidden_norm.weight") for k in weights)
    return fc is not None and fc.dim() == 2 and fc.shape[1] == 2 * hidden_size and not has_hidden_norm


class Eagle1Head:
    """The EAGLE-1/2 head's weights and forward; the interface `Eagle3Drafter` drives."""

    def __init__(self, raw: dict[str, Any], weights: dict[str, torch.Tensor], target: Any) -> None:
        tc = target.config
        try:
            h = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            self.config = Eagle3Config(
                hidden_size=h,
                intermediate_size=int(raw["intermediate_size"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads", heads)),
                head_dim=int(raw.get("head_dim") or h // heads),
                vocab_size=int(raw.get("vocab_size", tc.vocab_size)),
                draft_vocab_size=tc.vocab_size,
                target_hidden_size=h,
                aux_layers=(),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                max_position=int(raw.get("max_position_embeddings", tc.max_position)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TokenleapError(f"EAGLE head config.json is missing or has a bad field: {exc}") from exc
        c = self.config
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
                raise TokenleapError(f"EAGLE-1/2 tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")
        self.target = target
        self.kernels = target.kernels
        dtype = target.dtype
        emb = weights.get("embed_tokens.weight")
        self.embed = emb.to(dtype).contiguous() if emb is not None and tuple(emb.shape) == (c.vocab_size, h) else target.embed

        def lin(*names: str) -> Any:
            return head_linear(weights, names, dtype, self.kernels)

        def bias(*names: str) -> torch.Tensor | None:
            if not any(n in weights for n in names):
                return None
            return torch.cat([weights[n].float() if n in weights else torch.zeros(weights[n.replace("bias", "weight")].shape[0])
                              for n in names]).contiguous()

        self.fc, self.fc_bias = lin("fc.weight"), bias("fc.bias")
        self.wqkv = lin(*(f"{p}self_attn.{n}_proj.weight" for n in "qkv"))
        self.bqkv = bias(*(f"{p}self_attn.{n}_proj.bias" for n in "qkv"))
        self.wo = lin(p + "self_attn.o_proj.weight")
        self.post_norm = weights[p + "post_attention_layernorm.weight"].float().contiguous()
        self.w_gate_up = lin(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        self.w_down = lin(p + "mlp.down_proj.weight")
        self._cos, self._sin = head_rope(c.rope_theta, c.head_dim, max(c.max_position, tc.max_position) + 64)
        self.d2t_list: list[int] = list(range(c.vocab_size))
        self.hidden_layers = (FINAL_HIDDEN,)

    def _linear(self, x: torch.Tensor, w: Any, b: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.linear(x.contiguous(), w, b)
        y = F.linear(x.to(w.dtype), w).float()
        return y + b if b is not None else y

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if int(positions.max()) >= self._cos.shape[0]:
            raise TokenleapError(f"EAGLE head positions must be below {self._cos.shape[0]}")
        cos, sin = self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def embed_tokens(self, ids: Sequence[int]) -> torch.Tensor:
        return F.embedding(torch.tensor(list(ids), dtype=torch.long), self.embed).float()

    def aux_from(self, token_ids: Sequence[int], hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        return hidden[FINAL_HIDDEN].float()

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return aux  # the feature is the target's final hidden state itself

    def layer(self, g: torch.Tensor, e: torch.Tensor, positions: torch.Tensor, kv: HeadKV, visible: torch.Tensor) -> torch.Tensor:
        c = self.config
        x = self._linear(torch.cat([e, g], dim=-1), self.fc, self.fc_bias)
        h = x + self._attention(x, positions, kv, visible)  # no input norm in layer 0
        gate, up = self._linear(F.rms_norm(h, (h.shape[-1],), self.post_norm, c.rms_norm_eps), self.w_gate_up).chunk(2, dim=-1)
        return h + self._linear(F.silu(gate) * up, self.w_down)

    def _attention(self, x: torch.Tensor, positions: torch.Tensor, kv: HeadKV, visible: torch.Tensor) -> torch.Tensor:
        """Self-attention of the rows `x` over the head's cache (their K/V appended; `visible`
        [n, kv.length + n] the slots each row sees), through o_proj."""
        c = self.config
        n = x.shape[0]
        qkv = self._linear(x, self.wqkv, self.bqkv)
        qs, ks = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = self._rope(qkv[:, :qs].view(n, c.num_heads, c.head_dim), positions)
        k = self._rope(qkv[:, qs : qs + ks].view(n, c.num_kv_heads, c.head_dim), positions)
        kv.append(k, qkv[:, qs + ks :].view(n, c.num_kv_heads, c.head_dim))
        keys, values = kv.view()
        kvh, rep, hd = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
        qg = q.view(n, kvh, rep, hd).permute(1, 0, 2, 3).reshape(kvh, n * rep, hd)
        scores = torch.matmul(qg, keys.permute(1, 2, 0)) * (1.0 / math.sqrt(hd))
        mask = visible.unsqueeze(1).expand(n, rep, visible.shape[-1]).reshape(n * rep, -1)
        a = torch.matmul(scores.masked_fill(~mask, float("-inf")).softmax(dim=-1), values.transpose(0, 1))
        a = a.view(kvh, n, rep, hd).permute(1, 0, 2, 3).reshape(n, qs)
        return self._linear(a, self.wo)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The target's LM head on the head's output (no final norm), full vocabulary."""
        return self.target.compute_logits(h)
