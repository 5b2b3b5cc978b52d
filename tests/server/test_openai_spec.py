"""OpenAI's published OpenAPI spec drives the server: request bodies generated from its
`CreateChatCompletionRequest` and `CreateCompletionRequest` schemas (hypothesis-jsonschema), each
answer checked against its response schemas (and parsed by the `openai` SDK's types, generated
from the same spec). Never a 5xx; every 2xx body and every streamed chunk valid; every 4xx an
OpenAI error body, and a 400 only for a reason the server documents (a field docs/server.md lists as
unsupported, or a value the server cannot serve: a token id outside the vocabulary, a function
schema llguidance refuses, ...).

The server here runs a tiny random Llama with the real SmolLM2 tokenizer and suffix speculation,
so hundreds of requests take seconds; the bodies' lengths are clamped to a few tokens (the only
change made to a generated body, besides the model's name). TOKENLEAP_SPEC_EXAMPLES sets the
number of bodies per endpoint (default 80 chat, 120 completions; the issue's bar was measured with 2000).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.configuration import set_hypothesis_home_dir

from tokenleap import LLM
from tokenleap.server import BackgroundServer, ServerConfig
from tokenleap.tokenizer import Tokenizer

from . import openai_spec
from .conftest import wait_idle

set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "tokenleap-hypothesis")  # not a .hypothesis/ in the checkout
_ASKED = os.environ.get("TOKENLEAP_SPEC_EXAMPLES")
# drawing a chat body costs ~0.15 s
CHAT_EXAMPLES, COMPLETION_EXAMPLES = (int(_ASKED), int(_ASKED)) if _ASKED else (80, 120)
NAME = "tiny-spec"
VOCAB = 49152  # SmolLM2's tokenizer
MAX_TOKENS = 3


def _settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True, print_blob=True,
                    suppress_health_check=list(HealthCheck))

_HF_NAMES = {
    "attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
    "o": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
    "down": "mlp.down_proj"
}


def _tiny_folder(folder: Path, tokenizer: Tokenizer) -> Path:
    """A 2-layer random Llama over the real tokenizer's vocabulary, as a Hugging Face folder."""
    import dataclasses

    from safetensors.torch import save_file

    from tiny_models import TINY_CONFIG, make_tiny_weights

    c = dataclasses.replace(TINY_CONFIG, vocab_size=VOCAB, max_position=4096)
    w = make_tiny_weights(c)
    tensors = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["norm"], "lm_head.weight": w["lm_head"]}
    for key, t in w.items():
        if key.startswith("layers."):
            _, idx, short = key.split(".")
            tensors[f"model.layers.{idx}.{_HF_NAMES[short]}.weight"] = t
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
                "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
                "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position,
                "tie_word_embeddings": False
            }
        )
    )
    tokenizer.hf.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Iterator[BackgroundServer]:
    folder = _tiny_folder(tmp_path_factory.mktemp("tiny-spec"), tokenizer)
    llm = LLM(str(folder), dtype="float32", speculative_config={"method": "suffix"})
    srv = BackgroundServer(llm, ServerConfig(port=0, log_level="warning", served_model_name=NAME))
    yield srv
    wait_idle(srv)
    srv.stop()


# --------------------------------------------------------------------------- bodies


def _tame(body: dict[str, Any], completions: bool) -> dict[str, Any]:
    """The generated body with our model's name and a few tokens at most to generate."""
    body = {**body, "model": NAME}
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    for key, cap in (("n", 2), ("best_of", 3)):
        if isinstance(body.get(key), int) and body[key] > cap:
            body[key] = cap
    prompt = body.get("prompt")
    if completions and isinstance(prompt, list):  # token ids into the vocabulary (the spec's are any integers)
        body["prompt"] = [
            [abs(t) % VOCAB for t in p] if isinstance(p, list) else abs(p) % VOCAB if isinstance(p, int) else p
            for p in prompt
        ]
    return body


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)


def _refusal_is_documented(body: dict[str, Any], param: str | None, message: str) -> bool:
    """Whether a 400 for a spec-valid body has a reason the server documents."""
    g = body.get
    n = g("n") or 1
    best_of = g("best_of") or n
    max_tokens = g("max_completion_tokens") if g("max_completion_tokens") is not None else g("max_tokens")
    parts = [p for m in g("messages") or [] if isinstance(m.get("content"), list) for p in m["content"]]
    tools = g("tools") or []
    if param == "messages" and any(ord(c) in range(0xD800, 0xE000) for s in _strings(body["messages"]) for c in s):
        return True  # a lone surrogate (valid JSON, not text)
    if param == "prompt" and any(ord(c) in range(0xD800, 0xE000) for s in _strings(g("prompt")) for c in s):
        return True
    documented = {
        "audio": g("audio") is not None,
        "modalities": "audio" in (g("modalities") or []),
        "web_search_options": g("web_search_options") is not None,
        "reasoning_effort": g("reasoning_effort") not in (None, "none"),
        "verbosity": g("verbosity") not in (None, "medium"),
        "moderation": g("moderation") is not None,
        "store": g("store") is True,
        "logit_bias": bool(g("logit_bias")),
        "suffix": bool(g("suffix")),
        "echo": bool(g("echo")) and g("logprobs") is not None,
        "best_of": best_of < n or (best_of > n and bool(g("stream"))),
        "stream_options": bool((g("stream_options") or {}).get("include_usage")) and not g("stream"),
        "top_logprobs": bool(g("top_logprobs")) and not g("logprobs"),
        "max_tokens": max_tokens is not None and max_tokens < 1,
        "seed": g("seed") is not None and not -(2**63) <= g("seed") < 2**64,
        "prompt": "at most 128 completions" in message,
        "messages": any(p.get("type") not in ("text", "refusal") for p in parts)
        or any(m.get("audio") for m in g("messages") or [])
        or "refusal" in message,
        "tools": any(t.get("type") == "custom" for t in tools)
        or "invalid structured output constraint" in message
        or "duplicate function name" in message
        or "function.name must be" in message,
        "tool_choice": "custom tools" in message
        or "not among the tools" in message
        or "needs tools" in message
        or "cannot be combined" in message
        or "allowed_tools" in message,
        "functions": "function.name must be" in message
        or "cannot be combined" in message
        or "invalid structured output" in message
        or "duplicate function name" in message,
        "function_call": "not among the tools" in message or "needs tools" in message,
        "response_format": "invalid structured output constraint" in message,
    }
    return documented.get(param or "", False)


def _as_completion(chunk: dict[str, Any]) -> dict[str, Any]:
    """A streamed completion chunk as the spec's `CreateCompletionResponse`, which the spec reuses
    for chunks although OpenAI streams `finish_reason: null` and (with include_usage) `usage: null`
    in them."""
    out = {**chunk, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]}
    if out.get("usage", 0) is None:
        del out["usage"]
    return out


def _check_answer(path: str, body: dict[str, Any], r: httpx.Response) -> str:
    """Checks one answer; returns its kind ("ok" or "refused")."""
    assert r.status_code < 500, f"{r.status_code} for {json.dumps(body)[:1500]}: {r.text[:500]}"
    chat = path.endswith("chat/completions")
    if r.status_code >= 400:
        err = r.json()
        openai_spec.check("ErrorResponse", err)
        e = err["error"]
        assert r.status_code == 400, r.text
        assert _refusal_is_documented(body, e["param"], e["message"]), (
            f"undocumented refusal {e} of {json.dumps(body)[:1500]}"
        )
        return "refused"
    if not body.get("stream"):
        answer = r.json()
        openai_spec.check("CreateChatCompletionResponse" if chat else "CreateCompletionResponse", answer)
        (openai.types.chat.ChatCompletion if chat else openai.types.Completion).model_validate(answer)
        return "ok"
    lines = [line for line in r.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", r.text[-500:]
    for line in lines[:-1]:
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            openai_spec.check("ErrorResponse", chunk)
            continue
        if not chat:
            chunk = _as_completion(chunk)
        openai_spec.check("CreateChatCompletionStreamResponse" if chat else "CreateCompletionResponse", chunk)
        (openai.types.chat.ChatCompletionChunk if chat else openai.types.Completion).model_validate(chunk)
    return "ok"


def _run(
    spec_server: BackgroundServer, path: str, schema_name: str, completions: bool, examples: int
) -> dict[str, int]:
    counts: dict[str, int] = {"ok": 0, "refused": 0}
    strategy = openai_spec.request_strategy(schema_name)
    with httpx.Client(base_url=spec_server.url, timeout=120) as http:

        @_settings(examples)
        @given(strategy)
        def one(body: dict[str, Any]) -> None:
            body = _tame(body, completions)
            r = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
            kind = _check_answer(path, body, r)
            counts[kind] += 1
            if kind == "refused":
                param = r.json()["error"]["param"]
                counts[f"refused:{param}"] = counts.get(f"refused:{param}", 0) + 1

        one()
    return counts


def test_chat_completions_from_the_spec(spec_server: BackgroundServer) -> None:
    counts = _run(spec_server, "/v1/chat/completions", "CreateChatCompletionRequest", False, CHAT_EXAMPLES)
    assert counts["ok"] >= 0.3 * counts["refused"], counts  # most refusals: the spec's many non-text fields
    print(counts)
    wait_idle(spec_server)


def test_completions_from_the_spec(spec_server: BackgroundServer) -> None:
    from tokenleap.server.protocol import REFUSED

    counts = _run(spec_server, "/v1/completions", "CreateCompletionRequest", True, COMPLETION_EXAMPLES)
    # Most bodies are served. Bodies that set a field the server refuses by design (protocol.REFUSED:
    # logit_bias, suffix) come as often as the generator draws them (40 of 120 on 2026-11-27,
    # where a stricter count that included them had passed the day before), so they are not
    # counted here; each of those refusals was still checked to be the documented one.
    by_design = sum(counts.get(f"refused:{field}", 0) for field, _, _ in REFUSED)
    assert counts["ok"] >= 2 * (counts["refused"] - by_design) and counts["ok"] >= COMPLETION_EXAMPLES // 2, counts
    print(counts)
    wait_idle(spec_server)


# --------------------------------------------------------------------------- explicit nulls, shapes


NULLS_CHAT = {
    "stream": None, "stream_options": None, "n": None, "temperature": None, "top_p": None, "stop": None, "seed": None,
    "logprobs": None, "top_logprobs": None, "max_completion_tokens": None, "presence_penalty": None,
    "frequency_penalty": None, "logit_bias": None, "user": None, "tools": None, "tool_choice": None,
    "parallel_tool_calls": None, "response_format": None, "audio": None, "modalities": None, "prediction": None,
    "reasoning_effort": None, "verbosity": None, "web_search_options": None, "store": None, "metadata": None,
    "service_tier": None, "functions": None, "function_call": None, "prompt_cache_key": None, "safety_identifier": None
}
NULLS_COMPLETION = {
    "stream": None, "stream_options": None, "n": None, "echo": None, "suffix": None, "best_of": None, "logprobs": None,
    "temperature": None, "top_p": None, "stop": None, "seed": None, "logit_bias": None, "user": None,
    "presence_penalty": None, "frequency_penalty": None
}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi", "name": None}], "max_tokens": 2, **NULLS_CHAT},
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream_options": {},
                "modalities": ["text"], "reasoning_effort": "none", "verbosity": "medium", "store": False,
                "logit_bias": {}, "service_tier": "auto", "metadata": {"k": "v"},
                "prediction": {"type": "content", "content": "Hello"}, "top_p": 0
            },
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True, "stream_options": {}},
        ),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, **NULLS_COMPLETION}),
        (
            "/v1/completions",
            {"prompt": None, "max_tokens": 2, "best_of": 0, "suffix": "", "echo": False, "stream_options": {}},
        ),
        ("/v1/completions", {"max_tokens": 2}),
        ("/v1/completions", {"prompt": "", "max_tokens": 2, "stream": None}),
    ],
)
def test_explicit_nulls_and_neutral_values_are_accepted(
    spec_server: BackgroundServer, path: str, body: dict[str, Any]
) -> None:
    r = httpx.post(spec_server.url + path, json={"model": NAME, **body}, timeout=60)
    assert r.status_code == 200, r.text
    assert _check_answer(path, body, r) == "ok"
    if not body.get("stream"):
        answer = r.json()
        assert isinstance(answer["system_fingerprint"], str) and answer["system_fingerprint"].startswith("tokenleap-")
        if path.endswith("chat/completions"):
            assert answer["choices"][0]["message"]["refusal"] is None
            assert ("service_tier" in answer) == (body.get("service_tier") is not None)


def test_batched_prompts_echo_best_of_and_scoring(spec_server: BackgroundServer) -> None:
    """Several prompts, n samples each: one choice per (prompt, sample), prompt-major; echo
    prefixes each prompt; best_of keeps the n best of more samples; max_tokens 0 scores only."""
    url = spec_server.url + "/v1/completions"
    r = httpx.post(url, json={"model": NAME, "prompt": ["One", "Two", "Three"], "n": 2, "max_tokens": 2, "echo": True,
                              "temperature": 1, "seed": 3}, timeout=60).json()
    openai_spec.check("CreateCompletionResponse", r)
    texts = [c["text"] for c in r["choices"]]
    assert [c["index"] for c in r["choices"]] == list(range(6))
    assert (
        texts[0].startswith("One")
        and texts[1].startswith("One")
        and texts[2].startswith("Two")
        and texts[3].startswith("Two")
    )
    alone = httpx.post(
        url,
        json={"model": NAME, "prompt": "Two", "n": 2, "max_tokens": 2, "echo": True, "temperature": 1, "seed": 3},
        timeout=60,
    ).json()
    assert [c["text"] for c in alone["choices"]] == texts[2:4]  # each prompt answered as if alone
    scored = httpx.post(
        url, json={"model": NAME, "prompt": "Score me", "max_tokens": 0, "echo": True}, timeout=60
    ).json()
    assert scored["choices"][0]["text"] == "Score me" and scored["usage"]["completion_tokens"] == 0
    best = httpx.post(
        url,
        json={"model": NAME, "prompt": "Hi", "n": 2, "best_of": 4, "max_tokens": 3, "temperature": 1, "seed": 1},
        timeout=60,
    ).json()
    openai_spec.check("CreateCompletionResponse", best)
    assert len(best["choices"]) == 2 and all(c["logprobs"] is None for c in best["choices"])
    chunks = [
        json.loads(line[6:])
        for line in httpx.post(
            url,
            json={
                "model": NAME, "prompt": ["a", "b"], "max_tokens": 2, "stream": True, "echo": True,
                "stream_options": {"include_usage": True}
            },
            timeout=60,
        ).text.split("\n")
        if line.startswith("data: {")
    ]
    for c in chunks:
        openai_spec.check("CreateCompletionResponse", _as_completion(c))
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1} and chunks[-1]["usage"][
        "completion_tokens"
    ] == 4


def test_formatters_match_the_spec() -> None:
    """Bodies built without a server (logprobs, tool calls, legacy function calls) are valid."""
    from tokenleap.server.protocol import ChatFormatter, CompletionFormatter
    from tokenleap.server.tools import plan_tools, tool_formatter
    from tokenleap.types import CompletionOutput, Logprob, RequestOutput

    lps = [{7: Logprob(-0.5, 1, "Hi"), 8: Logprob(float("-inf"), 2, "Ho")}, {9: Logprob(-1.0, 1, "!")}]
    out = RequestOutput("r", "p", [1, 2], [CompletionOutput(0, "Hi!", [7, 9], "stop", logprobs=lps)], True)
    chat = ChatFormatter("chatcmpl-1", NAME, "suffix", 2).response(out)
    openai_spec.check("CreateChatCompletionResponse", chat)
    assert chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1]["logprob"] == -9999.0
    openai_spec.check("CreateCompletionResponse", CompletionFormatter("cmpl-1", NAME, None, 2).response(out))
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    }
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    called = RequestOutput("r", None, [1], [CompletionOutput(0, text, [1], "stop")], True)
    for plan, key, finish in (
        (plan_tools([tool], "required"), "tool_calls", "tool_calls"),
        (
            plan_tools([tool], {"type": "function", "function": {"name": "f"}}, legacy=True),
            "function_call",
            "function_call",
        ),
    ):
        body = tool_formatter(ChatFormatter, plan, "chatcmpl-2", NAME, None, 0).response(called)
        openai_spec.check("CreateChatCompletionResponse", body)
        assert key in body["choices"][0]["message"] and body["choices"][0]["finish_reason"] == finish
        fmt = tool_formatter(ChatFormatter, plan, "chatcmpl-2", NAME, None, 0)
        for chunk in [*fmt.first_chunks(), *(c for c in [fmt.delta_chunk(text)] if c), *fmt.final_chunks(called)]:
            openai_spec.check("CreateChatCompletionStreamResponse", chunk)
            openai.types.chat.ChatCompletionChunk.model_validate(chunk)
    cut = RequestOutput(
        "r", None, [1], [CompletionOutput(0, 'Sure <tool_call>\n{"name": "f", "argu', [1], "length")], True
    )
    body = tool_formatter(ChatFormatter, plan_tools([tool], "auto"), "chatcmpl-3", NAME, None, 0).response(cut)
    assert body["choices"][0]["message"]["content"] == "Sure" and body["choices"][0]["finish_reason"] == "length"
