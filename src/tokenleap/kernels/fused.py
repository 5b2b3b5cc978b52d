"""A whole forward's decoder layers in one kernel call (`tl_forward_layers`, forward.h).

The fused path (the Llama block and its descendants: Qwen2's biases, Qwen3's QK-norm, Mistral's
sliding window, Gemma 3's QK-norm with a query scale, post-norms, GeGLU and interleaved local and
global layers with their own rope tables) makes five to seven kernel calls per layer (QKV linear
with its RMSNorm, QK-norm when the model has it, attention, output linear with the residual add
or with a post-norm and the add, gate/up linear with its RMSNorm, down linear with the gate and
the residual add, likewise): ~150 a decode step of the default model, ~240 of Gemma 3 4B, each
paying ~4-10 us of Python and ctypes outside the kernel. `FusedLayers` describes a model's layers
once, as C structs of weight addresses, kinds and formats; `FusedLayers.run` then fills one struct
with a forward's buffers and its attention plan and makes a single call, in which C makes the same
kernel calls in the same order on the same inputs, so the result is bit-identical to the per-call
loop. A layer is read as it is (`FusedLayer`: its four `Linear`s and its norms;
`models.layers.LayerWeights` is one).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Protocol

import torch

from tokenleap.kernels import CpuKernels, Linear, PackedWeight, QuantWeight, RowPlan
from tokenleap.kernels.abi import LIN_BF16, LIN_F32, LIN_PACKED, LIN_QUANT, AttnDesc, ForwardDesc, LayerDesc, LinDesc

_p = ctypes.c_void_p


class FusedLayer(Protocol):
    """What the fused path reads of a decoder layer: the four linears (each a `Linear`:
    `QuantWeight`, `PackedWeight` or a contiguous bf16 / fp32 `[out, in]` tensor), the QKV bias
    (fp32 `[qkv out]` or None), the pre-norms (fp32 `[dim]`), QK-norm (fp32 `[head_dim]`: both or
    neither) and post-norms (fp32 `[dim]`: both or neither)."""

    @property
    def wqkv(self) -> Linear: ...
    @property
    def bqkv(self) -> torch.Tensor | None: ...
    @property
    def wo(self) -> Linear: ...
    @property
    def w_gate_up(self) -> Linear: ...
    @property
    def w_down(self) -> Linear: ...
    @property
    def attn_norm(self) -> torch.Tensor: ...
    @property
    def mlp_norm(self) -> torch.Tensor: ...
    @property
    def q_norm(self) -> torch.Tensor | None: ...
    @property
    def k_norm(self) -> torch.Tensor | None: ...
    @property
    def post_attn_norm(self) -> torch.Tensor | None: ...
    @property
    def post_mlp_norm(self) -> torch.Tensor | None: ...


class FusedLayers:
    """The C description of a model's decoder layers (weights stay owned by the model; this
    keeps references to every tensor it points at). Build once, `run` per forward; a model made
    of the first n layers (`LlamaModel.with_layers`) runs with `layers=n`."""

    def __init__(
        self,
        kernels: CpuKernels,
        layers: Sequence[FusedLayer],
        local: Sequence[bool] = (),
        *,
        dim: int,
        inter: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        activation: str = "silu",
        q_mult: float | None = None,
    ) -> None:
        """`layers`: the decoder layers (`FusedLayer`); `local[i]`: layer i is a sliding-window
        one (`run`'s `local` plan and rope tables; absent: global). `activation`: the MLP's gate
        ("silu" or "gelu_tanh"); `q_mult`: the queries' factor after their QK-norm (the layers
        then need QK-norm)."""
        if not hasattr(kernels.lib, "tl_forward_layers"):
            raise ValueError("these kernels have no tl_forward_layers")
        self.kernels = kernels
        self.dim, self.inter, self.heads, self.kv_heads, self.head_dim, self.eps = (
            dim, inter, heads, kv_heads, head_dim, eps
        )
        self.glu = kernels._glu_kind(activation)
        self.q_mult = 1.0 if q_mult is None else float(q_mult)
        self.has_local = False  # whether some layer is a sliding-window one (`run` needs `local`)
        self.post_norms = False  # whether some layer has post-norms (needs the `acc` buffer)
        self.qkv_out = (heads + 2 * kv_heads) * head_dim
        self._keep: list[torch.Tensor] = []
        self._descs = (LayerDesc * len(layers))()
        self.dense = False  # whether some linear is a plain tensor (needs the `acc` buffer)
        self.formed = False  # whether some linear forms its input outside its call (needs `tmp`)
        for i, (desc, layer) in enumerate(zip(self._descs, layers)):
            desc.qkv = self._lin(layer.wqkv, layer.bqkv, self.qkv_out, dim)
            desc.wo = self._lin(layer.wo, None, dim, heads * head_dim)
            desc.gate_up = self._lin(layer.w_gate_up, None, 2 * inter, dim)
            desc.down = self._lin(layer.w_down, None, dim, inter)
            desc.attn_norm = self._hold(layer.attn_norm, dim)
            desc.mlp_norm = self._hold(layer.mlp_norm, dim)
            q_norm, k_norm = layer.q_norm, layer.k_norm
            if (q_norm is None) != (k_norm is None):
                raise ValueError("fused layers: QK-norm needs both q_norm and k_norm")
            if q_norm is not None:
                desc.q_norm, desc.k_norm = self._hold(q_norm, head_dim), self._hold(k_norm, head_dim)
            elif self.q_mult != 1.0:
                raise ValueError("fused layers: a query multiplier needs QK-norm")
            post_attn, post_mlp = layer.post_attn_norm, layer.post_mlp_norm
            if (post_attn is None) != (post_mlp is None):
                raise ValueError("fused layers: post-norms need both post_attn_norm and post_mlp_norm")
            if post_attn is not None:
                desc.post_attn_norm, desc.post_mlp_norm = self._hold(post_attn, dim), self._hold(post_mlp, dim)
                self.post_norms = True
            desc.local = int(i < len(local) and bool(local[i]))
            self.has_local = self.has_local or bool(desc.local)

    def _hold(self, t: object, size: int) -> int:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (size,):
            raise ValueError(f"fused layers: expected an fp32 [{size}] tensor")
        t = t.contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _lin(self, linear: Linear, bias: torch.Tensor | None, out_dim: int, in_dim: int) -> LinDesc:
        d = LinDesc(out_dim=out_dim, bias=self._hold(bias, out_dim) if bias is not None else None)
        w = linear.weight
        if isinstance(w, QuantWeight):
            if (w.out_dim, w.in_dim) != (out_dim, in_dim):
                raise ValueError(
                    f"fused layers: {w.name} weight [{w.out_dim}, {w.in_dim}], expected [{out_dim}, {in_dim}]"
                )
            d.kind, d.format, d.w = LIN_QUANT, w.format, w.data.data_ptr()
            self._keep.append(w.data)
        elif isinstance(w, PackedWeight):
            if (w.out_dim, w.in_dim) != (out_dim, in_dim):
                raise ValueError(
                    f"fused layers: packed weight [{w.out_dim}, {w.in_dim}], expected [{out_dim}, {in_dim}]"
                )
            d.kind, d.w = LIN_PACKED, w.data.data_ptr()
            self._keep.append(w.data)
            self.formed = True
        elif (
            isinstance(w, torch.Tensor) and w.dtype in (torch.bfloat16, torch.float32) and w.shape == (out_dim, in_dim)
        ):
            w = w.contiguous()
            d.kind, d.w = (LIN_BF16 if w.dtype == torch.bfloat16 else LIN_F32), w.data_ptr()
            self._keep.append(w)
            self.dense = self.formed = True
        else:
            raise ValueError(f"fused layers: unsupported weight for [{out_dim}, {in_dim}]: {type(w).__name__}")
        return d

    def run(
        self,
        x: torch.Tensor,
        plan: RowPlan,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        layers: int | None = None,
        return_hidden: Sequence[int] = (),
        local: tuple[RowPlan, torch.Tensor, torch.Tensor] | None = None,
    ) -> dict[int, torch.Tensor]:
        """Every layer (or the first `layers`) over the fp32 residual stream `x` `[rows, dim]`,
        in place; K/V go to the plan's cache slots (not committed). `local`: the sliding-window
        layers' plan (the same rows, their window's slot bounds) and rope tables (cos, sin);
        None: theirs are the global ones. Returns the residual stream after each layer in
        `return_hidden` (copies)."""
        n_layers = len(self._descs) if layers is None else layers
        rows = int(x.shape[0])
        if not x.is_contiguous() or x.dtype != torch.float32 or x.shape[1] != self.dim or rows != plan.rows:
            raise ValueError(f"fused layers: x {tuple(x.shape)} {x.dtype} does not fit [{plan.rows}, {self.dim}] fp32")
        if not 0 < n_layers <= len(self._descs):
            raise ValueError(f"fused layers: {n_layers} layers of {len(self._descs)}")
        kernels = self.kernels
        hd = self.head_dim
        wide = max(self.dim, self.inter, self.heads * hd)
        f = ForwardDesc(
            x=x.data_ptr(), rows=rows, dim=self.dim, inter=self.inter, eps=self.eps, q_mult=self.q_mult, glu=self.glu,
            n_layers=n_layers
        )
        f.layers = ctypes.addressof(self._descs)
        qkv = torch.empty(rows, self.qkv_out, dtype=torch.float32)
        a = torch.empty(rows, self.heads * hd, dtype=torch.float32)
        gu = torch.empty(rows, 2 * self.inter, dtype=torch.float32)
        tmp = torch.empty(rows * wide if self.formed else 0, dtype=torch.float32)
        acc = torch.empty(rows * self.dim if self.dense or self.post_norms else 0, dtype=torch.float32)
        f.qkv, f.a, f.gu, f.tmp, f.acc = qkv.data_ptr(), a.data_ptr(), gu.data_ptr(), tmp.data_ptr(), acc.data_ptr()
        # the largest of the linears' scratch needs (tl_linear_q: 7 bytes an input plus 8 per
        # block of 32; tl_linear's bf16 copy: 4 bytes an input)
        f.scratch = kernels._scratch(rows * wide * 7 + 8 * rows * (wide // 32))
        hidden: dict[int, torch.Tensor] = {}
        if return_hidden:
            outs = (_p * n_layers)()
            for i in return_hidden:
                if 0 <= i < n_layers:
                    hidden[i] = torch.empty(rows, self.dim, dtype=torch.float32)
                    outs[i] = hidden[i].data_ptr()
            f.hidden_out = ctypes.addressof(outs)
        # _work: alive for the call
        f.attn, _work = kernels.attention_desc(plan, self.heads, self.kv_heads, hd, cos, sin)
        if self.has_local:  # the struct is read for sliding-window layers only
            f.attn_local, _work_local = self._local_desc(plan, cos, sin, local, f.attn)
        if kernels.lib.tl_forward_layers(ctypes.byref(f)) != 0:
            raise ValueError("fused layers: a layer needs a kernel this build lacks")
        return hidden

    def _local_desc(
        self,
        plan: RowPlan,
        cos: torch.Tensor,
        sin: torch.Tensor,
        local: tuple[RowPlan, torch.Tensor, torch.Tensor] | None,
        desc: AttnDesc,
    ) -> tuple[AttnDesc, object]:
        """The sliding-window layers' attention struct (and its work buffers to keep alive): the
        global one's copy when nothing differs."""
        if local is None or (local[0] is plan and local[1] is cos and local[2] is sin):
            return AttnDesc.from_buffer_copy(desc), None
        lplan, lcos, lsin = local
        if lplan.rows != plan.rows or lplan.blocked != plan.blocked:
            raise ValueError("fused layers: the sliding-window plan must cover the same rows over the same caches")
        return self.kernels.attention_desc(lplan, self.heads, self.kv_heads, self.head_dim, lcos, lsin)
