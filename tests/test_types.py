"""Output records: vLLM-shaped fields and derived throughput metrics."""

from __future__ import annotations

import pytest

from tokenleap.types import CompletionOutput, RequestMetrics, RequestOutput


def test_decode_tokens_per_second_excludes_first_token() -> None:
    m = RequestMetrics(arrival_time=0.0, prefill_seconds=0.5, decode_seconds=2.0, num_generation_tokens=11)
    assert m.decode_tokens_per_second == pytest.approx(5.0)
    assert m.tokens_per_second == pytest.approx(11 / 2.5)


@pytest.mark.parametrize(("decode", "tokens"), [(0.0, 10), (1.0, 1), (1.0, 0)])
def test_degenerate_rates_are_zero(decode: float, tokens: int) -> None:
    m = RequestMetrics(arrival_time=0.0, decode_seconds=decode, num_generation_tokens=tokens)
    assert m.decode_tokens_per_second == 0.0


def test_tokens_per_second_without_time() -> None:
    assert RequestMetrics(arrival_time=0.0, num_generation_tokens=3).tokens_per_second == 0.0


def test_request_output_shape() -> None:
    out = RequestOutput("r1", "hi", [1, 2], [CompletionOutput(0, "yo", [5], "stop", "\n")], True)
    assert out.outputs[0].text == "yo" and out.outputs[0].stop_reason == "\n"
    assert out.metrics.arrival_time == 0.0
