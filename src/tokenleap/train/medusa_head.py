"""Trainable Medusa heads (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework
with Multiple Decoding Heads"), Medusa-1 style: the target stays frozen, K heads of residual
blocks x + SiLU(W x + b) over the target's final (normed) hidden state share the target's LM head;
head k at position i predicts x_{i+k+2}. The blocks start at zero, so every head starts as the
target's own next-token prediction (Medusa's initialisation).

`ttt_logits` returns the K heads' logits in the indexing of the EAGLE-3 trainer (entry k, row i
predicts x_{i+k+2}), so one loss and one loop train both. `export` writes FasterDecoding's layout
(`medusa_num_heads`, `medusa_num_layers`, tensors `{k}.{j}.linear.weight/bias`, no projection:
shared LM head) that `--spec-type medusa --model-draft DIR` loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenleap.train.eagle3_head import write_head


@dataclass(frozen=True)
class MedusaShape:
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_layers: int = 1


class TrainableMedusa(nn.Module):
    lm_head: torch.Tensor  # a buffer (register_buffer), typed for nn.Module's attribute access

    def __init__(self, shape: MedusaShape, lm_head: torch.Tensor, final_logit_softcap: float | None = None) -> None:
        super().__init__()
        self.shape = s = shape
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(s.hidden_size, s.hidden_size))
                                        for _ in range(s.num_heads * s.num_layers))
        self.biases = nn.ParameterList(
            nn.Parameter(torch.zeros(s.hidden_size)) for _ in range(s.num_heads * s.num_layers)
        )
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)
        self.softcap = final_logit_softcap

    def ttt_logits(self, hidden: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """`hidden` [B, T, H] the target's final hidden states; `ids` unused (a Medusa head sees
        no token); `steps` must be the number of heads."""
        s = self.shape
        assert steps == s.num_heads, (steps, s.num_heads)
        outs = []
        for k in range(s.num_heads):
            x = hidden
            for j in range(s.num_layers):
                i = k * s.num_layers + j
                x = x + F.silu(F.linear(x, self.weights[i], self.biases[i]))
            w = self.lm_head if torch.is_autocast_enabled("cpu") else self.lm_head.to(x.dtype)  # autocast casts itself
            logits = F.linear(x, w)
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            outs.append(logits)
        return outs

    def export(self, folder: Path, extra: dict[str, Any] | None = None) -> Path:
        """Write FasterDecoding's layout (no projection tensors: the heads share the LM head)."""
        s = self.shape
        tensors: dict[str, torch.Tensor] = {}
        for k in range(s.num_heads):
            for j in range(s.num_layers):
                i = k * s.num_layers + j
                tensors[f"{k}.{j}.linear.weight"] = self.weights[i].detach().to(torch.bfloat16).contiguous()
                tensors[f"{k}.{j}.linear.bias"] = self.biases[i].detach().float().contiguous()
        config: dict[str, Any] = {"medusa_num_heads": s.num_heads, "medusa_num_layers": s.num_layers,
                                  "hidden_size": s.hidden_size, "vocab_size": s.vocab_size}
        if extra:
            config["tokenleap_training"] = extra
        return write_head(folder, tensors, config)
