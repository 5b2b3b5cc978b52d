"""Suffix decoding drafter: exact drafts on hand-made contexts, counts and probabilities against a
brute-force count, the global trie across requests with FIFO eviction, incremental indexing,
and greedy equality with plain decoding on real Spec-Bench prompts."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
import torch

from tokenleap import LLM, SpecConfig
from tokenleap.bench import default_spec_bench
from tokenleap.drafters import default_registry
from tokenleap.drafters.base import Draft, Drafter, DraftRequest
from tokenleap.drafters.suffix import SuffixConfig, SuffixDrafter, SuffixTree
from tokenleap.errors import TokenleapError
from tokenleap.sampling import SamplingParams

SPEC_BENCH = default_spec_bench()  # ../shared/bench beside the checkout, else the shipped subset


def start(drafter: SuffixDrafter, request_id: str, prompt: Sequence[int]) -> None:
    drafter.begin(DraftRequest(request_id, list(prompt), SamplingParams(), torch.Generator()))


def propose(context: Sequence[int], max_tokens: int = 8, **config: float) -> list[int]:
    drafter = SuffixDrafter(SuffixConfig(**config))  # type: ignore[arg-type]
    start(drafter, "r", context)
    draft = drafter.propose("r", list(context), max_tokens)
    assert isinstance(draft, Draft)
    assert draft.parents is None and draft.probs is None  # a deterministic chain
    return draft.tokens


def brute_count(seqs: Sequence[Sequence[int]], path: Sequence[int]) -> int:
    n = len(path)
    return sum(list(s[j : j + n]) == list(path) for s in seqs for j in range(len(s) - n + 1))


# --------------------------------------------------------------------------- drafts


def test_repetition_proposes_its_continuation() -> None:
    draft = propose([1, 2, 3, 1, 2, 3, 1, 2])
    assert draft[0] == 3
    assert draft == [3, 1, 2]  # the earlier occurrence runs into the end of the context


def test_no_match_proposes_nothing() -> None:
    assert propose([5, 6, 5, 6, 9]) == []  # 9 never occurred before


@pytest.mark.parametrize("context", [[7, 8, 9], [7], []])
def test_suffix_is_never_its_own_match(context: list[int]) -> None:
    assert propose(context) == []


def test_max_tokens_caps_the_draft() -> None:
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3
    assert propose(context, max_tokens=3) == [1, 2, 3]
    assert propose(context, max_tokens=0) == []


def test_counts_and_probabilities_on_a_small_example() -> None:
    tree = SuffixTree(max_depth=8)
    seqs = [[1, 2, 1, 3, 1, 2], [1, 2, 4]]
    for i, s in enumerate(seqs):
        tree.insert(i, s)
    assert tree.count([]) == 9  # one suffix per position
    assert tree.count([1]) == 4 and tree.count([1, 2]) == 3 and tree.count([1, 3]) == 1
    assert tree.count([1, 2, 1]) == 1 and tree.count([1, 2, 4]) == 1 and tree.count([2, 2]) == 0
    # from [1]: 2 (3/4), then 1 or 4 (1/3 each; the latest to grow, 4, wins the tie)
    spec = tree.speculate(tree.match([9, 1]), max_tokens=5, max_spec_factor=10, min_token_prob=0.0)
    assert spec.tokens == [2, 4]
    assert spec.probs == pytest.approx([3 / 4, 3 / 4 * 1 / 3])
    assert spec.score == pytest.approx(3 / 4 + 1 / 4) and spec.match_len == 1


def test_the_contexts_own_occurrence_is_left_out_of_the_first_probability() -> None:
    tree = SuffixTree(max_depth=8)
    tree.extend(0, [1, 2, 3, 1, 2])  # [1, 2] occurred twice, once at the live end
    assert tree.count([1, 2]) == 2
    assert tree.speculate(tree.active(0), 3, 8.0, exclude=1).probs == [1.0, 1.0, 1.0]
    assert tree.speculate(tree.active(0), 3, 8.0, exclude=0).probs == [0.5, 0.5, 0.5]


def test_min_token_prob_cuts_the_draft() -> None:
    tree = SuffixTree(max_depth=8)
    for i, s in enumerate([[1, 2, 3, 5], [1, 2, 4, 5], [1, 6, 7]]):
        tree.insert(i, s)
    locs = tree.match([1])
    # 2: 2/3, then 3 or 4: 2/3 * 1/2 = 1/3, then 5: 1/3
    assert tree.speculate(locs, 8, max_spec_factor=8, min_token_prob=0.1).tokens == [2, 4, 5]
    assert tree.speculate(locs, 8, max_spec_factor=8, min_token_prob=0.5).tokens == [2]
    assert tree.speculate(locs, 8, max_spec_factor=8, min_token_prob=0.7).tokens == []


def test_draft_length_is_proportional_to_the_match_length() -> None:
    text = list(range(10, 30))
    context = text + [99, 10, 11]  # the suffix [10, 11] matches the start of `text`
    assert propose(context) == [12, 13]  # match length 2 -> at most 2 tokens
    assert propose(context, max_spec_factor=2.0) == [12, 13, 14, 15]
    assert propose(context, max_spec_factor=2.0, max_spec_offset=1.0) == [12, 13, 14, 15, 16]
    assert propose(context, max_tokens=3, max_spec_factor=2.0) == [12, 13, 14]
    assert propose(context + [12, 13, 14]) == [15, 16, 17, 18, 19]  # match length 5
    assert propose(context, max_spec_factor=1.25) == [12, 13, 14]  # ceil(2.5)


def test_longest_match_wins_over_a_more_frequent_short_one() -> None:
    # [2] is mostly followed by 7, but the longer suffix [1, 2] was followed by 8
    context = [2, 7, 2, 7, 2, 7, 1, 2, 8, 5, 1, 2]
    assert propose(context, max_tokens=2) == [8, 5]


def test_match_near_max_depth_still_drafts() -> None:
    text = list(range(100, 140))
    draft = propose(text + text[:30], max_tokens=8, max_depth=32)
    assert draft == text[30:38]  # a shorter match leaves the trie room to continue


# --------------------------------------------------------------------------- the global trie


def test_global_tree_helps_a_second_request_with_the_same_text() -> None:
    drafter = SuffixDrafter()
    answer = [50 + (i * 7) % 41 for i in range(40)]  # 40 distinct tokens
    start(drafter, "a", [1, 2, 3])
    drafter.propose("a", [1, 2, 3] + answer[:-2], 8)
    drafter.accept("a", answer[-2:], 1)  # the last step's tokens arrive through accept only
    drafter.end("a")
    assert drafter.global_tree.count(answer) == 1

    prompt_b = [4, 5, 6, 7]
    start(drafter, "b", prompt_b)
    assert drafter.propose("b", prompt_b + answer[:4], 8).tokens == answer[4:8]
    assert drafter.propose("b", prompt_b + answer[:36], 8).tokens == answer[36:40]  # to its end

    alone = SuffixDrafter()  # without request a's output there is nothing to go on
    start(alone, "b", prompt_b)
    assert alone.propose("b", prompt_b + answer[:4], 8).tokens == []


def test_prompts_stay_out_of_the_global_tree() -> None:
    drafter = SuffixDrafter()
    start(drafter, "a", [1, 2, 3, 4])
    drafter.propose("a", [1, 2, 3, 4, 9], 8)
    drafter.end("a")
    assert drafter.global_tree.count([9]) == 1 and drafter.global_tree.count([1]) == 0


def test_fifo_eviction_removes_the_oldest_output_and_prunes_its_nodes() -> None:
    drafter = SuffixDrafter(SuffixConfig(max_cached_requests=2))
    outputs = [[1, 2, 3, 1, 2, 4], [5, 6, 1, 2], [7, 1, 2, 3]]
    for out in outputs:
        drafter.cache_output(out)
    tree = drafter.global_tree
    assert len(tree) == 2
    assert tree.count([1, 2, 4]) == 0 and tree.count([3, 1]) == 0  # only in the evicted output
    assert tree.count([1, 2]) == 2 and tree.count([1, 2, 3]) == 1
    fresh = SuffixTree(tree.max_depth)
    for i, out in enumerate(outputs[1:]):
        fresh.insert(i, out)
    assert tree.num_nodes() == fresh.num_nodes()  # no leftover (count 0 or unexpanded) nodes
    for out in outputs[1:]:
        spans = [out[i:j] for i in range(len(out)) for j in range(i + 1, len(out) + 1)]
        assert [tree.count(p) for p in spans] == [fresh.count(p) for p in spans]


def test_no_global_cache_when_disabled() -> None:
    drafter = SuffixDrafter(SuffixConfig(max_cached_requests=0))
    drafter.cache_output([1, 2, 3])
    assert len(drafter.global_tree) == 0


# --------------------------------------------------------------------------- indexing


def test_incremental_indexing_equals_indexing_from_scratch() -> None:
    rng = random.Random(0)
    context = [rng.randrange(6) for _ in range(300)]
    step = SuffixDrafter()
    start(step, "r", context[:50])
    n, drafts = 50, []
    while n < len(context):
        drafts.append((n, step.propose("r", context[:n], 8).tokens))
        n += rng.randint(1, 9)
    step.propose("r", context, 8)
    whole = SuffixTree(64)
    whole.extend(0, context)
    local = step._requests["r"].local
    assert local.sequence(0) == context
    assert local.num_nodes() == whole.num_nodes()
    def shape(tree: SuffixTree) -> list[tuple[int, int]]:
        return [(node.depth, node.count) for node, _ in tree.active(0)]

    assert shape(local) == shape(whole)
    for n, tokens in drafts[::5]:  # each step's draft equals a fresh drafter's on the same context
        assert propose(context[:n]) == tokens


def test_requests_are_indexed_from_the_context_without_begin() -> None:
    drafter = SuffixDrafter()
    assert drafter.propose("r", [1, 2, 3, 1, 2], 4).tokens == [3, 1]
    # a context that does not extend what was indexed is reindexed, not mixed in
    assert drafter.propose("r", [4, 5, 4], 4).tokens == [5]


@pytest.mark.parametrize("seed", range(6))
def test_counts_and_matches_agree_with_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    depth, vocab = rng.randint(2, 7), rng.randint(2, 4)
    tree, seqs, next_id = SuffixTree(depth), {}, 0
    for _ in range(12):
        if rng.random() < 0.6 or not seqs:
            seqs[next_id] = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            tree.insert(next_id, seqs[next_id])
            next_id += 1
        else:
            victim = rng.choice(list(seqs))
            tree.remove(victim)
            del seqs[victim]
        live = list(seqs.values())
        for _ in range(40):
            path = [rng.randrange(vocab) for _ in range(rng.randint(1, depth))]
            assert tree.count(path) == brute_count(live, path)
        context = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        lengths = [node.depth + k for node, k in tree.match(context)]
        assert lengths == [n for n in range(min(depth, len(context)), 0, -1) if brute_count(live, context[-n:])]


def test_a_growing_sequence_must_be_alone_in_its_tree() -> None:
    tree = SuffixTree(8)
    tree.extend(0, [1, 2])
    with pytest.raises(ValueError):
        tree.insert(1, [3])
    other = SuffixTree(8)
    other.insert(0, [1])
    with pytest.raises(ValueError):
        other.extend(1, [2])


# --------------------------------------------------------------------------- configuration


def test_registry_builds_the_drafter_from_spec_config() -> None:
    raw = {"method": "suffix", "suffix_decoding_min_token_prob": 0.3, "suffix_decoding_max_tree_depth": 16}
    config = SpecConfig.from_dict(raw)
    drafter = default_registry().create("suffix", config)
    assert isinstance(drafter, SuffixDrafter) and isinstance(drafter, Drafter)
    assert drafter.name == "suffix" and not drafter.needs_hidden_states
    assert drafter.config.min_token_prob == 0.3 and drafter.global_tree.max_depth == 16


@pytest.mark.parametrize(
    "bad",
    [
        {"suffix_decoding_max_tree_depth": 0},
        {"suffix_decoding_max_spec_factor": -1.0},
        {"suffix_decoding_min_token_prob": 1.5},
        {"suffix_decoding_max_cached_requests": -1},
    ],
)
def test_bad_suffix_options_are_rejected(bad: dict[str, float]) -> None:
    with pytest.raises(TokenleapError, match=next(iter(bad))):
        SpecConfig(method="suffix", **bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the real model


def _bench_prompts() -> list[str]:
    if not SPEC_BENCH.is_file():
        pytest.skip("Spec-Bench questions not present")
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
    first = {}
    for row in rows:
        first.setdefault(row["category"], row["turns"][0])
    return [first["summarization"], first["rag"], first["coding"]]


@pytest.fixture(scope="module")
def suffix_llm() -> LLM:
    import tokenleap

    return tokenleap.LLM(speculative_config={"method": "suffix"})


@pytest.mark.slow
def test_greedy_output_equals_plain_decoding_on_real_prompts(llm: LLM, suffix_llm: LLM) -> None:
    from tokenleap import SamplingParams as Params

    params = Params(temperature=0.0, max_tokens=96)
    lengths = []
    for prompt in _bench_prompts():
        messages = [{"role": "user", "content": prompt}]
        plain = llm.chat(messages, params, use_tqdm=False)[0]
        spec = suffix_llm.chat(messages, params, use_tqdm=False)[0]
        assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
        assert spec.outputs[0].text == plain.outputs[0].text
        lengths.append(spec.metrics.mean_acceptance_length)
    assert max(lengths) > 1.0, lengths
