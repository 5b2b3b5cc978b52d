"""Sampling parameters (validation) and the logits -> probabilities pipeline (temperature, top-k, top-p, min-p,
seeds)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tokenleap.errors import TokenleapError
from tokenleap.sampling import SamplingParams, check_token_ids, logits_to_probs, make_generator, sample_next

# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": "hot"}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0 and finite, got nan"),
        ({"temperature": float("inf")}, "temperature must be >= 0 and finite, got inf"),
        ({"top_p": float("nan")}, "top_p must be in \\(0, 1\\]"),
        ({"min_p": float("nan")}, "min_p must be in \\[0, 1\\]"),
        ({"top_p": 0.0}, "top_p must be in \\(0, 1\\]"),
        ({"top_p": 1.01}, "top_p must be in \\(0, 1\\]"),
        ({"top_p": -0.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"max_tokens": -3}, "max_tokens must be a positive integer"),
        ({"max_tokens": 2.5}, "max_tokens must be a positive integer"),
        ({"top_k": -2}, "top_k must be >= 1"),
        ({"min_p": -0.01}, "min_p must be in \\[0, 1\\]"),
        ({"min_p": 1.5}, "min_p must be in \\[0, 1\\]"),
        ({"stop": ""}, "stop strings must be non-empty"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
    ],
)
def test_sampling_params_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TokenleapError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_valid_edges_and_normalisation() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, max_tokens=1)
    SamplingParams(top_k=0, min_p=0.0, top_p=1e-6)
    p = SamplingParams(stop="END", stop_token_ids=[5, "7"])  # type: ignore[list-item]
    assert p.stop == ("END",)
    assert p.stop_token_ids == (5, 7)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()  # type: ignore[arg-type]
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy
    assert SamplingParams().max_tokens == 16


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 1e-6, 9.9e-6])
def test_temperature_below_epsilon_is_greedy(temperature: float) -> None:
    """As in vLLM, a temperature below 1e-5 means greedy: dividing logits by it would overflow
    to inf and give NaN probabilities."""
    p = SamplingParams(temperature=temperature)
    assert p.greedy
    logits = _logits(3, rows=1)[0]
    assert sample_next(logits, p, make_generator(0)) == int(torch.argmax(logits))


def test_temperature_at_epsilon_samples() -> None:
    p = SamplingParams(temperature=1e-5)
    assert not p.greedy
    probs = logits_to_probs(_logits(4), p)
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(-1), torch.ones(3))


# --------------------------------------------------------------------------- logits_to_probs

VOCAB = 50


def _logits(seed: int = 0, rows: int = 3) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_plain_softmax_with_temperature() -> None:
    logits = _logits()
    for t in (0.5, 1.0, 2.0):
        probs = logits_to_probs(logits, SamplingParams(temperature=t))
        torch.testing.assert_close(probs, (logits / t).softmax(-1))
    # lower temperature sharpens
    sharp = logits_to_probs(logits, SamplingParams(temperature=0.5)).max(-1).values
    flat = logits_to_probs(logits, SamplingParams(temperature=2.0)).max(-1).values
    assert (sharp > flat).all()


@pytest.mark.parametrize("k", [1, 5, 49])
def test_top_k_keeps_exactly_k(k: int) -> None:
    logits = _logits(1)
    probs = logits_to_probs(logits, SamplingParams(top_k=k))
    assert ((probs > 0).sum(-1) == k).all()
    top = logits.topk(k, dim=-1).indices
    kept = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, top, True)
    assert (probs[~kept] == 0).all()
    # renormalised softmax over the kept logits
    expected = logits.masked_fill(~kept, float("-inf")).softmax(-1)
    torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize("k", [0, -1, VOCAB, VOCAB + 10])
def test_top_k_disabled(k: int) -> None:
    probs = logits_to_probs(_logits(2), SamplingParams(top_k=k))
    assert (probs > 0).all()


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 0.999])
def test_top_p_keeps_smallest_prefix_reaching_p(p: float) -> None:
    logits = _logits(3)
    probs = logits_to_probs(logits, SamplingParams(top_p=p))
    full = logits.softmax(-1)
    for row in range(logits.shape[0]):
        sorted_p, order = full[row].sort(descending=True)
        cum = sorted_p.cumsum(0)
        n_keep = int((cum < p).sum()) + 1  # smallest prefix whose mass reaches p
        n_keep = min(n_keep, VOCAB)
        kept = set(order[:n_keep].tolist())
        assert set(probs[row].nonzero().squeeze(1).tolist()) == kept
        assert cum[n_keep - 1] >= p - 1e-6
        if n_keep > 1:
            assert cum[n_keep - 2] < p  # one fewer would not reach p
        torch.testing.assert_close(probs[row, order[:n_keep]], sorted_p[:n_keep] / sorted_p[:n_keep].sum())


def test_top_p_always_keeps_the_top_token() -> None:
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3]])  # top token has ~28% mass
    probs = logits_to_probs(logits, SamplingParams(top_p=0.01))
    assert probs.tolist() == [[0.0, 0.0, 0.0, 1.0]]


def test_min_p_removes_tokens_below_fraction_of_max() -> None:
    logits = _logits(4)
    for min_p in (0.05, 0.2, 0.6):
        probs = logits_to_probs(logits, SamplingParams(min_p=min_p))
        full = logits.softmax(-1)
        keep = full >= min_p * full.max(-1, keepdim=True).values
        assert ((probs > 0) == keep).all()
        torch.testing.assert_close(probs, full * keep / (full * keep).sum(-1, keepdim=True))
    one = logits_to_probs(logits, SamplingParams(min_p=1.0))
    assert ((one > 0).sum(-1) == 1).all()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.3, top_k=7),
        SamplingParams(temperature=1.7, top_p=0.6),
        SamplingParams(top_k=20, top_p=0.8, min_p=0.1),
    ],
)
def test_probabilities_sum_to_one(params: SamplingParams) -> None:
    probs = logits_to_probs(_logits(5, rows=8), params)
    assert probs.shape == (8, VOCAB)
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(8))


def test_processor_order_top_k_before_top_p() -> None:
    """top-p is computed on the top-k renormalised distribution."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    # after top_k=2 the two survivors have mass 0.73 / 0.27; top_p=0.7 keeps only the first
    assert (logits_to_probs(logits, SamplingParams(top_k=2, top_p=0.7)) > 0).sum() == 1
    # without top-k the first token has only 0.64 of the mass: top_p=0.7 keeps two
    assert (logits_to_probs(logits, SamplingParams(top_p=0.7)) > 0).sum() == 2


# --------------------------------------------------------------------------- sampling


def test_greedy_is_argmax_first_on_ties() -> None:
    logits = torch.tensor([0.5, 2.0, -1.0, 2.0])
    assert sample_next(logits, SamplingParams(temperature=0.0), make_generator(0)) == 1


def _draws(seed: int | None, n: int = 40) -> list[int]:
    gen = make_generator(seed)
    logits = torch.zeros(VOCAB)  # uniform: draws are as different as they can be
    return [sample_next(logits, SamplingParams(temperature=1.0), gen) for _ in range(n)]


def test_seeded_sampling_reproducible_and_seeds_differ() -> None:
    assert _draws(123) == _draws(123)
    assert _draws(123) != _draws(124)
    assert len(set(_draws(123))) > 10  # really random, not a constant


def test_unseeded_generators_differ() -> None:
    assert _draws(None) != _draws(None)


def test_sampling_respects_filters() -> None:
    logits = _logits(6, rows=1)[0]
    params = SamplingParams(temperature=1.0, top_k=3)
    allowed = set(logits.topk(3).indices.tolist())
    gen = make_generator(0)
    seen = {sample_next(logits, params, gen) for _ in range(200)}
    assert seen <= allowed and len(seen) >= 2


def test_sampling_frequencies_follow_probabilities() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5])
    params = SamplingParams(temperature=1.0)
    gen = make_generator(7)
    n = 4000
    counts = torch.bincount(torch.tensor([sample_next(logits, params, gen) for _ in range(n)]), minlength=4)
    expected = logits.softmax(0) * n
    # chi-squared with 3 degrees of freedom; 16.27 is the 0.1% critical value (fixed seed: deterministic)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27


def test_check_token_ids() -> None:
    check_token_ids([0, 5, 9], 10)
    with pytest.raises(TokenleapError, match="out of range \\[0, 10\\): \\[10, -1\\]"):
        check_token_ids([3, 10, -1], 10)
