"""Native Llama-family decoder (Llama 3.x, SmolLM2, Qwen2, Qwen3, Mistral, Gemma 3) in plain PyTorch.

The architecture of Touvron et al. (2023): pre-RMSNorm blocks with rotary position embeddings
(half-split "NeoX" layout), grouped-query attention and a SwiGLU MLP. Written as a functional
forward over plain tensors rather than `nn.Module`s, with Q/K/V and gate/up fused into one
matrix each, because on a 2-core CPU decoding is memory-bound and every Python-level op costs.

`forward` takes any number of new tokens at arbitrary positions with an explicit attention mask
(causal or a token tree), appends their keys and values to the KV cache, and returns final
hidden states; `forward_batch` does the same for new tokens of several sequences at once (a
continuous-batching decode step: the linears run over all rows together, attention per row
over its own cache); `compute_logits` runs the LM head on chosen rows only. The weights are
prepared once by `models.weights` (each matrix one `Linear`: dense in the model dtype, bfloat16
or float32, packed for the kernels, or in its GGUF blocks); this module keeps the execution
path, the KV cache type and the rotary tables, and runs the forwards. Activations and
attention arithmetic run in float32; the KV cache is float32, or bfloat16 in the kernels'
blocked layout for bfloat16 models on the AVX512-BF16 kernels (as transformers keeps K/V in the
model dtype).

Which code serves the forwards is decided once, at load (`ExecutionPath`, `LlamaModel.path`):

- FUSED (every architecture here on the kernels, where their attention serves the head dim):
  `forward_batch` (decoding, verification of drafts of any length, batched steps) and forwards
  of up to `ROW_PATH_MAX_ROWS` new tokens run all layers in one C call (`kernels/fused.py`) made
  of the row-invariant kernels of `tokenleap.kernels` (norms, linears with fused residual adds
  and gates, QK-norm, post-norms, fused rotary + KV write + attention, a sliding-window layer
  with its own plan and rope tables), so a row's result never depends on the other rows:
  verifying a draft is bit-identical to decoding it token by token, and batching requests does
  not change their output. bfloat16 and GGUF models run their prefill on the kernels too (1.5x
  faster than torch's GEMM with AVX512-BF16, ~9x on an AVX2-only CPU, and chunking a prompt
  cannot change it).
- KERNELS (a head dim the kernels' attention lacks, e.g. Gemma 3's 256 over fp32 caches; and,
  within FUSED, token trees over blocked caches once the sliding window binds): the decoder
  block of `models.layers` with the same row-invariant pieces (the kernels' linears, norms and
  gates; attention on the kernels where they serve it, else torch's row path).
- TORCH (no kernels): the same block on torch ops.

Longer forwards of fp32 models (prompt prefill) run the block on torch's GEMM and SDPA.

Sliding-window attention (Beltagy et al., 2020; Mistral, Gemma 3) is a mask: the cache keeps
every slot (slot i holds position i), and a local layer's row at position p sees the slots of
positions > p - window, so truncating the cache (rejected draft tokens) stays exact. Rotary
tables follow transformers (float32 `inv_freq`, Llama 3.x scaling of the frequencies, or
GGUF's `rope_freqs` divisors).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tokenleap.attention.ops import AttentionMask, RowGroup, attend, causal_mask, plan_rows
from tokenleap.errors import TokenleapError
from tokenleap.kernels import CpuKernels, Linear, LinearWeight, PackedWeight, QuantWeight, RowPlan
from tokenleap.kernels.fused import FusedLayers
from tokenleap.kernels.memory import copy_to_huge_pages
from tokenleap.kv.cache import KV_CACHE_TYPES, KVCache
from tokenleap.models.base import ModelOutput, SeqInput
from tokenleap.models.config import ModelConfig
from tokenleap.models.layers import (
    BlockOps,
    LayerWeights,
    apply_rope,
    decoder_layer,
    query_multiplier,
    rope_tables,
    torch_linear,
    torch_qk_norm,
    torch_residual,
)
from tokenleap.models.weights import RawWeights, prepare_weights
from tokenleap.threads import torch_threads

logger = logging.getLogger(__name__)

# `forward` of up to this many new rows uses the row-invariant path; longer ones (prompt prefill)
# of fp32 models use torch's batched kernels (bf16 models: the kernels too). `forward_batch`
# (the engine's decode / verify forward) is row-invariant at every row count.
ROW_PATH_MAX_ROWS = 32


class ExecutionPath(str, enum.Enum):
    """Which code serves a model's forwards, chosen once at load (`LlamaModel.path`).

    - FUSED: the kernels run the block (Llama, Qwen2/3, Mistral, Gemma 3) over every decode /
      verify / batched row (and bf16 or GGUF prompts): all layers in one C call
      (`kernels/fused.py`; `LlamaModel.fused` None: the per-call loop it is bit-identical to).
      Long float32 prompts take the torch block; token trees over blocked caches past a sliding
      window take the KERNELS block (their local layers attend in torch).
    - KERNELS: head dims outside the kernels' attention (or a query scale without QK-norm):
      `models.layers.decoder_layer` with the kernels' linears, norms, gates and attention per
      call; long float32 prompts take the torch block.
    - TORCH: no kernels: `decoder_layer` on torch ops (not row-invariant across a GEMM's rows, so
      each sequence of a batch runs alone, its short forwards attending row by row).
    """

    FUSED = "fused"
    KERNELS = "kernels"
    TORCH = "torch"


class LlamaModel:
    """A Llama-family causal LM implementing the `CausalLM` protocol."""

    def __init__(
        self,
        config: ModelConfig,
        weights: RawWeights,
        dtype: torch.dtype,
        kernels: CpuKernels | None = None,
        *,
        consume_weights: bool = False,
        kv_cache_type: str = "auto",
    ) -> None:
        """`weights` are prepared by `models.weights.prepare_weights` (`consume_weights`: the
        caller hands them over, and the parts of a fused linear are dropped once stacked).
        `kv_cache_type`: "auto" (bf16 where the kernels attend over blocked caches, else fp32),
        "bf16" or "q8_0" (`kv_cache_dtype`)."""
        self.config, self.dtype = config, dtype
        self.kernels = kernels = usable_kernels(config, dtype, kernels)
        # the kernels' fused attention serves head_dim 16..128, and 256 (Gemma 3) over bf16 caches;
        # other head dims (256 in float32) attend with torch's row path beside the kernels' linears
        self.kernel_attention = (
            kernels is not None and config.head_dim in kernels.attention_head_dims(dtype == torch.bfloat16)
        )
        # the one decision of which code serves the forwards (ExecutionPath)
        self.path = ExecutionPath.TORCH
        if kernels is not None:
            self.path = ExecutionPath.FUSED if config.fused_layers and self.kernel_attention else ExecutionPath.KERNELS
        # without kernels, plain Llama blocks have always attended short forwards row by row with
        # torch's SDPA (`attend`), the other architectures with `_attend_rows`: kept, for their bits
        self._sdpa_rows = self.path is ExecutionPath.TORCH and config.plain_llama
        # bf16 models on the kernels keep K/V in bf16, laid out for the kernel's bf16 attention
        # (half the bytes, dot products without horizontal sums); fp32 models keep fp32 K/V
        self.kv_blocked = (
            self.kernel_attention and kernels is not None and kernels.bf16_attention and dtype == torch.bfloat16
        )
        default_kv = torch.bfloat16 if self.kv_blocked else torch.float32
        self.kv_dtype = kv_cache_dtype(kv_cache_type, default_kv, self.kv_blocked, config.head_dim, kernels)
        prepared = prepare_weights(config, weights, dtype, kernels, consume=consume_weights)
        self.quantization: str | None = "gguf" if prepared.quantized else None
        # bf16 prompts prefill on the kernels (torch's bf16 GEMM is 1.5x slower with AVX512-BF16
        # and ~9x slower on an AVX2-only CPU; chunking a prompt cannot change the kernels' bits)
        self.kernel_prefill = kernels is not None and (
            prepared.quantized or (kernels.packed and dtype == torch.bfloat16)
        )
        self.layers: list[LayerWeights] = list(prepared.layers)
        self.norm = prepared.norm
        # the token table: dense, or kept in its blocks (`embed_tokens` decodes only the rows it
        # reads; `embed` decodes the whole table on first use, for the heads and the trainer)
        self._embed_blocks = prepared.embed if isinstance(prepared.embed, QuantWeight) else None
        if isinstance(prepared.embed, torch.Tensor):
            self.embed = prepared.embed
        # the LM head as `compute_logits` reads it (a reduced vocabulary's rows: `with_vocab`), and
        # the whole one, which `lm_head` decodes on first use where it is not dense
        self.lm_head_linear = self._lm_head_whole = prepared.lm_head
        # the fused path's layers as one kernel call (kernels/fused.py; None: a call per op)
        self.fused: FusedLayers | None = None
        if kernels is not None and self.path is ExecutionPath.FUSED:
            self.fused = fused_layers(config, kernels, self.layers)
        self._rope_cap = min(config.max_position, MAX_ROPE_TABLE)
        if self._rope_cap < config.max_position:
            logger.info("context limited to %d positions (the model allows %d)", self._rope_cap, config.max_position)
        self._build_rope(min(self._rope_cap, ROPE_TABLE_START))

    def _build_rope(self, positions: int) -> None:
        """Rotary tables [positions, hd] (global, and local ones where their base or scaling
        differ). A position's row does not depend on the table's length, so a table grown on
        demand (`_rope_upto`) holds the values a full one would: only a request that reaches far
        pays for far rows (Gemma 3: 32k x 256 fp32 x 4 tables = 0.13 GB)."""
        config = self.config
        self._cos, self._sin = rope_tables(config, config.rope_theta, positions, scaled=True)  # [P, hd] each
        self._cos_local, self._sin_local = self._cos, self._sin
        scaled = (
            config.rope_scaling is not None or config.rope_freq_factors is not None or config.rope_linear_factor != 1.0
        )
        if config.rope_local_theta is not None and (config.rope_local_theta != config.rope_theta or scaled):
            self._cos_local, self._sin_local = rope_tables(config, config.rope_local_theta, positions, scaled=False)

    def _rope_upto(self, positions: torch.Tensor) -> None:
        """Check `positions` against the context and grow the rotary tables to cover them."""
        hi, lo = int(positions.max()), int(positions.min())
        if hi >= self._rope_cap or lo < 0:
            raise TokenleapError(f"positions must be in [0, {self._rope_cap})")
        if hi >= self._cos.shape[0]:
            self._build_rope(min(self._rope_cap, max(hi + 1, 2 * int(self._cos.shape[0]))))

    @functools.cached_property
    def embed(self) -> torch.Tensor:
        """The dense token table `[V, D]` in `dtype` (decoded from its blocks on first use)."""
        assert self._embed_blocks is not None
        return self._embed_blocks.dequantize().to(self.dtype)

    @functools.cached_property
    def lm_head(self) -> torch.Tensor:
        """The dense LM head `[V, D]` in `dtype`: the token table when tied, else the head's
        weight (unpacked or decoded from its blocks on first use)."""
        if self.config.tie_word_embeddings:
            return self.embed
        return self._lm_head_whole.dense(self.dtype)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 `[n, D]` token embeddings (rounded to `dtype`, as the dense table holds them)."""
        if self._embed_blocks is not None:
            return self._embed_blocks.rows(ids).to(self.dtype).float()
        return F.embedding(ids, self.embed).float()

    def with_layers(self, num_layers: int) -> LlamaModel:
        """A model made of this one's first `num_layers` layers, sharing its weights."""
        if not 1 <= num_layers <= self.config.num_layers:
            raise TokenleapError(f"draft_layers must be in [1, {self.config.num_layers}], got {num_layers}")
        clone = copy.copy(self)
        sliding = self.config.sliding_layers
        clone.config = dataclasses.replace(
            self.config, num_layers=num_layers, sliding_layers=sliding[:num_layers] if sliding is not None else None
        )
        clone.layers = self.layers[:num_layers]
        return clone

    def with_vocab(self, keep: torch.Tensor) -> tuple[LlamaModel, torch.Tensor]:
        """A model sharing this one's weights whose LM head scores only the tokens `keep` (a
        reduced draft vocabulary, FR-Spec: Zhao et al., 2025), and the token ids of its logits'
        columns, in order. The head is cut in whole groups of its storage (8 rows of a quantized
        head, 16 of a packed bf16 one: slices of its bytes, no re-quantization), so the ids are
        `keep` widened to those groups. The token table stays whole."""
        vocab = self.config.vocab_size
        keep = keep.reshape(-1).long()
        if keep.numel() == 0 or int(keep.min()) < 0 or int(keep.max()) >= vocab:
            raise TokenleapError(f"a reduced vocabulary needs token ids in [0, {vocab})")
        head: LinearWeight | None = self.lm_head_linear.weight
        width = 8 if isinstance(head, QuantWeight) else 16 if isinstance(head, PackedWeight) else 1
        if isinstance(head, QuantWeight) and head.split:
            width, head = 1, None  # a stack of two formats: cut the dense head instead
        groups = torch.unique(torch.div(keep, width, rounding_mode="floor"))
        ids = (groups[:, None] * width + torch.arange(width)).reshape(-1)
        ids = ids[ids < vocab]
        clone = copy.copy(self)
        # the rows on huge pages, as the whole head's are (a 32k-token draft head: ~31 MB a step)
        if isinstance(head, QuantWeight) and ids.numel() == groups.numel() * 8:
            clone.lm_head_linear = Linear(
                QuantWeight(copy_to_huge_pages(head.data[groups]), head.qtype, ids.numel(), head.in_dim, head.types)
            )
        elif isinstance(head, PackedWeight) and ids.numel() == groups.numel() * 16:
            clone.lm_head_linear = Linear(PackedWeight(copy_to_huge_pages(head.data[groups]), ids.numel(), head.in_dim))
        else:  # dense rows (a vocabulary that is not a multiple of the group: the last group's rows)
            ids = torch.unique(keep)
            dense = self.lm_head[ids].contiguous()
            clone.__dict__["lm_head"] = dense  # the cached property's slot
            clone.lm_head_linear = self.kernels.prepare(dense) if self.kernels is not None else Linear(dense)
        return clone, ids

    @property
    def max_context(self) -> int:
        return self._rope_cap

    def new_kv_cache(self, max_capacity: int | None = None) -> KVCache:
        c = self.config
        return KVCache(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            dtype=self.kv_dtype,
            max_capacity=max_capacity or self.max_context,
            blocked=self.kv_blocked,
        )

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step streams (the linears and the LM head, as stored)."""
        if self.quantization is None:
            return self.config.bytes_per_token(self.embed.element_size())
        return sum(w.nbytes for layer in self.layers for w in layer.linears()) + self.lm_head_linear.nbytes

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
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
        seqs = [SeqInput(input_ids, positions, kv, attn)]
        if self.path is ExecutionPath.FUSED and (input_ids.shape[0] <= ROW_PATH_MAX_ROWS or self.kernel_prefill):
            return self._forward_fused(seqs, return_hidden)
        return self._forward_blocks(seqs, return_hidden, row_invariant=False)

    def _prefill_threads(self) -> int | None:
        """Torch threads for a torch-GEMM forward: the kernels' pool size (sized from torch's
        threads at load), whatever a caller has set since (see threads.py)."""
        return self.kernels.threads if self.kernels is not None else None

    @torch.inference_mode()
    def forward_batch(self, seqs: Sequence[SeqInput], *, return_hidden: Sequence[int] = ()) -> ModelOutput:
        """New tokens of several sequences in one forward; hidden rows come back concatenated in
        the order of `seqs`. Each row is computed exactly as in a forward of its own: this is the
        row-invariant path at every row count (a verify forward of a 64-token draft is 65
        single-row forwards, bit for bit), where `forward` sends long fp32 prompts to torch."""
        if self.path is ExecutionPath.FUSED:
            return self._forward_fused(seqs, return_hidden)
        if self.path is ExecutionPath.KERNELS:
            return self._forward_blocks(seqs, return_hidden, row_invariant=True)
        # torch ops, not row-invariant across a GEMM's rows: each sequence alone, attending row by row
        outs = [self._forward_blocks([s], return_hidden, row_invariant=True) for s in seqs]
        return ModelOutput(
            torch.cat([o.hidden for o in outs]),
            {i: torch.cat([o.hidden_states[i] for o in outs]) for i in return_hidden},
        )

    def _reserve(self, seqs: Sequence[SeqInput]) -> list[int]:
        """Check each cache's layout, make room for the new rows; their first slots."""
        starts = []
        for s in seqs:
            if s.kv.blocked != self.kv_blocked or s.kv.dtype != self.kv_dtype:
                raise ValueError("KV cache layout does not match the model's (make it with new_kv_cache)")
            s.kv.reserve(int(s.input_ids.shape[0]))
            starts.append(s.kv.length)
        return starts

    def _forward_fused(self, seqs: Sequence[SeqInput], return_hidden: Sequence[int]) -> ModelOutput:
        """ExecutionPath.FUSED: the block on the kernels, row-invariant at every row count."""
        kernels = self.kernels
        assert kernels is not None  # FUSED is chosen with kernels only
        c = self.config
        starts = self._reserve(seqs)
        plans = self._row_plans(seqs, starts)
        # token trees over blocked caches past the window: the per-op block (it reserves the same slots)
        if True not in plans:
            return self._forward_blocks(seqs, return_hidden, row_invariant=True)
        self._rope_upto(plans[False].positions)
        eps = c.rms_norm_eps
        x = self._embed(seqs)  # [rows, D]
        glob = plans[False], self._cos, self._sin
        local = plans[True], self._cos_local, self._sin_local
        if self.fused is not None:
            hidden_states = self.fused.run(x, *glob, layers=len(self.layers), return_hidden=return_hidden, local=local)
            for s in seqs:
                s.kv.commit(int(s.input_ids.shape[0]))
            return ModelOutput(kernels.rmsnorm(x, self.norm, eps), hidden_states)
        # the per-call loop the fused call is bit-identical to (its reference: `fused` None)
        hidden_states = {}
        q_mult = query_multiplier(c)
        for idx, layer in enumerate(self.layers):
            qkv = kernels.linear(x, layer.wqkv, layer.bqkv, norm=(layer.attn_norm, eps))
            # QK-norm (Qwen3, Gemma 3), the query scale folded in
            if layer.q_norm is not None and layer.k_norm is not None:
                kernels.head_norm(
                    qkv, 0, c.num_heads, c.head_dim, layer.q_norm, eps, q_mult if q_mult is not None else 1.0
                )
                kernels.head_norm(qkv, c.q_size, c.num_kv_heads, c.head_dim, layer.k_norm, eps)
            plan, cos, sin = local if c.is_sliding(idx) else glob
            a = kernels.attention(qkv, plan, idx, c.num_heads, c.num_kv_heads, c.head_dim, cos, sin)
            if layer.post_attn_norm is None:
                kernels.linear(a, layer.wo, None, out=x)  # x += a @ wo.T
            else:  # Gemma 3: x += RMSNorm(a @ wo.T)
                kernels.rmsnorm_add(x, kernels.linear(a, layer.wo), layer.post_attn_norm, eps)
            gate_up = kernels.linear(x, layer.w_gate_up, norm=(layer.mlp_norm, eps))
            if layer.post_mlp_norm is None:
                kernels.linear(gate_up, layer.w_down, None, out=x, glu=c.activation)  # x += act(gate) * up @ w_down.T
            else:
                kernels.rmsnorm_add(
                    x, kernels.linear(gate_up, layer.w_down, glu=c.activation), layer.post_mlp_norm, eps
                )
            if idx in return_hidden:
                hidden_states[idx] = x.clone()
        for s in seqs:
            s.kv.commit(int(s.input_ids.shape[0]))
        return ModelOutput(kernels.rmsnorm(x, self.norm, eps), hidden_states)

    def _embed(self, seqs: Sequence[SeqInput]) -> torch.Tensor:
        """The forward's rows' token embeddings, fp32 `[rows, D]`, times the model's embedding
        scale (Gemma: sqrt(D))."""
        x = self.embed_tokens(torch.cat([s.input_ids for s in seqs]))
        if self.config.embed_scale != 1.0:
            x = x * torch.tensor(self.config.embed_scale, dtype=torch.float32)
        return x

    def _row_plans(self, seqs: Sequence[SeqInput], starts: Sequence[int]) -> dict[bool, RowPlan]:
        """The kernels' attention plans of a forward: [False] the global layers', [True] the
        sliding-window layers' (the same plan while no row reaches past the window), absent
        where those attend in torch: token trees over blocked caches once a row reaches past the
        window (the kernel lets a tree row see every cached slot, so the window's lower bound
        cannot be given to it)."""
        c = self.config
        masks = [s.attn or causal_mask() for s in seqs]
        plans = {False: plan_rows([RowGroup(s.kv, st, s.positions, m) for s, st, m in zip(seqs, starts, masks)])}
        if c.sliding_window is None or max(int(s.positions.max()) for s in seqs) < c.sliding_window:
            plans[True] = plans[False]  # no row reaches past the window
        elif not self.kv_blocked:  # fp32 caches: each row's slot list honours the window
            local_masks = [window_mask(m, st, s.positions, c.sliding_window) for m, st, s in zip(masks, starts, seqs)]
            plans[True] = plan_rows([RowGroup(s.kv, st, s.positions, m) for s, st, m in zip(seqs, starts, local_masks)])
        elif all(m.mask is None for m in masks):  # chains over blocked caches: a lower slot bound per row
            plans[True] = plan_rows(
                [RowGroup(s.kv, st, s.positions, m, c.sliding_window) for s, st, m in zip(seqs, starts, masks)]
            )
        return plans

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, indices: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """LM head over `hidden[indices]` (all rows when None): float32 `[rows, vocab]`."""
        if indices is not None:
            hidden = hidden[indices]
        if self.kernels is not None:  # every row count: the exactness contract has no row limit
            logits = self.kernels.linear(hidden, self.lm_head_linear)
        else:
            logits = self._linear(hidden, self.lm_head_linear.dense(), None)
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _forward_blocks(
        self, seqs: Sequence[SeqInput], return_hidden: Sequence[int], *, row_invariant: bool
    ) -> ModelOutput:
        """`decoder_layer` over one or several sequences (ExecutionPath.KERNELS and TORCH, and
        FUSED's long fp32 prompts). `row_invariant` (`forward_batch`: decode and verify rows): the
        kernels at every row count."""
        rows = sum(int(s.input_ids.shape[0]) for s in seqs)
        # kernels for decode / verify rows (and bf16 prefill); torch GEMM + SDPA for fp32 prefills
        row_invariant = row_invariant or len(seqs) > 1 or rows <= ROW_PATH_MAX_ROWS
        on_kernels = self.kernels is not None and (row_invariant or self.kernel_prefill)
        # the kernel path runs torch's small ops single-threaded, a torch GEMM prefill multi-threaded (threads.py)
        with torch_threads(1 if on_kernels else self._prefill_threads()):
            return self._forward_blocks_on(seqs, return_hidden, on_kernels, row_invariant)

    def _forward_blocks_on(
        self, seqs: Sequence[SeqInput], return_hidden: Sequence[int], on_kernels: bool, row_invariant: bool
    ) -> ModelOutput:
        c = self.config
        kernels = self.kernels if on_kernels else None
        eps = c.rms_norm_eps
        nq, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        starts = self._reserve(seqs)
        positions = torch.cat([s.positions for s in seqs])
        self._rope_upto(positions)
        masks = [s.attn or causal_mask() for s in seqs]
        local_masks = masks
        if c.sliding_window is not None:
            local_masks = [window_mask(m, st, s.positions, c.sliding_window) for m, st, s in zip(masks, starts, seqs)]
        # the kernels' plans; token trees over blocked caches past the window: their sliding
        # layers attend in torch (row path)
        plans = self._row_plans(seqs, starts) if kernels is not None and self.kernel_attention else {}

        def attention(qkv: torch.Tensor, idx: int) -> torch.Tensor:
            local = c.is_sliding(idx)
            cos, sin = (self._cos_local, self._sin_local) if local else (self._cos, self._sin)
            plan = plans.get(local)
            if plan is not None and kernels is not None:  # plans are made on the kernels only
                return kernels.attention(qkv.contiguous(), plan, idx, nq, nkv, hd, cos, sin)
            return self._attend_torch(
                qkv, seqs, starts, local_masks if local else masks, idx, cos, sin, on_kernels or row_invariant
            )

        if kernels is not None:
            q_mult = query_multiplier(c)

            def linear(x: torch.Tensor, w: Linear, norm: torch.Tensor | None) -> torch.Tensor:
                return kernels.linear(x, w, norm=(norm, eps) if norm is not None else None)

            def qk_norm(qkv: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
                if layer.q_norm is None or layer.k_norm is None:
                    return torch_qk_norm(qkv, layer, c)
                qkv = qkv.contiguous()  # one C call each (norms.h)
                kernels.head_norm(qkv, 0, nq, hd, layer.q_norm, eps, q_mult if q_mult is not None else 1.0)
                kernels.head_norm(qkv, c.q_size, nkv, hd, layer.k_norm, eps)
                return qkv

            def residual(x: torch.Tensor, y: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
                if norm is not None and x.is_contiguous():  # post-norm and add: one fused C call, in place
                    kernels.rmsnorm_add(x, y, norm, eps)
                    return x
                return torch_residual(x, y, norm, eps)

            def gated_down(gate_up: torch.Tensor, w_down: Linear) -> torch.Tensor:  # the gate inside the linear's call
                return kernels.linear(gate_up, w_down, glu=c.activation)

            ops = BlockOps(linear, qk_norm, attention, residual, gated_down)
        else:
            ops = BlockOps(
                lambda x, w, norm: torch_linear(x, w, norm, eps),
                lambda qkv, layer: torch_qk_norm(qkv, layer, c),
                attention,
                lambda x, y, norm: torch_residual(x, y, norm, eps),
            )
        x = self._embed(seqs)  # [rows, D]
        hidden_states: dict[int, torch.Tensor] = {}
        for idx, layer in enumerate(self.layers):
            x = decoder_layer(x, layer, idx, c, ops)
            if idx in return_hidden:
                hidden_states[idx] = x.clone()
        for s in seqs:
            s.kv.commit(int(s.input_ids.shape[0]))
        # the fused path's final norm on the kernels
        final = kernels.rmsnorm(x, self.norm, eps) if kernels is not None else self._rms_norm(x, self.norm)
        return ModelOutput(final, hidden_states)

    def _attend_torch(
        self,
        qkv: torch.Tensor,
        seqs: Sequence[SeqInput],
        starts: Sequence[int],
        masks: Sequence[AttentionMask],
        idx: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        row_path: bool,
    ) -> torch.Tensor:
        """Rotary embedding, K/V write and attention in torch, sequence by sequence."""
        c = self.config
        nq, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        outs = []
        offset = 0
        for s, start, mask in zip(seqs, starts, masks):
            n = int(s.input_ids.shape[0])
            part = qkv[offset : offset + n]
            offset += n
            qk = apply_rope(
                part[:, : c.q_size + c.kv_size].reshape(n, nq + nkv, hd),
                cos[s.positions].unsqueeze(1),
                sin[s.positions].unsqueeze(1),
            )
            v = part[:, c.q_size + c.kv_size :].reshape(n, nkv, hd)
            s.kv.write(idx, start, qk[:, nq:].transpose(0, 1), v.transpose(0, 1))
            if row_path and not self._sdpa_rows:
                outs.append(self._attend_rows(qk[:, :nq], s.kv, idx, start, mask))
            else:
                outs.append(attend(qk[:, :nq], s.kv, idx, start, mask, row_path=row_path))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _attend_rows(self, q: torch.Tensor, kv: KVCache, idx: int, start: int, mask: AttentionMask) -> torch.Tensor:
        """Each row on its own over exactly its slots (row-invariant), as two small matmuls and
        a softmax: torch's CPU SDPA costs ~2.7 ms per one-row call, ten times this."""
        c = self.config
        n, nq, hd = q.shape
        nkv = c.num_kv_heads
        keys, values = kv.keys(idx, start + n), kv.values(idx, start + n)  # [nkv, slots, hd]
        scale = hd**-0.5
        out = torch.empty(n, nq * hd, dtype=torch.float32)
        for i in range(n):
            slots = mask.row_slots(i, start)
            if isinstance(slots, int):
                k_i, v_i = keys[:, :slots], values[:, :slots]
            else:
                k_i, v_i = keys.index_select(1, slots), values.index_select(1, slots)
            qg = q[i].reshape(nkv, nq // nkv, hd) * scale
            p = torch.softmax(torch.matmul(qg, k_i.transpose(1, 2)), dim=-1)  # [nkv, group, slots]
            out[i] = torch.matmul(p, v_i).reshape(-1)
        return out


def fused_layers(config: ModelConfig, kernels: CpuKernels, layers: Sequence[LayerWeights]) -> FusedLayers:
    """A model's decoder layers described once for the fused path's one kernel call."""
    return FusedLayers(
        kernels,
        layers,
        [config.is_sliding(i) for i in range(len(layers))],
        dim=config.hidden_size,
        inter=config.intermediate_size,
        heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        eps=config.rms_norm_eps,
        activation=config.activation,
        q_mult=query_multiplier(config),
    )


def usable_kernels(config: ModelConfig, dtype: torch.dtype, kernels: CpuKernels | None) -> CpuKernels | None:
    """`kernels` where they serve this model's linears (widths that are multiples of 32; head_dim
    is checked for attention apart), else None; either way, a warning where torch ops serve it."""
    if kernels is not None and not kernels.supports(config.hidden_size, config.intermediate_size, config.q_size, 32):
        logger.warning(
            "tokenleap kernels need widths that are multiples of 32; using torch ops for this model "
            "(slower, not row-invariant)"
        )
        kernels = None
    if kernels is None and dtype == torch.bfloat16 and not config.plain_llama:
        logger.warning("no tokenleap kernels: %s runs on torch ops (slower, not row-invariant)", config.architecture)
    return kernels


def kv_cache_dtype(
    name: str, default: torch.dtype, blocked: bool, head_dim: int, kernels: CpuKernels | None
) -> torch.dtype:
    """The KV cache's dtype for a `kv_cache_type` ("auto", llama.cpp's "f16" taken as "bf16",
    "bf16", "q8_0"): a clear error where this model or machine cannot have it."""
    name = {"f16": "bf16", "bfloat16": "bf16", "q8": "q8_0"}.get(name, name)
    if name == "auto":
        return default
    if name not in KV_CACHE_TYPES:
        raise TokenleapError(f"unknown KV cache type {name!r}: tokenleap has {', '.join(['auto', *KV_CACHE_TYPES])}")
    if not blocked:
        why = (
            "no tokenleap kernels on this machine"
            if kernels is None
            else "the model runs in float32 or its head dim has no blocked attention"
        )
        raise TokenleapError(f"a {name} KV cache needs the kernels' blocked attention over a bfloat16 model ({why})")
    if name == "q8_0" and head_dim % 32:
        raise TokenleapError(f"a q8_0 KV cache needs a head dim that is a multiple of 32 (this model's is {head_dim})")
    return KV_CACHE_TYPES[name]


# Rotary tables are precomputed up to this many positions (a 128k-context model would otherwise
# spend hundreds of MB on them); the model's context is limited to it.
MAX_ROPE_TABLE = 32768
ROPE_TABLE_START = 4096  # rotary rows built at load; more on demand, doubling


def window_mask(mask: AttentionMask, start: int, positions: torch.Tensor, window: int) -> AttentionMask:
    """`mask` restricted to a sliding window: a row at position p sees slots of positions
    > p - window (cached slot i holds position i; new rows hold `positions`)."""
    n = int(positions.shape[0])
    end = start + n
    base = mask.mask if mask.mask is not None else torch.ones(n, end, dtype=torch.bool).tril(start)
    slot_pos = torch.cat([torch.arange(start), positions])
    return AttentionMask(base & ((positions.unsqueeze(1) - slot_pos.unsqueeze(0)) < window))
