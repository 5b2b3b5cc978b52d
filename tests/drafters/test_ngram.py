"""Prompt lookup (ngram) drafter: exact proposals on hand-made contexts and agreement with a brute-force search."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from tokenleap.drafters.base import Draft, Drafter
from tokenleap.drafters.ngram import NgramDrafter, longest_suffix_match


def propose(context: Sequence[int], max_tokens: int = 8, n_min: int = 1, n_max: int = 4) -> list[int]:
    draft = NgramDrafter(n_min, n_max).propose("r", list(context), max_tokens)
    assert isinstance(draft, Draft)
    assert draft.probs is None and draft.parents is None  # deterministic chain
    return draft.tokens


def test_repeating_pattern_proposes_its_continuation() -> None:
    assert propose([1, 2, 3, 1, 2, 3, 1, 2], max_tokens=3) == [3, 1, 2]


def test_continuation_stops_at_the_end_of_the_context() -> None:
    # the match [2,3,1,2] at 1..4 is followed by only 3 tokens before the context ends
    assert propose([1, 2, 3, 1, 2, 3, 1, 2], max_tokens=8) == [3, 1, 2]


def test_no_match_proposes_nothing() -> None:
    assert propose([1, 2, 3, 4, 5]) == []


@pytest.mark.parametrize(("context", "expected"), [([7, 8, 9], []), ([5, 5], [5]), ([4, 6, 4, 6], [4, 6])])
def test_suffix_is_never_its_own_match(context: list[int], expected: list[int]) -> None:
    assert propose(context) == expected


def test_most_recent_occurrence_wins() -> None:
    # suffix [4] occurs at 0 (followed by 5) and at 3 (followed by 7): the later one counts
    assert propose([4, 5, 6, 4, 7, 4], max_tokens=2) == [7, 4]
    assert propose([4, 5, 6, 4, 7, 4], max_tokens=1) == [7]


def test_longer_ngram_preferred_over_more_recent_shorter_one() -> None:
    # suffix [1,2] matches at 0 (-> 9); the shorter suffix [2] matches more recently at 4 (-> 8)
    context = [1, 2, 9, 3, 2, 8, 1, 2]
    assert propose(context, max_tokens=2) == [9, 3]
    assert propose(context, max_tokens=2, n_max=1) == [8, 1]


def test_prompt_lookup_max_limits_the_ngram_length() -> None:
    # with n_max=2 the 3-gram [5,1,2] (-> 7) is not tried; the 2-gram [1,2] last seen before 8 wins
    context = [5, 1, 2, 7, 0, 1, 2, 8, 5, 1, 2]
    assert propose(context, max_tokens=1, n_max=3) == [7]
    assert propose(context, max_tokens=1, n_max=2) == [8]


def test_prompt_lookup_min_is_respected() -> None:
    context = [1, 2, 3, 4, 2]  # only a 1-token match ([2] -> 3, 4, 2)
    assert propose(context, n_min=1) == [3, 4, 2]
    assert propose(context, n_min=2) == []


def test_max_tokens_truncates() -> None:
    context = list(range(10)) + [0]
    assert propose(context, max_tokens=4) == [1, 2, 3, 4]
    assert propose(context, max_tokens=1) == [1]
    assert propose(context, max_tokens=0) == []


@pytest.mark.parametrize("context", [[], [3]])
def test_empty_or_single_token_context_proposes_nothing(context: list[int]) -> None:
    assert propose(context) == []


def test_proposes_python_ints() -> None:
    tokens = propose(np.array([10, 20, 10], dtype=np.int32).tolist())
    assert tokens == [20, 10]
    assert all(type(t) is int for t in tokens)


def test_longest_suffix_match_returns_continuation_start_and_n() -> None:
    arr = np.array([1, 2, 3, 1, 2, 3, 1, 2])
    assert longest_suffix_match(arr, 1, 4) == (5, 4)
    assert longest_suffix_match(arr, 1, 2) == (5, 2)  # [1,2] last seen at 3..4
    assert longest_suffix_match(np.array([1, 2, 3]), 1, 4) is None


def test_is_a_stateless_drafter() -> None:
    drafter = NgramDrafter()
    assert isinstance(drafter, Drafter)
    assert drafter.name == "ngram" and drafter.needs_hidden_states is False
    assert (drafter.n_min, drafter.n_max) == (1, 4)
    drafter.accept("r", [1, 2], 1)  # lifecycle calls are no-ops and do not change proposals
    drafter.end("r")
    assert drafter.propose("r", [1, 2, 3, 1, 2], 2).tokens == [3, 1]


def _brute_force(context: Sequence[int], max_tokens: int, n_min: int, n_max: int) -> list[int]:
    """Obvious quadratic prompt lookup: longest n first, latest earlier occurrence first."""
    length = len(context)
    if max_tokens <= 0 or length < 2:
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = list(context[length - n :])
        for start in range(length - n - 1, -1, -1):  # excludes the suffix itself (start length-n)
            if list(context[start : start + n]) == suffix:
                return list(context[start + n : start + n + max_tokens])
    return []


def test_matches_brute_force_on_random_contexts() -> None:
    rng = random.Random(7)
    nonempty = 0
    for _ in range(2000):
        alphabet = rng.randint(1, 6)
        context = [rng.randrange(alphabet) for _ in range(rng.randint(0, 40))]
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        max_tokens = rng.randint(0, 10)
        expected = _brute_force(context, max_tokens, n_min, n_max)
        assert propose(context, max_tokens, n_min, n_max) == expected, (context, max_tokens, n_min, n_max)
        nonempty += bool(expected)
    assert nonempty > 500  # the random contexts exercised real matches
