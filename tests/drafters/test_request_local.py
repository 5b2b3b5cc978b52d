"""Seeded sampled requests are drafted from their own history only (`DraftRequest.request_local`):
drafters with state shared across requests (suffix, ngram-mod, ngram-cache) neither read it for
them nor stop feeding it with them, and on the real model the text of a seeded request does not
depend on what the engine ran before or beside it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tokenleap import LLM, SamplingParams, SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.drafters.base import Drafter, DraftRequest
from tokenleap.drafters.ngram_cache import NgramCacheDrafter
from tokenleap.drafters.ngram_mod import NgramModDrafter
from tokenleap.drafters.suffix import SuffixDrafter
from tokenleap.engine.engine import Engine
from tokenleap.engine.request import Request

SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=40)
UNSEEDED = SamplingParams(temperature=0.8, max_tokens=40)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
SEEDED_GREEDY = SamplingParams(temperature=0.0, seed=7, max_tokens=40)

SHARED_STATE_DRAFTERS = {
    "suffix": SuffixDrafter,
    "ngram-mod": lambda: NgramModDrafter(size_n=3, pool_size=1 << 12),
    "ngram-cache": NgramCacheDrafter,
}


def begin(drafter: Drafter, request_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
    drafter.begin(DraftRequest(request_id, list(prompt), params, torch.Generator()))


def test_request_local_means_seeded_and_sampled() -> None:
    def local(params: SamplingParams) -> bool:
        return DraftRequest("r", [1], params, torch.Generator()).request_local

    assert local(SEEDED)
    assert not local(UNSEEDED) and not local(GREEDY) and not local(SEEDED_GREEDY)


@pytest.mark.parametrize("method", list(SHARED_STATE_DRAFTERS))
def test_seeded_sampled_requests_ignore_other_requests(method: str) -> None:
    """Another request's text is shared with later requests, except seeded sampled ones; the
    seeded request's own text is still shared when it ends."""
    drafter = SHARED_STATE_DRAFTERS[method]()
    earlier = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    begin(drafter, "earlier", [1, 2], GREEDY)
    drafter.propose("earlier", [1, 2, *earlier], 4)
    drafter.end("earlier")
    context = [3, 4, 10, 11, 12, 13]  # ends with an n-gram only the earlier request holds
    drafts = {}
    for name, params in {
        "greedy": GREEDY,
        "unseeded": UNSEEDED,
        "seeded-greedy": SEEDED_GREEDY,
        "seeded": SEEDED,
    }.items():
        begin(drafter, name, context, params)
        drafts[name] = drafter.propose(name, context, 4).tokens
        drafter.end(name)
    assert drafts["greedy"] == drafts["unseeded"] == drafts["seeded-greedy"] == [14, 15, 16, 17]
    assert drafts["seeded"] == []
    # a seeded request's own history still reaches the shared state
    begin(drafter, "seeded-2", [5, 6], SEEDED)
    drafter.propose("seeded-2", [5, 6, 30, 31, 32, 33, 34, 35, 36], 4)
    drafter.end("seeded-2")
    begin(drafter, "reader", [7, 30, 31, 32], GREEDY)
    assert drafter.propose("reader", [7, 30, 31, 32], 3).tokens == [33, 34, 35]


@pytest.mark.parametrize("method", list(SHARED_STATE_DRAFTERS))
def test_seeded_sampled_requests_still_draft_from_their_own_history(method: str) -> None:
    drafter = SHARED_STATE_DRAFTERS[method]()
    context = [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3, 4]
    begin(drafter, "seeded", context, SEEDED)
    assert drafter.propose("seeded", context, 3).tokens == [5, 6, 7]


# --------------------------------------------------------------------------- slow: the real model

PROMPT = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."
OTHER_PROMPTS = ["List the first ten even numbers, separated by commas.", PROMPT]


def _engine(llm: LLM, method: str) -> Engine:
    cfg = SpecConfig(method, num_speculative_tokens=6, adaptive=False)
    drafter = default_registry().create(cfg.method, cfg, target=llm.model, tokenizer=llm.tokenizer)
    return Engine(llm.model, llm.tokenizer, spec=cfg, drafter=drafter)


def _add(engine: Engine, llm: LLM, prompt: str, params: SamplingParams) -> Request:
    return engine.add_request(llm.chat_token_ids([{"role": "user", "content": prompt}]), params)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["suffix", "ngram-mod", "ngram-cache"])
def test_seeded_text_does_not_depend_on_other_requests(llm: LLM, method: str) -> None:
    """The same seeded sampled request on a fresh engine and after other requests (greedy, and
    the same prompt with another seed: text the shared state then matches)."""
    engine = _engine(llm, method)
    alone = engine.run(_add(engine, llm, PROMPT, SEEDED))
    assert alone.metrics.spec.num_draft_tokens > 0  # its own history drafts

    engine = _engine(llm, method)
    engine.run(_add(engine, llm, OTHER_PROMPTS[0], GREEDY))
    engine.run(_add(engine, llm, OTHER_PROMPTS[1], SamplingParams(temperature=0.8, seed=3, max_tokens=40)))
    after = engine.run(_add(engine, llm, PROMPT, SEEDED))
    assert after.output_ids == alone.output_ids, f"{method}: earlier requests changed a seeded request's text"
