"""The verify cost curve kept on disk (`cached_cost_curve`): measured once per host, model shape,
kernels and threads, then read back; a curve of more rows serves fewer, a damaged or week-old
entry is measured again, and another model shape has its own entry."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import tokenleap.engine.speculation as speculation
from tokenleap.engine.speculation import CostCurve, cached_cost_curve, host_key
from tokenleap.models.llama import LlamaModel


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    caps: list[int] = []

    def fake(model: LlamaModel, cap: int, **kwargs: object) -> CostCurve:
        caps.append(cap)
        return CostCurve(tuple(1.0 + 0.1 * k for k in range(cap + 1)), None, 100, 1000)

    monkeypatch.setattr(speculation, "measure_cost_curve", fake)
    return caps


def test_a_curve_is_measured_once_then_read_from_disk(
    tiny_model: LlamaModel, tmp_path: Path, measured: list[int]
) -> None:
    first = cached_cost_curve(tiny_model, 8, folder=tmp_path)
    assert measured == [8] and len(list(tmp_path.glob("*.json"))) == 1
    again = cached_cost_curve(tiny_model, 4, folder=tmp_path)  # fewer rows: the stored curve serves
    assert measured == [8] and again == first
    cached_cost_curve(tiny_model, 12, folder=tmp_path)  # more rows than stored: measured, and stored
    assert (
        measured == [8, 12]
        and len(cached_cost_curve(tiny_model, 12, folder=tmp_path).relative) == 13
        and measured == [8, 12]
    )


def test_damaged_or_stale_entries_are_measured_again(
    tiny_model: LlamaModel, tmp_path: Path, measured: list[int]
) -> None:
    cached_cost_curve(tiny_model, 4, folder=tmp_path)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text("{not json")
    cached_cost_curve(tiny_model, 4, folder=tmp_path)
    assert measured == [4, 4]
    week_ago = time.time() - speculation.COST_CURVE_MAX_AGE_S - 60
    os.utime(entry, (week_ago, week_ago))
    cached_cost_curve(tiny_model, 4, folder=tmp_path)
    assert measured == [4, 4, 4]


def test_the_key_tells_model_shapes_and_settings_apart(tiny_model: LlamaModel) -> None:
    assert host_key(tiny_model) == host_key(tiny_model)
    assert host_key(tiny_model.with_layers(1)) != host_key(tiny_model)
    assert host_key(tiny_model, ("repeats", 3)) != host_key(tiny_model)
    kernels = tiny_model.kernels
    if kernels is not None and hasattr(kernels.lib, "tl_quant_xb"):  # the tile the load chose
        xb = kernels.quant_xb_rows()
        try:
            before = host_key(tiny_model)
            kernels.quant_xb_rows(0 if xb else 4)
            assert host_key(tiny_model) != before
        finally:
            kernels.quant_xb_rows(xb)


def test_the_real_measurement_attends_over_a_zero_filled_context(tiny_model: LlamaModel) -> None:
    """No prefill: the timed forwards read `context` cached positions of zeros."""
    curve = speculation.measure_cost_curve(tiny_model, 3, contexts=(16, 64), repeats=1)
    assert len(curve.relative) == 4 and curve.long is not None and all(c >= 1.0 for c in curve.relative)
