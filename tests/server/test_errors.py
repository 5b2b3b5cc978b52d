"""Client mistakes get a 4xx with an OpenAI error body (never a 500 or a traceback), the
`openai` client maps them to its exceptions, and the API key guards every route but /health."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tokenleap import LLM
from tokenleap.server import BackgroundServer, ServerConfig

from .conftest import BODY_LIMIT, MODEL

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSG, "max_tokens": 4, **kw}


def _completion(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **kw}


CASES = [
    # (path, body, status, message fragment, param)
    (CHAT, b"{not json", 400, "not valid JSON", None),
    (CHAT, b"[1, 2]", 400, "must be a JSON object", None),
    (CHAT, b"\xff\xfe", 400, "not valid JSON", None),
    (CHAT, _chat(model="gpt-4o"), 404, "does not exist", "model"),
    (CHAT, {"model": MODEL}, 400, "messages", "messages"),
    (CHAT, _chat(messages=[]), 400, "messages", "messages"),
    (CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages", "messages"),
    (
        CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "messages",
        "messages",
    ),
    (CHAT, _chat(max_tokens=-1), 400, "max_tokens must be a positive integer", "max_tokens"),
    (CHAT, _chat(max_tokens=0), 400, "max_tokens must be a positive integer", "max_tokens"),
    (CHAT, _chat(max_completion_tokens=-5), 400, "max_tokens must be a positive integer", "max_tokens"),
    (CHAT, _chat(max_tokens=1.5), 400, "max_tokens", "max_tokens"),
    (CHAT, _chat(temperature=-0.5), 400, "temperature must be >= 0", "temperature"),
    (CHAT, _chat(temperature="hot"), 400, "temperature", "temperature"),
    # Python's json reads NaN / Infinity: a non-finite number is a 400, never a failed prefill
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": NaN}',
        400,
        "finite",
        "temperature",
    ),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": Infinity}',
        400,
        "finite",
        "temperature",
    ),
    (COMPLETIONS, b'{"prompt": "Hi", "max_tokens": 4, "temperature": 0.7, "top_p": NaN}', 400, "finite", "top_p"),
    (COMPLETIONS, b'{"prompt": "Hi", "max_tokens": 4, "temperature": 0.7, "min_p": -Infinity}', 400, "finite", "min_p"),
    (
        COMPLETIONS,
        (
            b'{"prompt": "Hi", "max_tokens": 4, "speculative": {"method": "suffix", '
            b'"suffix_decoding_min_token_prob": NaN}}'
        ),
        400,
        "finite",
        "speculative",
    ),
    (CHAT, _chat(top_p=1.5), 400, "top_p must be in (0, 1]", "top_p"),
    (CHAT, _chat(top_k=-3), 400, "top_k", "top_k"),
    (CHAT, _chat(min_p=2), 400, "min_p", "min_p"),
    (CHAT, _chat(stop=5), 400, "stop", "stop"),
    (CHAT, _chat(stop=[str(i) for i in range(17)]), 400, "at most 16 stop strings", "stop"),
    (CHAT, b"[" * 20_000 + b"]" * 20_000, 400, "nested too deeply", None),
    (CHAT, _chat(stop_token_ids=[10**9]), 400, "token ids out of range", "stop_token_ids"),
    (CHAT, _chat(seed=2**70), 400, "seed", "seed"),
    (CHAT, _chat(n=0), 400, "n must be in [1, 128]", "n"),
    (CHAT, _chat(stream="yes"), 400, "stream", "stream"),
    (CHAT, _chat(stream_options={"include_usage": True}), 400, "stream_options", "stream_options"),
    (CHAT, _chat(stream=None, stream_options={"include_usage": True}), 400, "stream_options", "stream_options"),
    (CHAT, _chat(top_logprobs=3), 400, "top_logprobs needs logprobs=true", "top_logprobs"),
    (CHAT, _chat(logprobs=True, top_logprobs=50), 400, "logprobs must be an integer in [0, 20]", "logprobs"),
    (CHAT, _chat(presence_penalty=2.5), 400, "presence_penalty must be in [-2, 2]", "presence_penalty"),
    (CHAT, _chat(min_tokens=99, max_tokens=4), 400, "min_tokens must be", "min_tokens"),
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f f"}}]), 400, "function.name", "tools"),
    (
        CHAT,
        _chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "not among the tools",
        "tool_choice",
    ),
    (CHAT, _chat(max_tokens=9000), 400, "maximum context length is 8192", "max_tokens"),
    (CHAT, _chat(speculative={"method": "bogus"}), 400, "unknown speculative method", "speculative"),
    (
        CHAT,
        _chat(speculative={"method": "suffix", "num_speculative_tokens": 99}),
        400,
        "num_speculative_tokens",
        "speculative",
    ),
    (CHAT, _chat(speculative={"method": "suffix", "model": "/etc/passwd"}), 400, "Extra inputs", "speculative"),
    (CHAT, _chat(speculative={"method": "custom"}), 400, "not available per request", "speculative"),
    (CHAT, _chat(speculative={"method": "draft-model"}), 400, "not available per request", "speculative"),
    (CHAT, _chat(speculative={"method": "suffix+draft-model"}), 400, "not available per request", "speculative"),
    (CHAT, _chat(speculative="suffix"), 400, "speculative", "speculative"),
    (COMPLETIONS, _completion(prompt=[1, 2, 10**7]), 400, "token ids out of range", "prompt"),
    (COMPLETIONS, _completion(prompt=[1, -2]), 400, "token ids out of range", "prompt"),
    (COMPLETIONS, _completion(model="other"), 404, "does not exist", "model"),
    # OpenAI fields tokenleap cannot honour: a 400 naming the field unless neutral (docs/server.md)
    (COMPLETIONS, _completion(echo=True, logprobs=2), 400, "echo with logprobs", "echo"),
    (COMPLETIONS, _completion(n=2, best_of=1), 400, "best_of must be in [n, 128]", "best_of"),
    (COMPLETIONS, _completion(best_of=3, stream=True), 400, "cannot be streamed", "best_of"),
    (COMPLETIONS, _completion(suffix="end"), 400, "suffix", "suffix"),
    (COMPLETIONS, _completion(prompt=["a"] * 100, n=2), 400, "at most 128 completions", "prompt"),
    (COMPLETIONS, _completion(logit_bias={"50": 10}), 400, "logit_bias", "logit_bias"),
    (CHAT, _chat(logit_bias={"50": 10}), 400, "logit_bias", "logit_bias"),
    (CHAT, _chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio", "audio"),
    (CHAT, _chat(modalities=["text", "audio"]), 400, "modalities", "modalities"),
    (CHAT, _chat(web_search_options={}), 400, "web search", "web_search_options"),
    (CHAT, _chat(reasoning_effort="high"), 400, "reasoning_effort", "reasoning_effort"),
    (CHAT, _chat(verbosity="low"), 400, "verbosity", "verbosity"),
    (CHAT, _chat(store=True), 400, "store", "store"),
    (CHAT, _chat(moderation={"model": "omni"}), 400, "moderation", "moderation"),
    (
        CHAT,
        _chat(
            messages=[
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}
            ]
        ),
        400,
        "type 'input_audio' are not supported",
        "messages",
    ),
    (CHAT, _chat(messages=[{"role": "assistant", "audio": {"id": "a1"}}, *MSG]), 400, "audio", "messages"),
    (CHAT, _chat(tools=[{"type": "custom", "custom": {"name": "sql"}}]), 400, "custom tools", "tools"),
    (
        CHAT,
        _chat(functions=[{"name": "f"}], tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        "duplicate function name",
        "tools",
    ),
    (CHAT, _chat(functions=[{"name": "f"}], function_call={"name": "g"}), 400, "not among the tools", "function_call"),
    (
        CHAT,
        _chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={
                "type": "allowed_tools",
                "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "g"}}]},
            },
        ),
        400,
        "not among the tools",
        "tool_choice",
    ),
    (CHAT, _chat(json_schema_mode="loose"), 400, "json_schema_mode", "json_schema_mode"),
    (CHAT, _chat(stream=0), 400, "stream", "stream"),
    (CHAT, _chat(n="2"), 400, "n", "n"),
]


@pytest.mark.parametrize(("path", "body", "status", "fragment", "param"), CASES)
def test_bad_request(
    server: BackgroundServer, path: str, body: Any, status: int, fragment: str, param: str | None
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert fragment in err["message"]
    assert err["param"] == param
    assert "Traceback" not in r.text
    if status == 404:
        assert err["code"] == "model_not_found"


def test_tiny_temperature_is_greedy(server: BackgroundServer, llm: LLM) -> None:
    """A temperature below 1e-5 decodes greedily (vLLM's epsilon) instead of failing the prefill."""
    from .conftest import reference_completion

    text, ids, finish = reference_completion(llm, "The capital of France is", 8)
    for temperature in (1e-38, 5e-324, 1e-6):
        r = httpx.post(
            server.url + COMPLETIONS,
            json=_completion(prompt="The capital of France is", max_tokens=8, temperature=temperature),
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text


def test_prompt_longer_than_context(server: BackgroundServer) -> None:
    long = "hello " * 9000  # ~9000 tokens, under the body limit
    assert len(long) < BODY_LIMIT
    for path, body in (
        (CHAT, _chat(messages=[{"role": "user", "content": long}])),
        (COMPLETIONS, _completion(prompt=long)),
    ):
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400
        assert "context length is 8192" in r.json()["error"]["message"]


def test_oversize_body(server: BackgroundServer) -> None:
    body = _completion(prompt="x" * (BODY_LIMIT + 1000))
    r = httpx.post(server.url + COMPLETIONS, json=body)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(server.url + "/health").status_code == 200


def test_unknown_route_and_method(server: BackgroundServer) -> None:
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"
    r = httpx.get(server.url + CHAT)
    assert r.status_code == 405 and "error" in r.json()


def test_openai_client_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MSG)  # type: ignore[arg-type]
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e2:
        client.chat.completions.create(model=MODEL, messages=MSG, temperature=-1)  # type: ignore[arg-type]
    assert "temperature" in e2.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", n=200)


def test_auth(server_llm: LLM, server: BackgroundServer) -> None:
    """A second app on the same engine (the shared server is idle meanwhile)."""
    with BackgroundServer(server_llm, ServerConfig(port=0, log_level="warning", api_key="sekret")) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200  # open
        assert httpx.get(srv.url + "/metrics").status_code == 200  # open by default: scrapers rarely have a key
        for path in ("/v1/models",):
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "sekret"},
                {"Authorization": "Basic sekret"},
            ):
                r = httpx.get(srv.url + path, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(srv.url + path, headers={"Authorization": "Bearer sekret"}).status_code == 200
        r = httpx.post(srv.url + CHAT, json=_chat())
        assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        r2 = good.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, temperature=0)  # type: ignore[arg-type]
        assert r2.choices[0].message.content
        assert srv.state.loop.num_live == 0
    assert srv.state.loop.num_live == 0
    with BackgroundServer(
        server_llm, ServerConfig(port=0, log_level="warning", api_key="sekret", metrics_api_key_required=True)
    ) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
    # without a key, everything is open
    assert httpx.get(server.url + "/v1/models").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
