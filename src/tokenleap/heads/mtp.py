"""Native multi-token-prediction (MTP) layers as draft heads: MiMo's (Xiaomi, 2025, "MiMo:
Unlocking the Reasoning Potential of Language Model", after DeepSeek-V3's MTP, 2024, section 2.2).

A checkpoint trained with MTP carries, beside its decoder layers, a layer that predicts one token
further: at position i it takes the target's final hidden state h_i (after the final norm, as the
LM head reads it) and the embedding of x_{i+1}, normalises each (`hidden_layernorm`,
`token_layernorm`), concatenates them hidden first (MiMo; DeepSeek puts the embedding first),
projects 2H -> H (`input_proj`), runs one decoder block of the target's own kind (Qwen2: pre-norm
attention with q/k/v biases, SwiGLU MLP), normalises (`final_layernorm`) and reads the target's LM
head for x_{i+2}. Chained drafts feed that normalised output back as the next feature, as vLLM
does with one MTP layer and several speculative tokens. It is a `DraftHead`
(`base.FinalHiddenHead`: the target's final hidden state in, the target's LM head out), run by
`drafters/head_drafter.HeadDrafter` like the EAGLE heads (own KV cache rebuilt from the target's
true features, chains or trees).

Layout: `model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, input_layernorm,
self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj, final_layernorm}`
in the target's own safetensors (or a folder holding them), config.json the target's (Qwen2).
DeepSeek-V3 / GLM (`model.layers.{N}.{enorm,hnorm,eh_proj,shared_head}`) and Qwen3-Next
(`mtp.*`) layers are recognised and refused with their reason: their blocks are MLA / MoE /
gated-attention layers this runtime does not have.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tokenleap.errors import TokenleapError
from tokenleap.heads.base import FinalHiddenHead, HeadKV, final_hidden_shape, head_linear
from tokenleap.kernels import Linear
from tokenleap.models.base import CausalLM

MIMO_PREFIX = "model.mtp_layers."
_PARTS = (
    "token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "input_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "final_layernorm.weight",
)


def read_mtp_layer(folder: str | Path, layer: int = 0) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and MTP layer `layer`'s tensors (prefix stripped) of a checkpoint folder,
    reading only those tensors; clear errors for a folder without MTP layers or with a kind
    this runtime cannot run."""
    from safetensors import safe_open

    root = Path(folder).expanduser()
    cfg_file = root / "config.json"
    if not root.is_dir() or not cfg_file.is_file():
        raise TokenleapError(f"MTP layers: {str(folder)!r} is not a model folder with a config.json")
    raw = json.loads(cfg_file.read_text())
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise TokenleapError(f"MTP layers: {root} has no *.safetensors")
    prefix = f"{MIMO_PREFIX}{layer}."
    weights: dict[str, torch.Tensor] = {}
    names: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                names.append(key)
                if key.startswith(prefix):
                    weights[key[len(prefix):]] = st.get_tensor(key)
    if not weights:
        n_layers = int(raw.get("num_hidden_layers", 0) or 0)
        deepseek = [k for k in names if re.match(r"model\.layers\.(\d+)\.(eh_proj|enorm|hnorm)\.", k)]
        if deepseek or raw.get("num_nextn_predict_layers"):
            raise TokenleapError(
                f"{root}: DeepSeek-V3 / GLM MTP layers (model.layers.{n_layers}.eh_proj ...) wrap an MLA / MoE decoder "
                "block, which tokenleap's runtime does not run; MiMo's (model.mtp_layers.*, Qwen2 blocks) are supported"
            )
        if any(k.startswith("mtp.") for k in names):
            raise TokenleapError(
                f"{root}: Qwen3-Next MTP layers (mtp.*) use gated attention and MoE blocks, which tokenleap's "
                "runtime does not run; MiMo's (model.mtp_layers.*) are supported"
            )
        raise TokenleapError(f"{root} holds no MTP layer {layer} ({prefix}*)")
    return raw, weights


class MtpHead(FinalHiddenHead):
    """One MiMo MTP layer over the target: a `DraftHead`."""

    kind = "MTP"

    def __init__(self, raw: dict[str, Any], weights: dict[str, torch.Tensor], target: CausalLM) -> None:
        tc = target.config
        c = final_hidden_shape(raw, tc, "MTP layer", rms_norm_eps=1e-6)
        h = c.hidden_size
        if h != tc.hidden_size or c.vocab_size != tc.vocab_size:
            raise TokenleapError(f"MTP layer (hidden {h}, vocabulary {c.vocab_size}) does not fit the target "
                                 f"(hidden {tc.hidden_size}, vocabulary {tc.vocab_size})")
        qs, ks = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes = {
            "input_proj.weight": (h, 2 * h), "self_attn.q_proj.weight": (qs, h), "self_attn.k_proj.weight": (ks, h),
            "self_attn.v_proj.weight": (ks, h), "self_attn.o_proj.weight": (h, qs),
            "mlp.gate_proj.weight": (c.intermediate_size, h), "mlp.up_proj.weight": (c.intermediate_size, h),
            "mlp.down_proj.weight": (h, c.intermediate_size)
        }
        for name in _PARTS:
            if name not in weights:
                raise TokenleapError(f"MTP layer lacks tensor {name!r}")
            want = shapes.get(name, (h,))
            if tuple(weights[name].shape) != want:
                raise TokenleapError(f"MTP tensor {name!r} has shape {tuple(weights[name].shape)}, expected {want}")
        super().__init__(c, target)  # the target's embedding: shared, not copied
        dtype = target.dtype

        def lin(*names: str) -> Linear:
            return head_linear(weights, names, dtype, self.kernels)

        def norm(name: str) -> torch.Tensor:
            return weights[name].float().contiguous()

        biases = [f"self_attn.{n}_proj.bias" for n in "qkv"]
        self.bqkv = (
            torch.cat([weights[b].float() for b in biases]).contiguous() if all(b in weights for b in biases) else None
        )
        self.token_norm, self.hidden_norm = norm("token_layernorm.weight"), norm("hidden_layernorm.weight")
        self.in_norm, self.post_norm, self.final_norm = (
            norm("input_layernorm.weight"),
            norm("post_attention_layernorm.weight"),
            norm("final_layernorm.weight"),
        )
        self.input_proj = lin("input_proj.weight")
        self.wqkv = lin(*(f"self_attn.{n}_proj.weight" for n in "qkv"))
        self.wo = lin("self_attn.o_proj.weight")
        self.w_gate_up = lin("mlp.gate_proj.weight", "mlp.up_proj.weight")
        self.w_down = lin("mlp.down_proj.weight")

    def layer(
        self, g: torch.Tensor, e: torch.Tensor, positions: torch.Tensor, kv: HeadKV, visible: torch.Tensor
    ) -> torch.Tensor:
        """Features g (the target's normed final hidden states, or this layer's own output) and
        embeddings e of the next tokens -> the layer's normed output (the next feature)."""
        x = self._linear(
            torch.cat([self._rms(g, self.hidden_norm), self._rms(e, self.token_norm)], dim=-1), self.input_proj
        )
        h = x + self._attention(self._rms(x, self.in_norm), positions, kv, visible)
        gate, up = self._linear(self._rms(h, self.post_norm), self.w_gate_up).chunk(2, dim=-1)
        return self._rms(h + self._linear(F.silu(gate) * up, self.w_down), self.final_norm)


def load_mtp(folder: str | Path, target: CausalLM, layer: int = 0) -> MtpHead:
    raw, weights = read_mtp_layer(folder, layer)
    return MtpHead(raw, weights, target)
