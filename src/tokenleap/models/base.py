"""The model seam: `CausalLM`, what the engine, the drafters, the draft heads and `train/` use of a
target or draft model, and the two records that cross it (`SeqInput`, `ModelOutput`).

Everything above `models/` types against `CausalLM`; only the loaders (`models/loading.py`) name
the implementation (`models.llama.LlamaModel`, the Llama family on the kernels or torch). A model
of another family (MoE, MLA) plugs in by offering these members:

- `forward` runs `n` new tokens of one sequence at explicit positions under an attention mask
  (causal, or a token tree), appends their K/V to the cache and returns final hidden states;
- `forward_batch` does the same for several sequences at once, each row computed exactly as in
  a forward of its own (the exactness contract: verifying a draft is bit-identical to decoding
  it token by token, and batching requests does not change their output);
- `compute_logits` runs the LM head on chosen rows;
- `new_kv_cache` makes a cache in the layout its forwards read;
- `embed`, `lm_head`, `norm` and `embed_tokens` are the token table, the LM head and the final
  norm that draft heads share and heads are trained from;
- `with_layers` is the model made of its first layers (a self-speculative draft);
- `kernels` are the compiled kernels it runs on (None: torch ops), which the heads run on too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from tokenleap.attention.ops import AttentionMask
from tokenleap.kv.cache import KVCache
from tokenleap.models.config import ModelConfig

if TYPE_CHECKING:
    from tokenleap.kernels import CpuKernels


@dataclass(frozen=True)
class SeqInput:
    """New tokens of one sequence for `CausalLM.forward_batch`."""

    input_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    kv: KVCache
    attn: AttentionMask | None = None  # None: causal


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [n, D] after the final norm
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n, D]


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only causal language model as the rest of tokenleap drives it (see the module
    docstring); `models.llama.LlamaModel` implements it."""

    config: ModelConfig
    dtype: torch.dtype  # the weights' dtype (bfloat16 or float32); activations are float32
    kernels: CpuKernels | None  # the compiled kernels it runs on (None: torch ops)
    quantization: str | None  # "gguf": its linears are kept in their GGUF blocks (None: dense in `dtype`)

    @property
    def max_context(self) -> int:
        """Positions a sequence may reach (the rotary tables' cap)."""
        ...

    @property
    def embed(self) -> torch.Tensor:
        """The dense token table `[V, D]` in `dtype`."""
        ...

    @property
    def lm_head(self) -> torch.Tensor:
        """The dense LM head `[V, D]` in `dtype`."""
        ...

    @property
    def norm(self) -> torch.Tensor:
        """The final norm's weight `[D]` (float32)."""
        ...

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 `[n, D]` token embeddings."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        attn: AttentionMask | None = None,
        *,
        return_hidden: Sequence[int] = (),
    ) -> ModelOutput:
        """Run `n` new tokens; their K/V go to cache slots `kv.length ..`, which are committed."""
        ...

    def forward_batch(self, seqs: Sequence[SeqInput], *, return_hidden: Sequence[int] = ()) -> ModelOutput:
        """New tokens of several sequences, rows concatenated in the order of `seqs`, each row
        exactly as in a forward of its own."""
        ...

    def compute_logits(self, hidden: torch.Tensor, indices: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """LM head over `hidden[indices]` (all rows when None): float32 `[rows, vocab]`."""
        ...

    def new_kv_cache(self, max_capacity: int | None = None) -> KVCache:
        """An empty KV cache in the layout this model's forwards read."""
        ...

    def with_layers(self, num_layers: int) -> CausalLM:
        """A model made of this one's first `num_layers` layers, sharing its weights."""
        ...

    def with_vocab(self, keep: torch.Tensor) -> tuple[CausalLM, torch.Tensor]:
        """A model sharing this one's weights whose `compute_logits` scores only the tokens `keep`
        (widened to whole rows of the LM head's storage), and the token ids of its logits' columns."""
        ...

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step streams."""
        ...
