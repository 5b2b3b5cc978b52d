"""The per-host choice of the AVX2 path's many-row tiles (kernels/tiles.py)."""

from __future__ import annotations

import pytest
import torch

from kernel_settings import tile_settings
from tokenleap.kernels import CpuKernels, tiles
from tokenleap.kernels.tiles import TileChoice, choose_tiles, keep_buffered, synthetic_q4k


def test_the_buffered_tiles_stay_unless_they_are_slower_than_the_margin() -> None:
    assert keep_buffered(1.0, 1.0) and keep_buffered(0.7, 1.0) and keep_buffered(1.029, 1.0)
    assert not keep_buffered(1.031, 1.0) and not keep_buffered(1.2, 1.0)
    assert keep_buffered(1.2, 1.0, margin=0.25)


def test_the_synthetic_weight_is_a_q4k_weight_with_finite_products(kernels: CpuKernels) -> None:
    w = synthetic_q4k(64, 512)
    assert (w.name, w.out_dim, w.in_dim) == ("Q4_K", 64, 512)
    y = kernels.linear(torch.randn(8, 512, generator=torch.Generator().manual_seed(1)), w)
    assert y.shape == (8, 64) and bool(torch.isfinite(y).all()) and float(y.abs().max()) > 0


@pytest.mark.parametrize("slower", ["buffered", "group-major"])
def test_it_keeps_the_faster_tile_and_times_each_under_its_own_setting(
    kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch, slower: str
) -> None:
    """With the call timer replaced by one that reads the setting in force, the tile measured
    slower is the one left off, and the times are reported under the right names."""
    if not hasattr(kernels.lib, "tl_quant_xb"):
        pytest.skip("no buffered tiles in this build")

    def timed(k: CpuKernels, *_: object) -> float:
        buffered = k.quant_xb_rows() > 0
        return 2.0 if buffered == (slower == "buffered") else 1.0

    monkeypatch.setattr(tiles, "_fastest_call", timed)
    with tile_settings(kernels, vnni=False, xb_rows=4):
        choice = choose_tiles(kernels)
        assert choice is not None
        if slower == "buffered":
            assert (choice.buffered_ms, choice.group_major_ms, choice.xb_rows) == (2.0, 1.0, 0)
        else:
            assert (choice.buffered_ms, choice.group_major_ms, choice.xb_rows) == (1.0, 2.0, 4)
        assert kernels.quant_xb_rows() == choice.xb_rows


def test_a_real_measurement_sets_what_it_reports(kernels: CpuKernels) -> None:
    """On this host's kernels with VNNI off (the AVX2 path's sums): both tiles timed, the
    setting left as the decision says; with VNNI on there is nothing to choose."""
    if not hasattr(kernels.lib, "tl_quant_xb"):
        pytest.skip("no buffered tiles in this build")
    with tile_settings(kernels, xb_rows=4):
        if kernels.quant_vnni(True):
            assert choose_tiles(kernels) is None and kernels.quant_xb_rows() == 4
        kernels.quant_vnni(False)
        choice = choose_tiles(kernels)
        assert isinstance(choice, TileChoice) and choice.buffered_ms > 0 and choice.group_major_ms > 0
        assert choice.xb_rows == (4 if keep_buffered(choice.buffered_ms, choice.group_major_ms) else 0)
        assert kernels.quant_xb_rows() == choice.xb_rows
        kernels.quant_xb_rows(0)
        assert choose_tiles(kernels) is None  # switched off by hand: left alone
