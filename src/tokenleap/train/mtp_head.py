"""A trainable MTP layer in MiMo's layout (Xiaomi, 2025; DeepSeek-V3's multi-token prediction,
section 2.2) for any target tokenleap runs: the same math as the runtime in
`tokenleap.heads.mtp` (normed final hidden state and normed next-token embedding, hidden first,
`input_proj` 2H -> H, one pre-norm decoder block of the target's shape, a final norm, the target's
own LM head over the full vocabulary), trained post hoc on the frozen target with training-time
test: step k at index i reads step k-1's (normed) output and the embedding of x_{i+k+1}, sits at
rotary position i+k, and attends to the step-0 keys of positions <= i plus its own chain
(`eagle3_head.ttt_attention`), so chained drafting at inference is what training saw.

Its shape is the runtime's `HeadShape` of the target (`eagle3_head.shape_for_target(config,
vocab_size, ())`: no aux layers, the full vocabulary). `export` writes `model.mtp_layers.0.*` and
a config.json with the target's shape, which `speculative_config={"method": "mtp", "model": DIR}`
loads.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenleap.heads.base import HeadShape, head_rope
from tokenleap.train.eagle3_head import ttt_attention, write_head

_NAMES = (
    "token_layernorm", "hidden_layernorm", "input_proj", "input_layernorm", "self_attn.q_proj", "self_attn.k_proj",
    "self_attn.v_proj", "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "final_layernorm"
)


class TrainableMtp(nn.Module):
    """The MTP layer's parameters (float32) and its TTT forward; the target's embedding and LM
    head are frozen buffers, never saved (the runtime shares them)."""

    embed: torch.Tensor  # buffers (register_buffer), typed for nn.Module's attribute access
    lm_head: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        shape: HeadShape,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        final_logit_softcap: float | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.shape = s = shape
        h = s.hidden_size
        g = torch.Generator().manual_seed(seed)

        def lin(out_f: int, in_f: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(out_f, in_f, generator=g) * 0.02)

        self.params = nn.ParameterDict(
            {
                "token_layernorm": nn.Parameter(torch.ones(h)), "hidden_layernorm": nn.Parameter(torch.ones(h)),
                "input_proj": lin(h, 2 * h), "input_layernorm": nn.Parameter(torch.ones(h)),
                "self_attn_q_proj": lin(s.num_heads * s.head_dim, h),
                "self_attn_k_proj": lin(s.num_kv_heads * s.head_dim, h),
                "self_attn_v_proj": lin(s.num_kv_heads * s.head_dim, h),
                "self_attn_o_proj": lin(h, s.num_heads * s.head_dim),
                "post_attention_layernorm": nn.Parameter(torch.ones(h)), "mlp_gate_proj": lin(s.intermediate_size, h),
                "mlp_up_proj": lin(s.intermediate_size, h), "mlp_down_proj": lin(h, s.intermediate_size),
                "final_layernorm": nn.Parameter(torch.ones(h))
            }
        )
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)
        self.softcap = final_logit_softcap
        cos, sin = head_rope(s.rope_theta, s.head_dim, s.max_position + 64)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "_")]

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self._p(name), self.shape.rms_norm_eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions][None, :, None], self.sin[positions][None, :, None]
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def ttt_logits(self, hidden: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Full-vocabulary logits [B, T, V] of each TTT step: `hidden` [B, T, H] the target's
        final normed hidden states, `ids` [B, T] the tokens; step k's row i predicts x_{i+k+2}."""
        s = self.shape
        b, t, _ = hidden.shape
        nh, kvh, hd = s.num_heads, s.num_kv_heads, s.head_dim
        pad = torch.zeros(b, steps + 1, dtype=ids.dtype, device=ids.device)
        ids_ext = torch.cat([ids, pad], dim=1)
        causal = torch.ones(t, t, dtype=torch.bool, device=hidden.device).tril()
        scale = 1.0 / math.sqrt(hd)
        feat = hidden.float()
        k0 = v0 = None
        own_k: list[torch.Tensor] = []
        own_v: list[torch.Tensor] = []
        outs = []
        for k in range(steps):
            e = F.embedding(ids_ext[:, k + 1 : k + 1 + t], self.embed).float()
            x = F.linear(
                torch.cat([self._rms(feat, "hidden_layernorm"), self._rms(e, "token_layernorm")], dim=-1),
                self._p("input_proj"),
            )
            xn = self._rms(x, "input_layernorm")
            pos = torch.arange(k, k + t, device=hidden.device)
            q = self._rope(F.linear(xn, self._p("self_attn.q_proj")).view(b, t, nh, hd), pos)
            kk = self._rope(F.linear(xn, self._p("self_attn.k_proj")).view(b, t, kvh, hd), pos)
            vv = F.linear(xn, self._p("self_attn.v_proj")).view(b, t, kvh, hd)
            if k == 0:
                k0, v0 = kk, vv
            else:
                own_k.append(kk)
                own_v.append(vv)
            assert k0 is not None and v0 is not None
            hcur = x + F.linear(ttt_attention(q, k0, v0, own_k, own_v, causal, scale), self._p("self_attn.o_proj"))
            m = self._rms(hcur, "post_attention_layernorm")
            hcur = hcur + F.linear(F.silu(F.linear(m, self._p("mlp.gate_proj"))) * F.linear(m, self._p("mlp.up_proj")),
                                   self._p("mlp.down_proj"))
            out = self._rms(hcur, "final_layernorm")
            w = self.lm_head if torch.is_autocast_enabled("cpu") else self.lm_head.to(out.dtype)
            logits = F.linear(out, w)
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            outs.append(logits)
            feat = out
        return outs

    def export(self, folder: Path, extra: dict[str, Any] | None = None) -> Path:
        """config.json (the target's shape) + model.safetensors with `model.mtp_layers.0.*`."""
        s = self.shape
        tensors = {}
        for name in _NAMES:
            t = self._p(name).detach()
            norm = name.endswith("layernorm")
            tensors[f"model.mtp_layers.0.{name}.weight"] = (t.float() if norm else t.to(torch.bfloat16)).contiguous()
        config: dict[str, Any] = {
            "architectures": ["MiMoForCausalLM"],
            "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size,
            "num_attention_heads": s.num_heads,
            "num_key_value_heads": s.num_kv_heads,
            "head_dim": s.head_dim,
            "vocab_size": s.vocab_size,
            "rms_norm_eps": s.rms_norm_eps,
            "rope_theta": s.rope_theta,
            "max_position_embeddings": s.max_position,
            "num_nextn_predict_layers": 1,
            "torch_dtype": "bfloat16",
        }
        if extra:
            config["tokenleap_training"] = extra
        return write_head(folder, tensors, config)
