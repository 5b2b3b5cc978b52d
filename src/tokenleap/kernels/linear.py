"""`Linear`: one weight matrix `[out, in]` of a model, kept in the one form its forwards read.

A linear is dense (a bf16 or fp32 tensor: the torch path, fp32 models, kernels without the packed
bf16 linear), packed bf16 (`PackedWeight`: the kernels' output-interleaved layout) or GGUF blocks
(`QuantWeight`: the file's exact values, repacked for the quantized kernels). Whatever the form,
a caller asks the same questions (`out_dim`, `in_dim`, `nbytes`) and hands the value as it is to
`CpuKernels.linear` and to the fused layers' descriptors (`kernels/fused.py`); `dense` gives the
`[out, in]` tensor where torch needs one (exactly: unpacking is a permutation, dequantizing gives
the values the kernels multiply by). The one weight per matrix, as nano-vllm's `layers/linear.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenleap.kernels.formats import PackedWeight, QuantWeight

LinearWeight = torch.Tensor | PackedWeight | QuantWeight  # the forms a `Linear` holds


@dataclass(frozen=True, eq=False)
class Linear:
    """A weight matrix `[out, in]`: dense, packed bf16 or quantized (module docstring)."""

    weight: LinearWeight

    def __post_init__(self) -> None:
        if isinstance(self.weight, torch.Tensor) and self.weight.dim() != 2:
            raise ValueError(f"a dense linear is [out, in], got a tensor of shape {tuple(self.weight.shape)}")

    @property
    def out_dim(self) -> int:
        w = self.weight
        return int(w.shape[0]) if isinstance(w, torch.Tensor) else w.out_dim

    @property
    def in_dim(self) -> int:
        w = self.weight
        return int(w.shape[1]) if isinstance(w, torch.Tensor) else w.in_dim

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as kept (what a forward streams of it)."""
        w = self.weight
        if isinstance(w, QuantWeight):
            return w.nbytes
        t = w if isinstance(w, torch.Tensor) else w.data
        return t.numel() * t.element_size()

    @property
    def quantized(self) -> QuantWeight | None:
        """The GGUF blocks, when it is kept in them."""
        return self.weight if isinstance(self.weight, QuantWeight) else None

    @property
    def packed(self) -> PackedWeight | None:
        """The packed bf16 weight, when it is kept packed."""
        return self.weight if isinstance(self.weight, PackedWeight) else None

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The `[out, in]` tensor (in `dtype` when given): the weight itself when it is dense, else
        unpacked (bf16) or dequantized (float32 values, exactly the kernels')."""
        w = self.weight
        if isinstance(w, PackedWeight):
            t = w.unpack()
        elif isinstance(w, QuantWeight):
            t = w.dequantize()
        else:
            t = w
        return t if dtype is None or t.dtype == dtype else t.to(dtype)
