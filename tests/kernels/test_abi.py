"""The kernels' C structs and their ctypes mirrors (kernels/abi.py) agree on sizes and offsets,
and a struct the build cannot serve is refused before any work."""

from __future__ import annotations

import ctypes

import torch

from tokenleap.kernels import CpuKernels
from tokenleap.kernels.abi import AttnDesc, ForwardDesc, LayerDesc, LinDesc


def test_struct_layouts_match_the_library(kernels: CpuKernels) -> None:
    out = (ctypes.c_int64 * 11)()
    assert kernels.lib.tl_abi_layout(out) == 11
    expected = [ctypes.sizeof(LinDesc), ctypes.sizeof(LayerDesc), ctypes.sizeof(AttnDesc), ctypes.sizeof(ForwardDesc),
                AttnDesc.rows.offset, AttnDesc.max_slots.offset, ForwardDesc.attn.offset, ForwardDesc.eps.offset,
                LayerDesc.local.offset, ForwardDesc.glu.offset, ForwardDesc.attn_local.offset]
    assert list(out) == expected


def test_unknown_cache_kind_is_refused(kernels: CpuKernels) -> None:
    out = torch.full((1, 8), 7.0)
    desc = AttnDesc(kv=5, rows=1, heads=1, kv_heads=1, hd=8)
    assert kernels.lib.tl_attention_run(ctypes.byref(desc), torch.zeros(1, 24).data_ptr(), 0, out.data_ptr()) == -1
    assert torch.equal(out, torch.full((1, 8), 7.0))  # untouched
    # a forward whose attention describes other rows than its own: refused before any layer runs
    assert (
        kernels.lib.tl_forward_layers(ctypes.byref(ForwardDesc(rows=2, n_layers=0, glu=1, attn=AttnDesc(kv=0, rows=1))))
        == -1
    )
    assert (
        kernels.lib.tl_forward_layers(ctypes.byref(ForwardDesc(rows=1, n_layers=0, glu=1, attn=AttnDesc(kv=0, rows=1))))
        == 0
    )
    # an unknown MLP gate, and a sliding-window layer whose attention describes other rows
    assert (
        kernels.lib.tl_forward_layers(ctypes.byref(ForwardDesc(rows=1, n_layers=0, glu=3, attn=AttnDesc(kv=0, rows=1))))
        == -1
    )
    layer = (LayerDesc * 1)(LayerDesc(local=1))
    bad_local = ForwardDesc(rows=1, n_layers=1, glu=1, layers=ctypes.addressof(layer), attn=AttnDesc(kv=0, rows=1),
                            attn_local=AttnDesc(kv=0, rows=2))
    assert kernels.lib.tl_forward_layers(ctypes.byref(bad_local)) == -1
