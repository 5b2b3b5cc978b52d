"""Medusa heads (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads"): K extra heads on the target's final hidden state; head i predicts the
token i + 2 positions ahead (the target's own LM head predicts the next one).

Each head is `medusa_num_layers` residual blocks, x + SiLU(W x + b), then a vocabulary
projection (its own, or the target's LM head when the checkpoint has none: shared). From the
last verified position's final hidden state (handed over by the engine in the verify forward,
`hidden_layers = (FINAL_HIDDEN,)`), the draft is each head's argmax in turn: a chain of up to K
tokens, deterministic, so sampled requests stay exact; with topk > 1, a dynamic tree over the
heads' top-k tokens (greedy requests verify it as a tree). There is no head KV cache and no
layer of its own, so these are not a `DraftHead`: `drafters/head_drafter.MedusaDrafter` drafts
with them, keeping only the last position's feature with the token prefix it belongs to.

Layouts: FasterDecoding (`config.json` with `medusa_num_heads`, `medusa_num_layers`; tensors
`{i}.{j}.linear.weight/bias` for the blocks and `{i}.{L}.weight` for the projection, optionally
prefixed `medusa_head.`) and vLLM (`config.json` with `num_heads`, `num_hidden_layers`; tensors
`blocks.{i}.layers.{j}.weight/bias`, `lm_heads.{i}.weight`).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenleap.errors import TokenleapError
from tokenleap.heads.base import FINAL_HIDDEN, linear_on
from tokenleap.kernels import Linear
from tokenleap.models.base import CausalLM

logger = logging.getLogger(__name__)


@dataclass
class _Block:
    weight: Linear  # [H, H], packed for the kernels when possible
    bias: torch.Tensor  # [H] float32


class MedusaHeads:
    """K heads over the target's final hidden state; head i's logits predict the token i + 2
    positions ahead (`MedusaDrafter` in drafters/head_drafter.py drafts with them)."""

    hidden_layers = (FINAL_HIDDEN,)

    def __init__(self, blocks: list[list[_Block]], projections: list[Linear | None], target: CausalLM) -> None:
        self.blocks = blocks
        self.projections = projections  # None: the target's LM head
        self.target = target
        self.kernels = target.kernels

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def _linear(self, x: torch.Tensor, w: Linear, b: torch.Tensor | None = None) -> torch.Tensor:
        return linear_on(self.kernels, x, w, b)

    def logits(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Head i's logits [n, V] from final hidden states h [n, H]."""
        x = h
        for block in self.blocks[i]:
            x = x + F.silu(self._linear(x, block.weight, block.bias))
        proj = self.projections[i]
        return self.target.compute_logits(x) if proj is None else self._linear(x, proj)


def load_medusa(path: str | Path, target: CausalLM) -> MedusaHeads:
    folder = Path(path).expanduser()
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise TokenleapError(f"Medusa heads {str(path)!r} must be a directory with config.json and *.safetensors")
    try:
        raw = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise TokenleapError(f"Medusa config {folder / 'config.json'} is not valid JSON: {exc}") from exc
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TokenleapError(f"Medusa heads {folder} have no *.safetensors weights")
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    weights = {k.removeprefix("medusa_head."): v for k, v in weights.items()}
    if "num_heads" in raw and "medusa_num_heads" not in raw:  # vLLM's layout
        n_heads, n_layers = int(raw["num_heads"]), int(raw.get("num_hidden_layers", 1))

        def block(i: int, j: int) -> str:
            return f"blocks.{i}.layers.{j}"

        def proj(i: int) -> str:
            return f"lm_heads.{i}.weight"
    else:
        n_heads, n_layers = int(raw.get("medusa_num_heads", 0)), int(raw.get("medusa_num_layers", 1))

        def block(i: int, j: int) -> str:
            return f"{i}.{j}.linear"

        def proj(i: int) -> str:
            return f"{i}.{n_layers}.weight"
    if n_heads < 1:
        found = {int(m.group(1)) for k in weights if (m := re.match(r"(?:blocks\.|lm_heads\.)?(\d+)\.", k))}
        raise TokenleapError(
            f"Medusa config names no heads (medusa_num_heads / num_heads); the weights hold {len(found)}"
        )
    h, v = target.config.hidden_size, target.config.vocab_size
    dtype = target.dtype

    def prepared(t: torch.Tensor) -> Linear:
        w = t.to(dtype).contiguous()
        return target.kernels.prepare(w) if target.kernels is not None else Linear(w)

    blocks: list[list[_Block]] = []
    projections: list[Linear | None] = []
    for i in range(n_heads):
        layer = []
        for j in range(n_layers):
            wname, bname = block(i, j) + ".weight", block(i, j) + ".bias"
            if wname not in weights:
                raise TokenleapError(f"Medusa checkpoint lacks tensor {wname!r}")
            if tuple(weights[wname].shape) != (h, h):
                raise TokenleapError(
                    f"Medusa tensor {wname!r} has shape {tuple(weights[wname].shape)}, "
                    f"expected {(h, h)} (target hidden size)"
                )
            bias = weights.get(bname, torch.zeros(h)).float().contiguous()
            layer.append(_Block(prepared(weights[wname]), bias))
        blocks.append(layer)
        p = weights.get(proj(i))
        if p is not None and tuple(p.shape) != (v, h):
            raise TokenleapError(
                f"Medusa tensor {proj(i)!r} has shape {tuple(p.shape)}, expected {(v, h)} (target vocabulary)"
            )
        projections.append(prepared(p) if p is not None else None)
    shared = sum(p is None for p in projections)
    logger.info(
        "Medusa heads %s: %d heads of %d residual blocks, %d sharing the target's LM head",
        folder,
        n_heads,
        n_layers,
        shared,
    )
    return MedusaHeads(blocks, projections, target)
