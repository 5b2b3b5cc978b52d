"""Every built-in drafter gives greedy output identical to plain decoding on real prompts."""

from __future__ import annotations

import pytest

from tokenleap import LLM, SamplingParams
from tokenleap.config import SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.engine.engine import Engine

PROMPTS = [
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "List the first ten even numbers, separated by commas.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
METHODS = [
    {"method": "ngram"},
    {"method": "ngram-simple"},
    {"method": "ngram-map-k"},
    {"method": "ngram-map-k4v"},
    {"method": "ngram-mod"},
    {"method": "ngram-cache"},
    {"method": "suffix"},
    {"method": "suffix+ngram"},
    {"method": "draft-model", "model": "smollm2-135m-instruct"},
    {"method": "draft-model", "model": "smollm2-135m-instruct", "draft_layers": 6},
]


def _run(engine: Engine, llm: LLM, prompt: str) -> tuple[list[int], int]:
    """Output ids, and draft tokens that were not accepted."""
    req = engine.add_request(llm.chat_token_ids([{"role": "user", "content": prompt}]), GREEDY)
    engine.run(req)
    spec = req.metrics.spec
    return req.output_ids, spec.num_draft_tokens - spec.num_accepted_tokens


@pytest.mark.slow
@pytest.mark.parametrize("raw", METHODS, ids=lambda r: "-".join(str(v) for v in r.values()))
def test_greedy_output_identical_to_plain(llm: LLM, raw: dict[str, object]) -> None:
    cfg = SpecConfig.from_dict({**raw, "adaptive": False, "num_speculative_tokens": 6})
    assert cfg is not None
    drafter = default_registry().create(cfg.method, cfg, target=llm.model, tokenizer=llm.tokenizer, target_path=llm.source.path)
    spec = Engine(llm.model, llm.tokenizer, spec=cfg, drafter=drafter)
    plain = Engine(llm.model, llm.tokenizer)
    for prompt in PROMPTS:
        expected, _ = _run(plain, llm, prompt)
        got, rejected = _run(spec, llm, prompt)
        assert got == expected, f"{cfg.method} changed the greedy output"
        if cfg.method == "draft-model" and cfg.draft_layers is None:
            # the target drafting for itself is always right; only draft tokens past the end
            # of the answer (after EOS, in the last draft) go unused
            assert rejected < cfg.num_speculative_tokens
