"""A trainable EAGLE-3 head (Li et al., 2025) with training-time test (TTT): the same math as the
runtime in `tokenleap.heads.eagle3` (one Llama decoder layer over the fused aux features and the
normed token embedding, draft LM head over the reduced vocabulary), as a `torch.nn.Module`.

Training-time test unrolls the draft `steps` times over a whole sequence at once. Step 0 at index i
reads the fused target feature of position i and the embedding of x_{i+1} and predicts x_{i+2};
step k reads step k-1's output at index i (its own feature, as at inference) and the embedding of
x_{i+k+1}, sits at rotary position i+k, and attends to the step-0 keys of positions <= i (the
request's true head cache at inference) plus its own keys of steps 1..k at index i (the draft
chain so far). The loss is the cross-entropy against the target's distribution over the draft
vocabulary at row i+k+1, on assistant tokens whose target argmax the draft vocabulary holds,
weighted by decay^k (EAGLE-3 / SpecForge's recipe).

`export` writes the EAGLE / SpecForge layout (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`,
`t2d`, config with `draft_vocab_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`) that
`tokenleap --spec-type eagle3 --model-draft DIR`, vLLM and SGLang load.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenleap.errors import TokenleapError
from tokenleap.heads.base import HeadShape, head_rope
from tokenleap.heads.eagle3 import Eagle3Head
from tokenleap.heads.loader import load_eagle3
from tokenleap.models.base import CausalLM


def shape_for_target(target_config: Any, draft_vocab_size: int, aux_layers: Sequence[int],
                     norm_before_residual: bool = True) -> HeadShape:
    """The head's shape for a target: its hidden size, heads and MLP width, over the target's
    vocabulary. `norm_before_residual` (SpecForge's option) makes the layer's residual the normed
    feature: without it the raw fused feature carries the target's massive activations (rms ~170,
    peaks ~25000 on SmolLM2's middle layers) past the layer, drowning what attention and the MLP add."""
    c = target_config
    return HeadShape(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_heads=c.num_heads,
                     num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
                     draft_vocab_size=draft_vocab_size, target_hidden_size=c.hidden_size,
                     aux_layers=tuple(int(a) for a in aux_layers), rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                     max_position=c.max_position, norm_before_residual=norm_before_residual)


def write_head(folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """config.json + model.safetensors, each replaced atomically (a reader never sees half a head)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}  # a head trained on a GPU
    tmp_w, tmp_c = folder / "model.safetensors.tmp", folder / "config.json.tmp"
    save_file(tensors, str(tmp_w))
    tmp_c.write_text(json.dumps(config, indent=2))
    tmp_w.replace(folder / "model.safetensors")
    tmp_c.replace(folder / "config.json")
    return folder


def ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    own_k: Sequence[torch.Tensor],
    own_v: Sequence[torch.Tensor],
    causal: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Training-time-test attention of one draft step: queries q [B, T, nh, hd] (rotated) over
    the step-0 keys k0 / v0 [B, T, kvh, hd] of positions <= i (causal [T, T]) and over index i's
    own keys of steps 1..k (`own_k` / `own_v`, the draft chain so far). Returns [B, T, nh * hd]."""
    b, t, nh, hd = q.shape
    kvh = k0.shape[2]
    qg = q.view(b, t, kvh, nh // kvh, hd)
    s0 = torch.einsum("btgrd,bsgd->bgrts", qg, k0) * scale  # [B, kvh, rep, T, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [torch.einsum("btgrd,btgd->bgrt", qg, kj).unsqueeze(-1) * scale for kj in own_k]  # [B, kvh, rep, T, 1]
    probs = torch.cat([s0, *diag], dim=-1).softmax(dim=-1)
    a = torch.einsum("bgrts,bsgd->btgrd", probs[..., :t], v0)
    for j, vj in enumerate(own_v):
        a = a + probs[..., t + j].permute(0, 3, 1, 2).unsqueeze(-1) * vj.unsqueeze(3)
    return a.reshape(b, t, nh * hd)


class TrainableEagle3(nn.Module):
    """The head's parameters (float32) and its TTT forward. The token embedding is the target's,
    frozen and never saved (the runtime shares it)."""

    embed: torch.Tensor  # buffers (register_buffer), typed for nn.Module's attribute access
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, shape: HeadShape, embed: torch.Tensor, init_lm_head: torch.Tensor | None = None,
                 init_norm: torch.Tensor | None = None, seed: int = 0) -> None:
        super().__init__()
        self.shape = s = shape
        h = s.hidden_size
        g = torch.Generator().manual_seed(seed)

        def lin(out_f: int, in_f: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(out_f, in_f, generator=g) * 0.02)

        self.fc = lin(h, 3 * h)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.q_proj = lin(s.num_heads * s.head_dim, 2 * h)
        self.k_proj = lin(s.num_kv_heads * s.head_dim, 2 * h)
        self.v_proj = lin(s.num_kv_heads * s.head_dim, 2 * h)
        self.o_proj = lin(h, s.num_heads * s.head_dim)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_proj = lin(s.intermediate_size, h)
        self.up_proj = lin(s.intermediate_size, h)
        self.down_proj = lin(h, s.intermediate_size)
        self.norm = nn.Parameter(init_norm.detach().float().clone() if init_norm is not None else torch.ones(h))
        self.lm_head = nn.Parameter(init_lm_head.detach().float().clone() if init_lm_head is not None
                                    else torch.randn(s.draft_vocab_size, h, generator=g) * 0.02)
        self.register_buffer("embed", embed.detach(), persistent=False)
        cos, sin = head_rope(s.rope_theta, s.head_dim, s.max_position + 64)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), w, self.shape.rms_norm_eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, heads, hd] at rotary positions [T]."""
        cos, sin = self.cos[positions][None, :, None], self.sin[positions][None, :, None]
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def ttt_logits(self, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Draft logits [B, T, Vd] of each TTT step for padded sequences: `aux` [B, T, 3H] the
        target's aux states of each position, `ids` [B, T] the tokens. Step k's row i predicts
        x_{i+k+2}; rows past a sequence's end are garbage the loss masks out."""
        s = self.shape
        b, t, _ = aux.shape
        nh, kvh, hd = s.num_heads, s.num_kv_heads, s.head_dim
        feat = F.linear(aux, self.fc)  # [B, T, H]
        pad = torch.zeros(b, steps + 1, dtype=ids.dtype, device=ids.device)
        ids_ext = torch.cat([ids, pad], dim=1)
        causal = torch.ones(t, t, dtype=torch.bool, device=aux.device).tril()
        scale = 1.0 / math.sqrt(hd)
        k0 = v0 = None
        own_k: list[torch.Tensor] = []
        own_v: list[torch.Tensor] = []
        outs = []
        for k in range(steps):
            e = F.embedding(ids_ext[:, k + 1 : k + 1 + t], self.embed).float()
            x = torch.cat([self._rms(e, self.input_layernorm), self._rms(feat, self.hidden_norm)], dim=-1)
            pos = torch.arange(k, k + t, device=aux.device)
            q = self._rope(F.linear(x, self.q_proj).view(b, t, nh, hd), pos)  # [B, T, nh, hd]
            kk = self._rope(F.linear(x, self.k_proj).view(b, t, kvh, hd), pos)
            vv = F.linear(x, self.v_proj).view(b, t, kvh, hd)
            if k == 0:
                k0, v0 = kk, vv
            else:
                own_k.append(kk)
                own_v.append(vv)
            assert k0 is not None and v0 is not None
            a = ttt_attention(q, k0, v0, own_k, own_v, causal, scale)
            residual = self._rms(feat, self.hidden_norm) if s.norm_before_residual else feat
            hcur = residual + F.linear(a, self.o_proj)
            m = self._rms(hcur, self.post_attention_layernorm)
            hcur = hcur + F.linear(F.silu(F.linear(m, self.gate_proj)) * F.linear(m, self.up_proj), self.down_proj)
            outs.append(F.linear(self._rms(hcur, self.norm), self.lm_head))
            feat = hcur
        return outs

    @classmethod
    def from_head(cls, folder: Path, target: CausalLM) -> tuple[TrainableEagle3, torch.Tensor]:
        """A head written by `export` (or any EAGLE-3 layout checkpoint the runtime loads) as a
        trainable module, with its draft-to-target id map."""
        from safetensors.torch import load_file

        rt = load_eagle3(folder, target)  # validates shapes and the layout
        if not isinstance(rt, Eagle3Head):
            raise TokenleapError(f"{folder} holds a {type(rt).__name__}, not an EAGLE-3 head to train on")
        weights: dict[str, torch.Tensor] = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            weights.update(load_file(str(f)))
        head = cls(rt.config, target.embed)
        with torch.no_grad():
            for name, t in head.eagle_tensors().items():
                attr = (
                    name.removeprefix("midlayer.")
                    .removeprefix("self_attn.")
                    .removeprefix("mlp.")
                    .removesuffix(".weight")
                )
                getattr(head, attr).copy_(weights[name].float().view(t.shape))
        return head, rt.d2t_ids

    def eagle_tensors(self) -> dict[str, torch.Tensor]:
        """The weights under the EAGLE / SpecForge names (bf16 linears, float32 norms)."""
        p = "midlayer."

        def w(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(torch.bfloat16).contiguous()

        def n(t: torch.Tensor) -> torch.Tensor:
            return t.detach().float().contiguous()

        return {
            "fc.weight": w(self.fc),
            p + "input_layernorm.weight": n(self.input_layernorm),
            p + "hidden_norm.weight": n(self.hidden_norm),
            p + "self_attn.q_proj.weight": w(self.q_proj),
            p + "self_attn.k_proj.weight": w(self.k_proj),
            p + "self_attn.v_proj.weight": w(self.v_proj),
            p + "self_attn.o_proj.weight": w(self.o_proj),
            p + "post_attention_layernorm.weight": n(self.post_attention_layernorm),
            p + "mlp.gate_proj.weight": w(self.gate_proj),
            p + "mlp.up_proj.weight": w(self.up_proj),
            p + "mlp.down_proj.weight": w(self.down_proj),
            "norm.weight": n(self.norm),
            "lm_head.weight": w(self.lm_head),
        }

    def export(self, folder: Path, d2t: torch.Tensor, t2d: torch.Tensor, extra: dict[str, Any] | None = None) -> Path:
        """Write config.json + model.safetensors in the EAGLE-3 layout."""
        s = self.shape
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size, "num_attention_heads": s.num_heads,
            "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim, "num_hidden_layers": 1,
            "rms_norm_eps": s.rms_norm_eps, "rope_theta": s.rope_theta, "max_position_embeddings": s.max_position,
            "hidden_act": "silu", "vocab_size": s.vocab_size, "draft_vocab_size": s.draft_vocab_size,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "target_hidden_size": s.target_hidden_size,
            "norm_before_residual": s.norm_before_residual,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(s.aux_layers), "use_aux_hidden_state": True},
        }
        if extra:
            config["tokenleap_training"] = extra
        tensors = {
            **self.eagle_tensors(),
            "d2t": d2t.to(torch.int64).contiguous(),
            "t2d": t2d.to(torch.bool).contiguous(),
        }
        return write_head(folder, tensors, config)
