"""Weight preparation: a loader's canonical tensors (`models.loaders`: dense tensors, or GGUF
blocks kept as `QuantWeight`) -> the weights a `LlamaModel` runs on (`ModelWeights`).

The quantization policy: a GGUF file's blocks stay quantized where the kernels are there to read
them (the model's `quantization` is then "gguf"); without kernels every weight is dequantized to
the model dtype, since the torch path reads dense weights. Each of a layer's four linears becomes
one `Linear` (`kernels/linear.py`): the fused ones (Q/K/V, gate/up) stacked along their outputs,
in their blocks where every part is quantized and they stack (one kernel format, or two in runs:
`QuantWeight.cat`), else dense in the model dtype, packed for the kernels where they take it.
Norms and biases are float32. The token table stays in its blocks (the model's lookups decode
only the rows they read) or is dense in the model dtype; the LM head is a `Linear` like the
others (the token table's when the embeddings are tied). On the kernels, the layers' weights under
2 MB end on one shared huge-page mapping (`kernels/memory.gather_on_huge_pages`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenleap.errors import TokenleapError
from tokenleap.kernels import CpuKernels, Linear, QuantWeight
from tokenleap.kernels.memory import gather_on_huge_pages
from tokenleap.models.config import ModelConfig
from tokenleap.models.layers import LayerWeights

logger = logging.getLogger(__name__)

RawWeights = dict[str, torch.Tensor | QuantWeight]  # a loader's weights by canonical name


@dataclass(frozen=True)
class ModelWeights:
    """A model's weights as its forwards read them."""

    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [D] float32, the final norm
    embed: torch.Tensor | QuantWeight  # the token table [V, D]: dense in the model dtype, or its GGUF blocks
    lm_head: Linear  # [V, D]
    quantized: bool  # GGUF blocks kept for the kernels' quantized linears


def prepare_weights(
    config: ModelConfig, weights: RawWeights, dtype: torch.dtype, kernels: CpuKernels | None, *, consume: bool = False
) -> ModelWeights:
    """`weights` prepared for a model in `dtype` on `kernels` (None: torch ops). `consume`: the
    caller hands `weights` over, and the parts of a fused linear are dropped from it once stacked
    (a load's peak memory is then about the model's)."""
    quantized = kernels is not None and any(isinstance(v, QuantWeight) for v in weights.values())
    prep = _Preparer(weights, dtype, kernels, quantized, consume)
    raw_embed, raw_head = weights["embed"], weights.get("lm_head")
    embed = raw_embed if quantized and isinstance(raw_embed, QuantWeight) else prep.dense("embed")
    if quantized and isinstance(raw_head, QuantWeight):
        lm_head = Linear(raw_head)
    elif not config.tie_word_embeddings:
        lm_head = prep.dense_linear(prep.dense("lm_head"))
    else:  # the token table's rows (dense: the same tensor)
        lm_head = prep.dense_linear(embed if isinstance(embed, torch.Tensor) else embed.dequantize().to(dtype))
    norm = prep.f32("norm")
    layers = tuple(prep.layer(config, i) for i in range(config.num_layers))
    if kernels is not None:  # the weights under 2 MB (QKV / output projections, a small model's every
        # matrix) onto one huge-page mapping, in forward order, before a fused path takes their addresses
        gather_on_huge_pages(w.weight if isinstance(w.weight, torch.Tensor) else w.weight.data
                             for layer in layers for w in layer.linears())
    return ModelWeights(layers, norm, embed, lm_head, quantized)


class _Preparer:
    """The conversions of one `prepare_weights` call over its weights."""

    def __init__(
        self, weights: RawWeights, dtype: torch.dtype, kernels: CpuKernels | None, quantized: bool, consume: bool
    ) -> None:
        self.weights, self.dtype, self.kernels, self.quantized, self.consume = (
            weights,
            dtype,
            kernels,
            quantized,
            consume,
        )

    def dense(self, name: str) -> torch.Tensor:
        """A weight in the model dtype (dequantized from its blocks where it has them)."""
        return _dense(self.weights[name]).to(self.dtype).contiguous()

    def f32(self, name: str) -> torch.Tensor:
        return _dense(self.weights[name]).float().contiguous()

    def optional_f32(self, name: str) -> torch.Tensor | None:
        return self.f32(name) if name in self.weights else None

    def dense_linear(self, weight: torch.Tensor) -> Linear:
        """A dense weight as the kernels read it (packed where they can), or as is for torch."""
        return self.kernels.prepare(weight) if self.kernels is not None else Linear(weight)

    def linear(self, names: Sequence[str]) -> Linear:
        """A (fused) linear: its blocks when every part is quantized and they stack, else dense."""
        parts = [self.weights[n] for n in names]
        blocks = [x for x in parts if isinstance(x, QuantWeight)]
        if self.quantized and len(blocks) == len(parts):
            try:
                stacked = QuantWeight.cat(blocks) if len(blocks) > 1 else blocks[0]
                if self.consume and len(parts) > 1:  # the parts were copied: free them now
                    for n in names:
                        self.weights[n] = stacked
                return Linear(stacked)
            except ValueError as exc:
                logger.info("%s: dequantized to %s (%s)", "+".join(names), self.dtype, exc)
        return self.dense_linear(torch.cat([_dense(x) for x in parts]).to(self.dtype).contiguous())

    def layer(self, config: ModelConfig, i: int) -> LayerWeights:
        """Decoder layer `i`: its norms, its QKV bias (Qwen2) and its four linears."""
        p = f"layers.{i}."
        bias = None
        if f"{p}q_bias" in self.weights:
            bias = torch.cat([_dense(self.weights[f"{p}{n}_bias"]) for n in ("q", "k", "v")]).float()
        wqkv, wo = self.linear([p + "q", p + "k", p + "v"]), self.linear([p + "o"])
        w_gate_up, w_down = self.linear([p + "gate", p + "up"]), self.linear([p + "down"])
        layer = LayerWeights(
            attn_norm=self.f32(p + "attn_norm"),
            wqkv=wqkv,
            bqkv=bias,
            wo=wo,
            mlp_norm=self.f32(p + "mlp_norm"),
            w_gate_up=w_gate_up,
            w_down=w_down,
            q_norm=self.optional_f32(p + "q_norm"),
            k_norm=self.optional_f32(p + "k_norm"),
            post_attn_norm=self.optional_f32(p + "post_attn_norm"),
            post_mlp_norm=self.optional_f32(p + "post_mlp_norm"),
        )
        if config.qk_norm and layer.q_norm is None:
            raise TokenleapError(f"{config.architecture}: layer {i} has no q_norm / k_norm weights")
        if config.post_norms and (layer.post_attn_norm is None or layer.post_mlp_norm is None):
            raise TokenleapError(f"{config.architecture}: layer {i} has no post-attention / post-MLP norm weights")
        return layer


def _dense(value: torch.Tensor | QuantWeight) -> torch.Tensor:
    return value.dequantize() if isinstance(value, QuantWeight) else value
