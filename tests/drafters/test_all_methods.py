"""Every built-in drafter gives greedy output identical to plain decoding on real prompts, and
actually drafts: on a repetitive prompt each method proposes tokens and some are accepted (a
drafter that never proposes would otherwise pass the equality check trivially)."""

from __future__ import annotations

import pytest

from tokenleap import LLM, SamplingParams, SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.drafters.chain import ChainDrafter
from tokenleap.drafters.registry import builtin_methods
from tokenleap.engine.engine import Engine
from tokenleap.types import SpecStats

# The model continues this pattern for the whole answer, so every method has repeated n-grams
# (ngram-map-k4v needs the same 3-gram followed by the same 16 tokens twice) and draft models agree.
REPETITIVE = "Continue the pattern: red, green, blue, red, green, blue, red, green, blue, red, green, blue, red, green,"
PROMPTS = [
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "List the first ten even numbers, separated by commas.",
    REPETITIVE,
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
DRAFT = "smollm2-135m-instruct"  # the default model drafting for itself (always right), or its first 6 layers
# each built-in method's settings here (default: none); the methods not run, each with its reason
SETTINGS: dict[str, list[dict[str, object]]] = {
    "draft-model": [{"model": DRAFT}, {"model": DRAFT, "draft_layers": 6}, {"model": DRAFT, "draft_vocab": 4096}],
}
NOT_RUN = {
    "custom": "an object, not a name (tests/drafters/test_base.py)",
    "chain": "spelled a+b: run as suffix+ngram below",
    "eagle3": "its head: tests/heads/test_eagle3.py (the real model, greedy == plain)",
    "eagle": "no EAGLE-1/2 head ships for the default model: tests/heads/test_eagle1.py (a tiny head)",
    "medusa": "no Medusa head ships for the default model: tests/heads/test_medusa.py (a tiny head)",
    "mtp": "the default model has no MTP layer: tests/heads/test_mtp.py",
}
METHODS = [
    {"method": r.name, **extra}
    for r in builtin_methods()
    if r.name not in NOT_RUN
    for extra in SETTINGS.get(r.name, [{}])
]
METHODS.append({"method": "suffix+ngram"})


def test_every_builtin_method_is_run_or_says_why_not() -> None:
    """A new built-in method joins the greedy == plain check below by its record alone."""
    run = {m["method"] for m in METHODS}
    for record in builtin_methods():
        assert record.name in run or record.name in NOT_RUN, record.name
    assert set(NOT_RUN) <= {r.name for r in builtin_methods()}


def _run(engine: Engine, llm: LLM, prompt: str) -> tuple[list[int], SpecStats]:
    """Output ids and speculation statistics."""
    req = engine.add_request(llm.chat_token_ids([{"role": "user", "content": prompt}]), GREEDY)
    engine.run(req)
    return req.output_ids, req.metrics.spec


@pytest.mark.slow
@pytest.mark.parametrize("raw", METHODS, ids=lambda r: "-".join(str(v) for v in r.values()))
def test_greedy_output_identical_to_plain(llm: LLM, raw: dict[str, object]) -> None:
    cfg = SpecConfig.from_dict({**raw, "adaptive": False, "num_speculative_tokens": 6})
    assert cfg is not None
    drafter = default_registry().create(
        cfg.method, cfg, target=llm.model, tokenizer=llm.tokenizer, target_path=llm.source.path
    )
    spec = Engine(llm.model, llm.tokenizer, spec=cfg, drafter=drafter)
    plain = Engine(llm.model, llm.tokenizer)
    for prompt in PROMPTS:
        expected, _ = _run(plain, llm, prompt)
        got, stats = _run(spec, llm, prompt)
        assert got == expected, f"{cfg.method} changed the greedy output"
        rejected = stats.num_draft_tokens - stats.num_accepted_tokens
        if prompt == REPETITIVE:
            assert stats.num_drafts > 0 and stats.num_draft_tokens > 0, f"{cfg.method} never drafted"
            assert stats.num_accepted_tokens > 0, f"{cfg.method} drafted, but no draft token was accepted"
        if cfg.method == "draft-model" and cfg.draft_layers is None and not cfg.draft_vocab:
            # the target drafting for itself is always right; only draft tokens past the end
            # of the answer (after EOS, in the last draft) go unused (a cut vocabulary misses
            # the tokens outside it)
            assert rejected < cfg.num_speculative_tokens


@pytest.mark.slow
def test_a_chain_asks_its_draftless_member_first_and_prices_its_draft_model(llm: LLM) -> None:
    """`draft-model+ngram-simple` asks ngram-simple first at every step although the draft model
    is named first; the draft model, priced at its weight bytes over the target's (here the
    target drafting for itself: 1.0, a draft that can never beat plain decoding), runs only
    when its expected tokens per cost beat the draft in hand, so here only to probe. Greedy
    output stays the plain output; the members' statistics add up to the chain's."""
    cfg = SpecConfig.from_dict({"method": "draft-model+ngram-simple", "model": "smollm2-135m-instruct",
                                "adaptive": False, "num_speculative_tokens": 6, "ngram_size_n": 2})
    assert cfg is not None and cfg.chain == ("draft-model", "ngram-simple")
    drafter = default_registry().create(
        cfg.method, cfg, target=llm.model, tokenizer=llm.tokenizer, target_path=llm.source.path
    )
    assert isinstance(drafter, ChainDrafter) and drafter.cost_aware and drafter.costs == [1.0, 0.0]
    spec = Engine(llm.model, llm.tokenizer, spec=cfg, drafter=drafter)
    expected, _ = _run(Engine(llm.model, llm.tokenizer), llm, REPETITIVE)
    got, stats = _run(spec, llm, REPETITIVE)
    assert got == expected
    lookup, model = stats.members["ngram-simple"], stats.members["draft-model"]
    assert list(stats.members) == ["draft-model", "ngram-simple"]  # named in the order given
    assert lookup.num_propose_calls == stats.num_propose_calls  # asked at every step, first
    assert model.num_propose_calls <= stats.num_propose_calls // (drafter.probe_every + 1) + 1  # probes only
    assert lookup.num_drafts > 0 and lookup.num_accepted_tokens > 0
    assert lookup.num_drafts + model.num_drafts == stats.num_drafts
    assert lookup.num_accepted_tokens + model.num_accepted_tokens == stats.num_accepted_tokens
