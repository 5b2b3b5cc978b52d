"""Native Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral) in plain PyTorch.

The architecture of Touvron et al. (2023): pre-RMSNorm blocks with rotary position embeddings
(half-split "NeoX" layout), grouped-query attention and a SwiGLU MLP. Written as a functional
forward over plain tensors rather than `nn.Module`s, with Q/K/V and gate/up fused into one
matrix each, because on a 2-core CPU decoding is memory-bound and every Python-level op costs.

`forward` takes any number of new tokens at arbitrary positions with an explicit attention mask
(causal or a token tree), appends their keys and values to the KV cache, and returns final
hidden states; `forward_batch` does the same for new tokens of several sequences at once (a
continuous-batching decode step: the linears run over all rows together, attention per row
over its own cache); `compute_logits` runs the LM head on chosen rows only. Weights are kept in
the model dtype (bfloat16 or float32); activations and attention arithmetic run in float32; the
KV cache is float32, or bfloat16 in the kernels' blocked layout for bfloat16 models on the
AVX512-BF16 kernels (as transformers keeps K/V in the model dtype).

Forwards of up to `ROW_PATH_MAX_ROWS` new tokens (decoding, verification) and every batched
step run on the row-invariant kernels of `tokenleap.kernels` (norms, packed linears with fused
residual adds, fused rotary + KV write + attention), so a row's result never depends on the
other rows: verifying a draft is bit-identical to decoding it token by token, and batching
requests does not change their output. bfloat16 models run their prefill on the kernels too
(1.5x faster than torch's GEMM with AVX512-BF16, ~9x on an AVX2-only CPU, and chunking a prompt
cannot change it); longer forwards
of fp32 models (prompt prefill, shared by both paths) use torch's GEMM and SDPA.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import logging

import torch
import torch.nn.functional as F

from tokenleap.attention.ops import AttentionMask, RowGroup, attend, causal_mask, plan_rows
from tokenleap.kernels import CpuKernels, PackedWeight, QuantWeight
from tokenleap.errors import TokenleapError
from tokenleap.kv.cache import KVCache
from tokenleap.models.config import ModelConfig

logger = logging.getLogger(__name__)

# New rows up to this count use the row-invariant path (decode / verify); longer forwards
# (prompt prefill) of fp32 models use torch's batched kernels (bf16 models: the kernels too).
ROW_PATH_MAX_ROWS = 32


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [D]
    # dense weights in the model dtype (None when only the quantized form is kept)
    wqkv: torch.Tensor | None  # [Q + 2KV, D]
    bqkv: torch.Tensor | None  # [Q + 2KV]
    wo: torch.Tensor | None  # [D, Q]
    mlp_norm: torch.Tensor  # [D]
    w_gate_up: torch.Tensor | None  # [2F, D]
    w_down: torch.Tensor | None  # [D, F]
    # The same four matrices as the kernels read them: packed bf16, or GGUF blocks.
    packed: dict[str, PackedWeight | QuantWeight] = field(default_factory=dict)


@dataclass(frozen=True)
class SeqInput:
    """New tokens of one sequence for `LlamaModel.forward_batch`."""

    input_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    kv: KVCache
    attn: AttentionMask | None = None  # None: causal


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [n, D] after the final norm
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n, D]


class LlamaModel:
    """A Llama-family causal LM implementing the `CausalLM` protocol."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        kernels: CpuKernels | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.kv_dtype = torch.float32
        if kernels is not None and not kernels.supports(config.hidden_size, config.intermediate_size, config.q_size, config.head_dim):
            logger.warning(
                "tokenleap kernels need widths that are multiples of 32 and head_dim 16, 32, 64 or 128; "
                "using torch ops for this model (slower, not row-invariant)"
            )
            kernels = None
        self.kernels = kernels
        # bf16 models on the kernels keep K/V in bf16, laid out for the kernel's bf16 attention
        # (half the bytes, dot products without horizontal sums); fp32 models keep fp32 K/V
        self.kv_blocked = kernels is not None and kernels.bf16_attention and dtype == torch.bfloat16
        if self.kv_blocked:
            self.kv_dtype = torch.bfloat16
        # bf16 prompts prefill on the kernels (torch's bf16 GEMM is 1.5x slower with AVX512-BF16
        # and ~9x slower on an AVX2-only CPU; chunking a prompt cannot change the kernels' bits)
        # GGUF blocks the kernels read (`QuantWeight`) stay quantized; without kernels they are
        # dequantized here (the torch path reads dense weights)
        quantized = kernels is not None and any(isinstance(v, QuantWeight) for v in weights.values())
        self.quantization: str | None = "gguf" if quantized else None
        self.kernel_prefill = kernels is not None and (quantized or (kernels.packed and dtype == torch.bfloat16))

        def dense(value: torch.Tensor | QuantWeight) -> torch.Tensor:
            return value.dequantize() if isinstance(value, QuantWeight) else value

        def w(name: str) -> torch.Tensor:
            return dense(weights[name]).to(dtype).contiguous()

        def f32(name: str) -> torch.Tensor:
            return dense(weights[name]).float().contiguous()

        def linear(names: Sequence[str]) -> tuple[torch.Tensor | None, PackedWeight | QuantWeight | None]:
            """A (fused) linear: its blocks when every part is quantized alike, else dense + packed."""
            parts = [weights[n] for n in names]
            if quantized and all(isinstance(x, QuantWeight) for x in parts) and len({(x.format, x.in_dim) for x in parts}) == 1:
                return None, QuantWeight.cat(parts) if len(parts) > 1 else parts[0]
            t = torch.cat([dense(x) for x in parts]).to(dtype).contiguous()
            return t, kernels.pack(t) if kernels is not None else None

        self.embed = w("embed")  # [V, D]
        head = weights.get("lm_head")
        self.lm_head = self.embed if config.tie_word_embeddings else w("lm_head")
        self.lm_head_packed: PackedWeight | QuantWeight | None = None
        if kernels is not None:
            self.lm_head_packed = head if quantized and isinstance(head, QuantWeight) else kernels.pack(self.lm_head)
        self.norm = f32("norm")
        self.layers: list[_Layer] = []
        for i in range(config.num_layers):
            p = f"layers.{i}."
            bias = None
            if f"{p}q_bias" in weights:
                bias = torch.cat([weights[f"{p}{n}_bias"] for n in ("q", "k", "v")]).float()
            fused = {
                "wqkv": linear([p + "q", p + "k", p + "v"]),
                "wo": linear([p + "o"]),
                "w_gate_up": linear([p + "gate", p + "up"]),
                "w_down": linear([p + "down"]),
            }
            layer = _Layer(
                attn_norm=f32(p + "attn_norm"),
                wqkv=fused["wqkv"][0],
                bqkv=bias,
                wo=fused["wo"][0],
                mlp_norm=f32(p + "mlp_norm"),
                w_gate_up=fused["w_gate_up"][0],
                w_down=fused["w_down"][0],
            )
            layer.packed.update({name: prepared for name, (_, prepared) in fused.items() if prepared is not None})
            self.layers.append(layer)
        half = config.head_dim // 2
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float64) / half))
        angles = torch.outer(torch.arange(config.max_position, dtype=torch.float64), inv_freq)
        self._cos = torch.cat([angles.cos(), angles.cos()], dim=-1).float()  # [P, hd]
        self._sin = torch.cat([angles.sin(), angles.sin()], dim=-1).float()  # [P, hd]

    def with_layers(self, num_layers: int) -> LlamaModel:
        """A model made of this one's first `num_layers` layers, sharing its weights."""
        if not 1 <= num_layers <= self.config.num_layers:
            raise TokenleapError(f"draft_layers must be in [1, {self.config.num_layers}], got {num_layers}")
        clone = copy.copy(self)
        clone.config = dataclasses.replace(self.config, num_layers=num_layers)
        clone.layers = self.layers[:num_layers]
        return clone

    @property
    def max_context(self) -> int:
        return self.config.max_position

    def new_kv_cache(self, max_capacity: int | None = None) -> KVCache:
        c = self.config
        return KVCache(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            dtype=self.kv_dtype,
            max_capacity=max_capacity or c.max_position,
            blocked=self.kv_blocked,
        )

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step streams (the linears and the LM head, as stored)."""
        if self.quantization is None:
            return self.config.bytes_per_token(self.embed.element_size())

        def size(prepared: PackedWeight | QuantWeight | None, t: torch.Tensor | None) -> int:
            if isinstance(prepared, QuantWeight):
                return prepared.nbytes
            return t.numel() * t.element_size() if t is not None else 0

        total = sum(size(layer.packed.get(n), getattr(layer, n)) for layer in self.layers for n in ("wqkv", "wo", "w_gate_up", "w_down"))
        return total + size(self.lm_head_packed, self.lm_head)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """fp32 `[n, in]` -> fp32 `[n, out]` with torch."""
        y = F.linear(x.to(w.dtype), w).float()
        return y + b if b is not None else y

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        kv: KVCache,
        attn: AttentionMask | None = None,
        *,
        return_hidden: Sequence[int] = (),
    ) -> ModelOutput:
        """Run `n` new tokens; their K/V go to cache slots `kv.length ..`, which are committed."""
        if self.kernels is not None and (input_ids.shape[0] <= ROW_PATH_MAX_ROWS or self.kernel_prefill):
            return self.forward_batch([SeqInput(input_ids, positions, kv, attn)], return_hidden=return_hidden)
        return self._forward_torch(input_ids, positions, kv, attn or causal_mask(), return_hidden)

    @torch.inference_mode()
    def forward_batch(self, seqs: Sequence[SeqInput], *, return_hidden: Sequence[int] = ()) -> ModelOutput:
        """New tokens of several sequences in one forward; hidden rows come back concatenated in
        the order of `seqs`. Each row is computed exactly as in a forward of its own."""
        kernels = self.kernels
        if kernels is None:
            outs = [self.forward(s.input_ids, s.positions, s.kv, s.attn, return_hidden=return_hidden) for s in seqs]
            return ModelOutput(
                torch.cat([o.hidden for o in outs]),
                {i: torch.cat([o.hidden_states[i] for o in outs]) for i in return_hidden},
            )
        c = self.config
        groups = []
        for s in seqs:
            if s.kv.blocked != self.kv_blocked or s.kv.dtype != self.kv_dtype:
                raise ValueError("KV cache layout does not match the model's (make it with new_kv_cache)")
            s.kv.reserve(int(s.input_ids.shape[0]))
            groups.append(RowGroup(s.kv, s.kv.length, s.positions, s.attn or causal_mask()))
        plan = plan_rows(groups)
        if int(plan.positions.max()) >= self._cos.shape[0] or int(plan.positions.min()) < 0:
            raise TokenleapError(f"positions must be in [0, {self._cos.shape[0]})")
        eps = c.rms_norm_eps
        x = F.embedding(torch.cat([s.input_ids for s in seqs]), self.embed).float()  # [rows, D]
        hidden_states: dict[int, torch.Tensor] = {}
        for idx, layer in enumerate(self.layers):
            pk = layer.packed
            qkv = kernels.linear(x, pk.get("wqkv", layer.wqkv), layer.bqkv, norm=(layer.attn_norm, eps))
            a = kernels.attention(qkv, plan, idx, c.num_heads, c.num_kv_heads, c.head_dim, self._cos, self._sin)
            kernels.linear(a, pk.get("wo", layer.wo), None, out=x)  # x += a @ wo.T
            gate_up = kernels.linear(x, pk.get("w_gate_up", layer.w_gate_up), norm=(layer.mlp_norm, eps))
            kernels.linear(gate_up, pk.get("w_down", layer.w_down), None, out=x, glu=True)  # x += silu_mul(gate_up) @ w_down.T
            if idx in return_hidden:
                hidden_states[idx] = x.clone()
        for s in seqs:
            s.kv.commit(int(s.input_ids.shape[0]))
        return ModelOutput(kernels.rmsnorm(x, self.norm, eps), hidden_states)

    def _forward_torch(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        attn: AttentionMask,
        return_hidden: Sequence[int],
    ) -> ModelOutput:
        """The torch path: prefill (batched GEMM and SDPA), or every forward without kernels
        (then short forwards attend row by row)."""
        c = self.config
        n = input_ids.shape[0]
        start = kv.length
        kv.reserve(n)
        row_path = n <= ROW_PATH_MAX_ROWS
        lin = self._linear
        cos = self._cos[positions].unsqueeze(1)  # [n, 1, hd]
        sin = self._sin[positions].unsqueeze(1)
        half = c.head_dim // 2
        nq, nkv = c.num_heads, c.num_kv_heads
        x = F.embedding(input_ids, self.embed).float()  # [n, D]
        hidden_states: dict[int, torch.Tensor] = {}
        for idx, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.attn_norm)
            qkv = lin(h, layer.wqkv, layer.bqkv)  # [n, Q + 2KV]
            qk = qkv[:, : c.q_size + c.kv_size].view(n, nq + nkv, c.head_dim)
            rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
            qk = qk * cos + rotated * sin  # [n, nq + nkv, hd]
            v = qkv[:, c.q_size + c.kv_size :].view(n, nkv, c.head_dim)
            kv.write(idx, start, qk[:, nq:].transpose(0, 1), v.transpose(0, 1))
            a = attend(qk[:, :nq], kv, idx, start, attn, row_path=row_path)
            x = x + lin(a, layer.wo, None)
            h = self._rms_norm(x, layer.mlp_norm)
            gate, up = lin(h, layer.w_gate_up, None).chunk(2, dim=-1)
            x = x + lin(F.silu(gate) * up, layer.w_down, None)
            if idx in return_hidden:
                hidden_states[idx] = x
        kv.commit(n)
        return ModelOutput(self._rms_norm(x, self.norm), hidden_states)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, indices: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """LM head over `hidden[indices]` (all rows when None): float32 `[rows, vocab]`."""
        if indices is not None:
            hidden = hidden[indices]
        if self.kernels is not None:  # every row count: the exactness contract has no row limit
            return self.kernels.linear(hidden, self.lm_head_packed or self.lm_head)
        return self._linear(hidden, self.lm_head, None)
