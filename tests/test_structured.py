"""Structured output through llguidance: constraints validated up front, outputs that parse and
validate, greedy constrained speculation identical to greedy constrained decoding (drafters whose
drafts break the grammar included), sampled constrained speculation distributed as plain
constrained sampling (two-sample chi-squared)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import jsonschema
import pytest
from scipy.stats import chi2_contingency

from tokenleap import LLM, SamplingParams
from tokenleap.drafters.base import Draft, StatelessDrafter
from tokenleap.errors import TokenleapError
from tokenleap.structured import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                    "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


def test_constraints_are_checked_up_front() -> None:
    with pytest.raises(TokenleapError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(TokenleapError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(TokenleapError, match="invalid structured output constraint"):
        StructuredOutputsParams(regex="a(")
    with pytest.raises(TokenleapError, match="invalid structured output constraint"):
        StructuredOutputsParams(grammar="start: foo")
    with pytest.raises(TokenleapError, match="invalid structured output constraint"):
        StructuredOutputsParams(json={"type": "no-such-type"})
    with pytest.raises(TokenleapError, match="choice"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).json == '{"b": 1, "a": 2}'  # order kept
    StructuredOutputsParams(grammar='root ::= "yes" | "no"')  # GBNF
    p = SamplingParams(guided_decoding=StructuredOutputsParams(choice=["x"]))  # vLLM's former name
    assert p.structured_outputs is not None and p.structured_outputs.choice == ("x",)
    assert SamplingParams(structured_outputs={"regex": "[0-9]+"}).structured_outputs.regex == "[0-9]+"


class Breaking(StatelessDrafter):
    """Drafts tokens that break any JSON grammar midway (letters where syntax must come)."""

    name = "breaking"

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        return Draft(self.tokens[:max_tokens])


class Oracle(StatelessDrafter):
    """Drafts the known answer's next tokens, then EOS and junk after it (drafts that run past
    the end of the grammar, as suffix drafts copied from earlier answers do)."""

    name = "oracle"

    def __init__(self, answers: dict[tuple[int, ...], list[int]], tail: list[int]) -> None:
        self.answers, self.tail = answers, tail

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        for prompt, answer in self.answers.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                return Draft((answer[done:] + self.tail)[:max_tokens])
        return Draft()


def test_greedy_constrained_speculation_is_constrained_decoding(llm: LLM) -> None:
    convs = [
        [{"role": "user", "content": f"Describe {who} as JSON."}]
        for who in ("a system administrator in Paris", "a guest from Oslo")
    ]
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=PERSON))
    plain = llm.chat(convs, params, use_tqdm=False)
    for out in plain:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    bad = llm.tokenizer.encode(" hello world")
    eos = sorted(llm.tokenizer.eos_token_ids)[0]
    answers = {tuple(llm.chat_token_ids(c)): list(o.outputs[0].token_ids) for c, o in zip(convs, plain)}
    for cfg in (
        {"method": "suffix"},
        {"method": "ngram", "num_speculative_tokens": 6},
        {"method": "custom", "drafter": Breaking(bad * 3)},
        {"method": "custom", "drafter": Oracle(answers, [eos] + bad), "num_speculative_tokens": 8, "adaptive": False},
    ):
        spec = LLM(speculative_config=cfg)
        outs = spec.chat(convs, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain], cfg["method"]
        assert sum(o.metrics.spec.num_accepted_tokens for o in outs) > 10  # forced tokens at least
    regex = llm.generate(
        ["Call me at"],
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r" \d{3}-\d{4}")),
        use_tqdm=False,
    )[0].outputs[0]
    assert regex.finish_reason == "stop" and len(regex.text) == 9 and regex.text[4] == "-"


def test_sampled_constrained_speculation_keeps_the_distribution(llm: LLM) -> None:
    choices = ["yes", "no", "maybe", "certainly", "never"]
    params = SamplingParams(temperature=1.5, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices))
    prompt = llm.chat_token_ids([{"role": "user", "content": "Will it rain tomorrow? One word."}])
    spec = LLM(
        speculative_config={
            "method": "custom",
            "drafter": Breaking(llm.tokenizer.encode("maybe") + llm.tokenizer.encode("yes")),
        }
    )
    n = 300
    counts = {}
    for name, engine_llm in (("plain", llm), ("spec", spec)):
        # 300 samples seeded 0..299: three requests of n = 100 (each prefilled once, its samples forked
        # with seeds seed + i; 300 one-sample requests took ~2x as long, each prefilling the prompt)
        outs = engine_llm.generate(
            [prompt] * 3, [dataclasses.replace(params, n=n // 3, seed=j * (n // 3)) for j in range(3)], use_tqdm=False
        )
        texts = [o.text for out in outs for o in out.outputs]
        assert len(texts) == n and set(texts) <= set(choices), set(texts) - set(choices)
        counts[name] = [texts.count(c) for c in choices]
        if name == "spec":
            assert sum(out.metrics.spec.num_accepted_tokens for out in outs) > 0
    table = [[a, b] for a, b in zip(counts["plain"], counts["spec"]) if a + b > 0]
    assert len(table) >= 2, counts
    pvalue = chi2_contingency(table).pvalue
    assert pvalue >= 1e-3, (pvalue, counts)
