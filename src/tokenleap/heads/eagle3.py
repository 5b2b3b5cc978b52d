"""EAGLE-3 draft heads (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test").

The head is one Llama decoder layer over the target's own features. At position i it fuses the
target's residual stream entering three layers (`fc`), concatenates the normed token embedding
of x_{i+1} (the target's embedding table, shared) with the normed feature, attends causally over
its own KV cache and predicts x_{i+2} over a reduced draft vocabulary (`lm_head`), mapped back to
target ids by the `d2t` offsets. Later draft steps feed the head's own output (pre-norm) as the
feature. It reads `hidden_layers`, the outputs of layers l-1 = the inputs of the aux layers l;
`drafters/head_drafter.py` runs it (chains or EAGLE-2 trees).

Checkpoints: the EAGLE / SpecForge layout (`midlayer.*`, `fc`, `d2t`, `t2d`, config with
`draft_vocab_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`), vLLM speculators'
`Eagle3Speculator` (`transformer_layer_config`, top-level aux ids, `layers.0.*` names), and
llama.cpp's `eagle3` GGUF (`eagle3_gguf.py`); `loader.py` tells them apart.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tokenleap.errors import TokenleapError
from tokenleap.heads.base import HeadKV, HeadShape, LayerHead, head_linear
from tokenleap.kernels import Linear
from tokenleap.models.base import CausalLM

logger = logging.getLogger(__name__)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The reference choice: the inputs of layers 2, N//2 and N-3."""
    return (2, num_layers // 2, num_layers - 3)


def read_config(raw: dict[str, Any], target_layers: int) -> tuple[HeadShape, str]:
    """Parse an EAGLE/SpecForge or speculators config.json; returns the config and the dialect."""
    if "transformer_layer_config" in raw or raw.get("speculators_model_type") == "eagle3":
        layer = dict(raw.get("transformer_layer_config") or {})
        dialect = "speculators"
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
        draft_vocab = raw.get("draft_vocab_size", layer.get("vocab_size"))
        nbr = bool(raw.get("norm_before_residual", False))
        target_h = raw.get("target_hidden_size")
    else:
        layer = raw
        dialect = "eagle"
        aux = (raw.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids")
        )
        draft_vocab = raw.get("draft_vocab_size", raw.get("vocab_size"))
        nbr = bool(raw.get("norm_before_residual", False))
        target_h = raw.get("target_hidden_size")
    try:
        h = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        cfg = HeadShape(
            hidden_size=h,
            intermediate_size=int(layer["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(layer.get("num_key_value_heads", heads)),
            head_dim=int(layer.get("head_dim") or h // heads),
            vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(draft_vocab if draft_vocab is not None else layer["vocab_size"]),
            target_hidden_size=int(target_h or h),
            aux_layers=tuple(int(x) for x in aux) if aux is not None else default_aux_layers(target_layers),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-5)),
            rope_theta=float(layer.get("rope_theta", 10000.0)),
            max_position=int(layer.get("max_position_embeddings", 8192)),
            norm_before_residual=nbr,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TokenleapError(f"EAGLE-3 config.json is missing or has a bad field: {exc}") from exc
    if aux is None:
        logger.warning("EAGLE-3 head names no aux layers; using the default (inputs of layers %s)", cfg.aux_layers)
    return cfg, dialect


class Eagle3Head(LayerHead):
    """The head's weights and forward (torch, or the target's bf16 kernels for the linears): a `DraftHead`."""

    kind = "EAGLE-3"

    def __init__(self, config: HeadShape, weights: dict[str, torch.Tensor], target: CausalLM) -> None:
        c = config
        dtype = target.dtype
        h, ht = c.hidden_size, c.target_hidden_size
        tc = target.config
        if c.num_heads % c.num_kv_heads or c.head_dim % 2:
            raise TokenleapError(
                f"EAGLE-3 head needs num_attention_heads ({c.num_heads}) a multiple of num_key_value_heads "
                f"({c.num_kv_heads}) and an even head_dim ({c.head_dim})"
            )
        if ht != tc.hidden_size:
            raise TokenleapError(f"EAGLE-3 head expects target hidden size {ht} but the target's is {tc.hidden_size}")
        if c.vocab_size != tc.vocab_size:
            raise TokenleapError(f"EAGLE-3 head vocab_size {c.vocab_size} differs from the target's {tc.vocab_size}")
        bad = [layer for layer in c.aux_layers if not 0 <= layer < tc.num_layers]
        if len(c.aux_layers) != 3 or bad:
            raise TokenleapError(
                f"EAGLE-3 aux layer ids {list(c.aux_layers)} do not fit the target: need 3 ids in [0, {tc.num_layers})"
            )
        expect = {
            "fc.weight": (h, 3 * ht),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (c.num_heads * c.head_dim, 2 * h),
            "midlayer.self_attn.k_proj.weight": (c.num_kv_heads * c.head_dim, 2 * h),
            "midlayer.self_attn.v_proj.weight": (c.num_kv_heads * c.head_dim, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, c.num_heads * c.head_dim),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.mlp.gate_proj.weight": (c.intermediate_size, h),
            "midlayer.mlp.up_proj.weight": (c.intermediate_size, h),
            "midlayer.mlp.down_proj.weight": (h, c.intermediate_size),
            "norm.weight": (h,),
            "lm_head.weight": (c.draft_vocab_size, h),
        }
        for name, shape in expect.items():
            if name not in weights:
                raise TokenleapError(f"EAGLE-3 checkpoint lacks tensor {name!r}")
            if tuple(weights[name].shape) != shape:
                raise TokenleapError(
                    f"EAGLE-3 tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape}"
                )
        if c.draft_vocab_size > c.vocab_size:
            raise TokenleapError(f"draft_vocab_size {c.draft_vocab_size} exceeds the target vocabulary {c.vocab_size}")
        if "d2t" in weights:
            d2t = weights["d2t"].to(torch.int64)
            if tuple(d2t.shape) != (c.draft_vocab_size,):
                raise TokenleapError(f"EAGLE-3 d2t has shape {tuple(d2t.shape)}, expected ({c.draft_vocab_size},)")
            self.d2t_ids = torch.arange(c.draft_vocab_size) + d2t
            if int(self.d2t_ids.min()) < 0 or int(self.d2t_ids.max()) >= c.vocab_size:
                raise TokenleapError("EAGLE-3 d2t maps draft ids outside the target vocabulary")
        elif c.draft_vocab_size < c.vocab_size:
            raise TokenleapError(
                f"EAGLE-3 head has a reduced draft vocabulary ({c.draft_vocab_size} < {c.vocab_size}) "
                "but no d2t mapping"
            )
        else:
            self.d2t_ids = torch.arange(c.draft_vocab_size)
        self.d2t_list = self.d2t_ids.tolist()
        emb = weights.get("embed_tokens.weight")
        if emb is not None and tuple(emb.shape) != (c.vocab_size, h):
            emb = None  # not a table of its own: the target's
        if emb is None and h != tc.hidden_size:
            raise TokenleapError("EAGLE-3 head with its own hidden size needs embed_tokens.weight")
        super().__init__(config, target, None if emb is None else emb.to(dtype).contiguous())

        def f32(name: str) -> torch.Tensor:
            return weights[name].float().contiguous()

        quantize = bool(target.quantization)

        def lin(*names: str) -> Linear:
            return head_linear(weights, names, dtype, self.kernels, quantize)

        p = "midlayer."
        self.fc = lin("fc.weight")
        self.in_norm = f32(p + "input_layernorm.weight")
        self.hidden_norm = f32(p + "hidden_norm.weight")
        self.wqkv = lin(*(f"{p}self_attn.{n}_proj.weight" for n in "qkv"))
        self.wo = lin(p + "self_attn.o_proj.weight")
        self.post_norm = f32(p + "post_attention_layernorm.weight")
        self.w_gate_up = lin(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        self.w_down = lin(p + "mlp.down_proj.weight")
        self.norm = f32("norm.weight")
        self.lm_head = lin("lm_head.weight")
        # the target hidden states the engine must capture: output of layer l-1 = input of layer l
        # never empty: it turns `observe` on
        self.hidden_layers = tuple(sorted({layer - 1 for layer in c.aux_layers if layer > 0})) or (0,)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[n, 3 H_target] concatenated aux states -> the feature g [n, H]."""
        return self._linear(aux, self.fc)

    def aux_from(self, token_ids: Sequence[int], hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The concatenated aux states of the rows of a target forward."""
        parts = []
        for layer in self.config.aux_layers:
            parts.append(self.target_embed(token_ids) if layer == 0 else hidden[layer - 1].float())
        return torch.cat(parts, dim=-1)

    def target_embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        return F.embedding(torch.tensor(list(token_ids), dtype=torch.long), self.target.embed).float()

    def layer(
        self, g: torch.Tensor, e: torch.Tensor, positions: torch.Tensor, kv: HeadKV, visible: torch.Tensor
    ) -> torch.Tensor:
        """One head step over n rows: features g [n, H], token embeddings e [n, H]. The rows'
        K/V are appended to `kv`; `visible` [n, kv.length + n] says which slots each row sees."""
        gn = self._rms(g, self.hidden_norm)
        x = torch.cat([self._rms(e, self.in_norm), gn], dim=-1)
        residual = gn if self.config.norm_before_residual else g
        h = residual + self._attention(x, positions, kv, visible)
        gate, up = self._linear(self._rms(h, self.post_norm), self.w_gate_up).chunk(2, dim=-1)
        return h + self._linear(F.silu(gate) * up, self.w_down)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [n, Vd] of head outputs h (pre-norm)."""
        return self._linear(self._rms(h, self.norm), self.lm_head)




_SPECULATORS_RENAMES = (("layers.0.", "midlayer."), ("fusion_fc.", "fc."), ("draft_id_to_target_id", "d2t"))


def eagle3_head(
    raw: dict[str, Any], weights: dict[str, torch.Tensor], target: CausalLM, source: str | Path
) -> Eagle3Head:
    """An EAGLE-3 head from a checkpoint's config.json and tensors, in the EAGLE / SpecForge or
    the speculators spelling (`source` names it in the log)."""
    config, dialect = read_config(raw, target.config.num_layers)
    if dialect == "speculators" or any(k.startswith("layers.0.") for k in weights):
        renamed = {}
        for k, t in weights.items():
            for old, new in _SPECULATORS_RENAMES:
                if k.startswith(old):
                    k = new + k[len(old) :]
            renamed[k] = t
        weights = renamed
    head = Eagle3Head(config, weights, target)
    logger.info(
        "EAGLE-3 head %s (%s layout): aux layers %s (inputs of those target layers), draft vocabulary %d of %d",
        source, dialect, list(config.aux_layers), config.draft_vocab_size, config.vocab_size,
    )
    return head
