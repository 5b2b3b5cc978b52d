"""llama.cpp's n-gram map drafters on hand-made token sequences: `ngram-simple` (the most recent
match), `ngram-map-k` (min hits, acceptance feedback), `ngram-map-k4v` (four values per key,
dominance), incremental indexing, and the registry's wiring of the configured sizes."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tokenleap import SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.drafters.base import Drafter, DraftRequest
from tokenleap.drafters.ngram_map import NgramMapK4VDrafter, NgramMapKDrafter, NgramSimpleDrafter
from tokenleap.sampling import SamplingParams


def propose(drafter: Drafter, context: Sequence[int], max_tokens: int = 16) -> list[int]:
    drafter.begin(DraftRequest("r", list(context), SamplingParams(temperature=0.0), torch.Generator()))
    draft = drafter.propose("r", list(context), max_tokens)
    assert draft.parents is None and draft.probs is None  # deterministic chains
    return draft.tokens


# --------------------------------------------------------------------------- ngram-simple


def test_simple_drafts_what_followed_the_most_recent_match() -> None:
    assert propose(NgramSimpleDrafter(3, 16), [1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1, 2, 3]
    assert propose(NgramSimpleDrafter(3, 16), [1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3]) == [8, 1, 2, 3]
    assert propose(NgramSimpleDrafter(3, 2), [1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5]  # m caps the draft
    assert propose(NgramSimpleDrafter(3, 16), [1, 2, 3, 4, 5, 1, 2, 3], max_tokens=1) == [4]


def test_simple_needs_the_whole_key() -> None:
    assert propose(NgramSimpleDrafter(3, 16), [9, 2, 3, 4, 1, 2, 3]) == []  # only (2, 3) matches
    assert propose(NgramSimpleDrafter(2, 16), [9, 2, 3, 4, 1, 2, 3]) == [4, 1, 2, 3]
    assert propose(NgramSimpleDrafter(3, 16), [1, 2, 3]) == []
    assert propose(NgramSimpleDrafter(3, 16), [1, 2, 3, 1, 2, 3], max_tokens=0) == []


# --------------------------------------------------------------------------- ngram-map-k


def test_map_k_drafts_after_the_most_recent_occurrence() -> None:
    assert propose(NgramMapKDrafter(3, 16, 1), [1, 2, 3, 8, 1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2, 3]
    assert propose(NgramMapKDrafter(3, 2, 1), [1, 2, 3, 8, 1, 2, 3, 9, 1, 2, 3]) == [9, 1]
    assert propose(NgramMapKDrafter(3, 16, 1), [1, 2, 3, 4, 5]) == []


def test_map_k_min_hits_counts_occurrences_followed_by_the_same_mgram() -> None:
    same = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3]
    differ = [1, 2, 3, 8, 1, 2, 3, 9, 1, 2, 3]
    assert propose(NgramMapKDrafter(3, 16, 2), same) == [9, 1, 2, 3]
    assert propose(NgramMapKDrafter(3, 16, 3), same) == []
    assert propose(NgramMapKDrafter(3, 16, 2), differ) == []


def test_map_k_caps_the_next_draft_from_a_key_after_a_short_acceptance() -> None:
    drafter = NgramMapKDrafter(2, 16, 1)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert propose(drafter, context) == [3, 4, 5, 6, 7, 8, 1, 2]
    drafter.accept("r", [3, 4], 1)  # one draft token accepted
    assert drafter.propose("r", context, 16).tokens == [3, 4, 5]  # accepted + 2
    drafter.end("r")
    assert "r" not in drafter._index


def test_map_k_indexes_new_tokens_incrementally() -> None:
    drafter = NgramMapKDrafter(2, 16, 1)
    assert propose(drafter, [5, 6]) == []
    assert drafter.propose("r", [5, 6, 7, 5, 6], 4).tokens == [7, 5, 6]
    assert drafter._index["r"].indexed == 5


# --------------------------------------------------------------------------- ngram-map-k4v


def test_k4v_drafts_a_value_seen_min_hits_times() -> None:
    context = [1, 2, 3, 4] * 3 + [1, 2]  # (1, 2) -> (3, 4) three times
    assert propose(NgramMapK4VDrafter(2, 2, 2), context) == [3, 4]
    assert propose(NgramMapK4VDrafter(2, 2, 3), context) == [3, 4]
    assert propose(NgramMapK4VDrafter(2, 2, 4), context) == []
    assert propose(NgramMapK4VDrafter(2, 2, 2), context, max_tokens=1) == [3]


def test_k4v_needs_a_dominant_value() -> None:
    two_to_one = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 0, 1, 2]  # (3, 4) twice, (5, 6) once
    three_to_one = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 4, 0, 1, 2]
    assert propose(NgramMapK4VDrafter(2, 2, 2), two_to_one) == []  # not more than twice as often
    assert propose(NgramMapK4VDrafter(2, 2, 2), three_to_one) == [3, 4]


def test_k4v_indexes_only_complete_mgrams() -> None:
    drafter = NgramMapK4VDrafter(2, 3, 1)
    assert propose(drafter, [1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    table = drafter._tables["r"]
    assert table.indexed == 2  # keys starting at 0 and 1 have a full 3-token value after them


def test_k4v_keeps_at_most_four_values_per_key() -> None:
    drafter = NgramMapK4VDrafter(1, 1, 1)
    context = [7, 1, 7, 1, 7, 2, 7, 3, 7, 4, 7, 5, 7]  # 7 -> 1 (twice), then 2, 3, 4, 5
    assert propose(drafter, context) == []  # 1 (count 2) does not dominate
    values = drafter._tables["r"].values[(7,)]
    assert len(values) == 4 and values[(1,)] == 2 and (5,) in values  # a rarest one made room


def test_k4v_keeps_the_accepted_length_per_key_and_value_and_caps_the_next_draft() -> None:
    """llama.cpp's per-(key, value) `n_accepted`: m until a draft is verified, then the accepted
    length of its last draft, which caps the next draft from it (here: plus 2)."""
    drafter = NgramMapK4VDrafter(2, 6, 2)
    context = [1, 2, 3, 4, 5, 6, 7, 8] * 3 + [1, 2]  # (1, 2) -> (3, 4, 5, 6, 7, 8) three times
    value = (3, 4, 5, 6, 7, 8)
    assert propose(drafter, context) == [3, 4, 5, 6, 7, 8]  # no statistics yet: the whole m-gram
    table = drafter._tables["r"]
    assert table.accepted == {}
    drafter.accept("r", [3, 9], 1)  # one token of it accepted
    assert table.accepted == {((1, 2), value): 1}
    assert drafter.propose("r", context, 16).tokens == [3, 4, 5]  # accepted + 2
    drafter.accept("r", [3, 4, 5, 6], 3)  # all three accepted
    assert table.accepted[(1, 2), value] == 3
    assert drafter.propose("r", context, 16).tokens == [3, 4, 5, 6, 7]
    drafter.accept("r", [3, 4, 5, 6, 7, 8], 5)
    assert drafter.propose("r", context, 16).tokens == [3, 4, 5, 6, 7, 8]  # m still caps it
    # the draft verified was another chain member's (its tokens were committed, not ours): only
    # what the committed tokens confirm of this drafter's draft counts
    drafter.accept("r", [9, 9, 9, 9], 3)
    assert table.accepted[(1, 2), value] == 0
    assert drafter.propose("r", context, 16).tokens == [3, 4]
    drafter.accept("r", [7], 0)  # a step without a draft from it (nothing proposed before): no change
    drafter.propose("r", [5], 16)
    drafter.accept("r", [6], 0)
    assert table.accepted[(1, 2), value] == 0
    drafter.end("r")
    assert "r" not in drafter._tables


def test_k4v_a_replaced_value_loses_its_statistics() -> None:
    drafter = NgramMapK4VDrafter(1, 1, 1)
    propose(drafter, [7, 1, 7])  # 7 -> 1 once: drafted
    table = drafter._tables["r"]
    drafter.accept("r", [2], 0)
    assert table.accepted == {((7,), (1,)): 0}
    # four more values after 7: the table is full at (2,), (3,), (4,); (5,) replaces the first of the rarest, (1,)
    assert drafter.propose("r", [7, 1, 7, 2, 7, 3, 7, 4, 7, 5, 7], 4).tokens == []  # none dominates
    assert set(table.values[(7,)]) == {(2,), (3,), (4,), (5,)} and table.accepted == {}


# --------------------------------------------------------------------------- registry


def test_registry_builds_the_family_with_configured_sizes() -> None:
    registry = default_registry()
    cfg = dict(ngram_size_n=2, ngram_size_m=5, ngram_min_hits=3)
    simple = registry.create("ngram-simple", SpecConfig("ngram-simple", **cfg))
    map_k = registry.create("ngram-map-k", SpecConfig("ngram-map-k", **cfg))
    k4v = registry.create("ngram-map-k4v", SpecConfig("ngram-map-k4v", **cfg))
    assert isinstance(simple, NgramSimpleDrafter) and (simple.size_n, simple.size_m) == (2, 5)
    assert isinstance(map_k, NgramMapKDrafter) and (map_k.size_n, map_k.size_m, map_k.min_hits) == (2, 5, 3)
    assert isinstance(k4v, NgramMapK4VDrafter) and (k4v.size_n, k4v.size_m, k4v.min_hits) == (2, 5, 3)
    # min hits left unset: each drafter's own default (k4v: two hits to call a value dominant);
    # one given is used as given, never raised behind the user's back (llama.cpp's k4v takes 1)
    unset = registry.create("ngram-map-k4v", SpecConfig("ngram-map-k4v"))
    assert isinstance(unset, NgramMapK4VDrafter) and unset.min_hits == NgramMapK4VDrafter.DEFAULT_MIN_HITS == 2
    map_k = registry.create("ngram-map-k", SpecConfig("ngram-map-k"))
    assert isinstance(map_k, NgramMapKDrafter) and map_k.min_hits == NgramMapKDrafter.DEFAULT_MIN_HITS == 1
    low = registry.create(
        "ngram-map-k4v", SpecConfig("ngram-map-k4v", ngram_size_n=2, ngram_size_m=2, ngram_min_hits=1)
    )
    assert isinstance(low, NgramMapK4VDrafter) and low.min_hits == 1
    assert propose(low, [1, 2, 3, 4, 1, 2]) == [3, 4]  # a value seen once drafts, as in llama.cpp


def test_min_hits_help_tells_the_drafters_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    import pytest

    from tokenleap.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        f"(default: ngram-map-k {NgramMapKDrafter.DEFAULT_MIN_HITS}, "
        f"ngram-map-k4v {NgramMapK4VDrafter.DEFAULT_MIN_HITS})"
        in help_text
    ), help_text
