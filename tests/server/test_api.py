"""The OpenAI API on the real model through the official `openai` client: chat and completions,
streamed and not; greedy output identical to the library's plain decoding; usage, ids, shapes
and per-request speculation statistics; /v1/models and /health."""

from __future__ import annotations

import httpx
import openai
import pytest

from tokenleap import LLM
from tokenleap.server import BackgroundServer

from .conftest import MODEL, reference_chat, reference_completion

pytestmark = pytest.mark.slow

QUESTION = "Name three prime numbers and say why they are prime."


def test_chat_matches_library(client: openai.OpenAI, llm: LLM) -> None:
    text, ids, finish = reference_chat(llm, QUESTION, 24)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=24
    )
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL and r.created > 0
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.logprobs is None  # not asked for
    assert choice.message.content == text
    assert choice.finish_reason == finish
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(llm.chat_token_ids([{"role": "user", "content": QUESTION}]))
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    spec = r.model_extra["speculative"]
    assert spec["method"] == "suffix"  # the server's default
    assert spec["num_forward_passes"] >= 1 and spec["mean_acceptance_length"] >= 1.0
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]


def test_chat_stream_matches_library(client: openai.OpenAI, llm: LLM) -> None:
    text, ids, finish = reference_chat(llm, QUESTION, 24)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason == finish
    assert final[0].model_extra["speculative"]["method"] == "suffix"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_matches_library(client: openai.OpenAI, llm: LLM) -> None:
    prompt = "def fibonacci(n):"
    text, ids, finish = reference_completion(llm, prompt, 20)
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].text == text and r.choices[0].finish_reason == finish and r.choices[0].logprobs is None
    assert (
        r.usage is not None
        and r.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
        and r.usage.completion_tokens == len(ids)
    )
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text
    assert streamed[-1].choices[0].finish_reason == finish
    # token ids as the prompt, and a one-element list of them
    token_prompt = llm.tokenizer.encode(prompt)
    for p in (token_prompt, [token_prompt]):
        r = client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=20)
        assert r.choices[0].text == text


def test_per_request_speculation(client: openai.OpenAI, llm: LLM) -> None:
    prompt = (
        "List the days of the week, one per line: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.\n"
        "Again:"
    )
    text, _, _ = reference_completion(llm, prompt, 24)
    off = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24,
                                    extra_body={"speculative": {"method": "none"}})
    spec = off.model_extra["speculative"]
    assert off.choices[0].text == text
    assert spec["method"] is None and spec["num_drafts"] == 0 and spec["mean_acceptance_length"] == 1.0
    ngram = client.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=24,
        extra_body={"speculative": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}},
    )
    spec = ngram.model_extra["speculative"]
    assert ngram.choices[0].text == text  # lossless
    assert spec["method"] == "ngram" and spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0
    assert spec["mean_acceptance_length"] > 1.0
    assert len(spec["acceptance_rate_per_position"]) <= 4


def test_sampling_options(client: openai.OpenAI) -> None:
    # Seeded sampling repeats under plain decoding (with the suffix drafter, whose tree over
    # earlier outputs changes the drafts and so the random draws, it is lossless but not repeatable).
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12, temperature=0.8,
              top_p=0.9, seed=7, extra_body={"top_k": 40, "min_p": 0.05, "speculative": {"method": "none"}})
    a = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    b = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert a.choices[0].message.content == b.choices[0].message.content
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=24, stop=[" 7"])
    assert r.choices[0].finish_reason == "stop" and " 7" not in r.choices[0].text
    r = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"


def test_models_and_health(client: openai.OpenAI, server: BackgroundServer) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model" and models.data[0].owned_by == "tokenleap"
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["live"] == 0
    # llama.cpp users read acceptance off /health: the finished requests' speculation so far
    before = health["speculative"]
    client.completions.create(model=MODEL, prompt="a b c a b c a b c a b c", max_tokens=16, temperature=0,
                              extra_body={"speculative": {"method": "ngram"}})
    spec = httpx.get(server.url + "/health").json()["speculative"]
    assert spec["requests"] == before["requests"] + 1 and spec["draft_tokens"] > before["draft_tokens"]
    assert 0 < spec["accepted_tokens"] <= spec["draft_tokens"] and spec["mean_acceptance_length"] > 1.0
    assert spec["acceptance_rate"] == round(spec["accepted_tokens"] / spec["draft_tokens"], 4)
    # `model` may be left out (vLLM does the same)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_penalties_and_min_tokens_match_library(client: openai.OpenAI, llm: LLM) -> None:
    from tokenleap import SamplingParams

    messages = [{"role": "user", "content": QUESTION}]
    params = SamplingParams(
        temperature=0, max_tokens=24, presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=20
    )
    ref = llm.chat([messages], params, use_tqdm=False)[0].outputs[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24,
                                       presence_penalty=0.7, frequency_penalty=0.3,
                                       extra_body={"repetition_penalty": 1.2, "min_tokens": 20})
    assert r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids) >= 20


def test_completion_keeps_the_stop_string_when_asked(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
    stop = base.choices[0].text.strip().split()[0]
    cut = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8, stop=[stop]
    )
    kept = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8,
                                     stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop and kept.choices[0].finish_reason == "stop"


def test_logprobs_match_library_in_openai_shapes(client: openai.OpenAI, llm: LLM) -> None:
    from tokenleap import SamplingParams

    messages = [{"role": "user", "content": QUESTION}]
    ref = llm.chat([messages], SamplingParams(temperature=0, max_tokens=12, logprobs=3), use_tqdm=False)[0].outputs[0]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)], abs=1e-6
    )
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6
        assert bytes(c.bytes).decode("utf-8") == c.token
    comp = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=6, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == comp.choices[0].text and all(len(t) <= 2 for t in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)


def test_n_samples_match_separately_seeded_library_requests(client: openai.OpenAI, server_llm: LLM) -> None:
    from tokenleap import SamplingParams

    messages = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.9, max_tokens=10, n=3, seed=11,
                                       presence_penalty=0.5, logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    for i, c in enumerate(r.choices):
        # the server speculates (suffix), so compare with its own engine, sample i seeded 11 + i
        ref = server_llm.chat(
            [messages],
            SamplingParams(temperature=0.9, max_tokens=10, seed=11 + i, presence_penalty=0.5),
            use_tqdm=False,
        )[0].outputs[0]
        assert c.message.content == ref.text
    comp = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0.9, max_tokens=8, n=2)
    assert len(comp.choices) == 2 and comp.usage.completion_tokens >= 2


def test_structured_outputs(client: openai.OpenAI, llm: LLM) -> None:
    import json

    import jsonschema

    from tokenleap import SamplingParams
    from tokenleap.structured import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Give the largest city of France as JSON."}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    ref = llm.chat(
        [messages],
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)),
        use_tqdm=False,
    )[0].outputs[0]
    assert r.choices[0].message.content == ref.text  # the server speculates (suffix): same text
    c = client.completions.create(model=MODEL, prompt="Is water wet? Answer:", temperature=0, max_tokens=5,
                                  extra_body={"guided_choice": [" yes", " no"]})
    assert c.choices[0].text in (" yes", " no")
    obj = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=40, response_format={"type": "json_object"}
    )
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(obj.choices[0].message.content), dict)
    for bad in (
        {"guided_regex": "a("},
        {"response_format": {"type": "xml"}},
        {"response_format": {"type": "json_schema"}},
    ):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body=bad)


def test_streamed_logprobs_arrive_with_the_last_chunk(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=10, logprobs=True, top_logprobs=2
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=10, logprobs=True, top_logprobs=2, stream=True
        )
    )
    content = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert [(x.token, x.logprob) for x in content] == [(x.token, x.logprob) for x in whole.choices[0].logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_streamed_n_samples_equal_the_whole_answer(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    kwargs = dict(model=MODEL, messages=messages, temperature=0.9, max_tokens=10, n=3, seed=4)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts = ["", "", ""]
    finish = [None, None, None]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            finish[ch.index] = ch.finish_reason or finish[ch.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
