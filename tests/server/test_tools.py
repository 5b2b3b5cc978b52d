"""Tool calling (server/tools.py): request checks, Hermes parsing, and calls generated under the grammar."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tokenleap import LLM
from tokenleap.errors import TokenleapError
from tokenleap.sampling import SamplingParams
from tokenleap.server.tools import parse_tool_calls, plan_tools, render_message

from .conftest import MODEL

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 10}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_plan_checks_and_parse() -> None:
    assert not plan_tools(None, None).active and plan_tools([WEATHER], None).choice == "auto"
    assert not plan_tools([WEATHER], "none").active
    for tools, choice, msg in (
        ([{"type": "x"}], None, "tools[0]"),
        ([WEATHER, WEATHER], None, "duplicate"),
        ([WEATHER], "sometimes", "tool_choice must be"),
        (None, "required", "needs tools"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}], None, "tool 'f'"),
    ):
        with pytest.raises(TokenleapError, match=re.escape(msg)):
            plan_tools(tools, choice)
    plan = plan_tools([WEATHER, TIME], "auto")
    text = (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text, plan)
    assert content == "Sure." and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}
    assert parse_tool_calls("no calls here", plan) == ("no calls here", [])
    assert render_message("tool", "18 C") == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    rendered = render_message("assistant", "", [{"function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}])
    assert rendered["content"] == '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


def test_grammar_accepts_only_declared_calls(llm: LLM) -> None:
    """The required-call grammar admits a valid call and refuses an undeclared name or bad arguments."""
    import llguidance

    from tokenleap.structured import GrammarState, GrammarTokenizer

    tok = GrammarTokenizer(llm.tokenizer.hf, llm.model.config.vocab_size)
    constraint = plan_tools([WEATHER, TIME], "required").constraint()
    assert constraint is not None
    enc = llm.tokenizer.hf.encode
    good = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    for text, ok in ((good, True), (good.replace("get_time", "get_date"), False), (good.replace('"UTC"', "5"), False)):
        state = GrammarState(tok, constraint)
        ids = enc(text, add_special_tokens=False)
        assert (state.matcher.validate_tokens(ids) == len(ids)) == ok, text
    del llguidance


@pytest.mark.slow
def test_server_tool_calls(client: openai.OpenAI, llm: LLM) -> None:
    named = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=60,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # the server speculates (suffix); the library decoding plainly under the same prompt and grammar gives the same call
    plan = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    ref = llm.chat(
        [plan.messages(MESSAGES, False)],
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=plan.constraint()),
        use_tqdm=False,
    )[0].outputs[0]
    assert parse_tool_calls(ref.text, plan)[1][0]["function"] == call.function.model_dump()
    required = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.8, seed=3, max_tokens=80,
                                              tools=[WEATHER, TIME], tool_choice="required")
    rc = required.choices[0]
    assert rc.finish_reason in ("tool_calls", "length")
    if rc.finish_reason == "tool_calls":
        assert all(c.function.name in ("get_weather", "get_time") for c in rc.message.tool_calls or [])
    # a second turn with the call and its result renders and answers
    turn2 = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    r2 = client.chat.completions.create(
        model=MODEL, messages=turn2, temperature=0, max_tokens=16, tools=[WEATHER], tool_choice="auto"
    )
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8, tools=[WEATHER], tool_choice="none"
    )
    assert plain.choices[0].message.tool_calls is None


@pytest.mark.slow
def test_server_tool_calls_streamed(client: openai.OpenAI) -> None:
    """Streamed: no `<tool_call>` text in the content deltas, the calls in a tool_calls delta, the
    same call as the non-streamed answer."""
    kwargs: dict = dict(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=60, tools=[WEATHER, TIME], tool_choice="required"
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        calls += d.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert "<tool_call>" not in content and finish == whole.finish_reason
    assert [c.function.model_dump() for c in calls] == [c.function.model_dump() for c in whole.message.tool_calls or []]
    auto = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        stream=True, **{**kwargs, "tool_choice": "auto", "max_tokens": 12}) if c.choices)
    ref = client.chat.completions.create(**{**kwargs, "tool_choice": "auto", "max_tokens": 12}).choices[0].message
    assert ref.tool_calls or auto == ref.content


def test_stream_holdback() -> None:
    """Content streams until a call may begin; the call text never reaches a content delta."""
    from tokenleap.server.protocol import ChatFormatter
    from tokenleap.server.tools import tool_formatter
    from tokenleap.types import CompletionOutput, RequestOutput

    plan = plan_tools([WEATHER], "auto")
    fmt = tool_formatter(ChatFormatter, plan, "chatcmpl-x", MODEL, None, 0)
    text = (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n'
        "</tool_call>"
    )
    pieces = ["Let me", " check. <", "tool_", "call>\n{\"name\"", text[len('Let me check. <tool_call>\n{"name"'):]]
    assert "".join(pieces) == text
    sent = [c["choices"][0]["delta"]["content"] for p in pieces if (c := fmt.delta_chunk(p)) is not None]
    assert "".join(sent) == "Let me check. "
    out = RequestOutput("r", None, [1], [CompletionOutput(0, text, [1, 2], "stop")], True)
    chunks = fmt.final_chunks(out)
    assert [c["choices"][0]["delta"] for c in chunks[:-1]][0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    plain = tool_formatter(ChatFormatter, plan, "chatcmpl-y", MODEL, None, 0)
    assert plain.delta_chunk("a <tool") is not None
    tail = plain.final_chunks(RequestOutput("r", None, [1], [CompletionOutput(0, "a <tool", [1], "length")], True))
    assert tail[0]["choices"][0]["delta"]["content"] == "<tool" and tail[-1]["choices"][0]["finish_reason"] == "length"


def test_auto_grammar(llm: LLM) -> None:
    """"auto": free text without the tag, or text then valid calls; never a malformed call."""
    from tokenleap.structured import GrammarState, GrammarTokenizer

    tok = GrammarTokenizer(llm.tokenizer.hf, llm.model.config.vocab_size)
    constraint = plan_tools([WEATHER, TIME], "auto").constraint()
    assert constraint is not None
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    for text, ok in (("It is sunny, a < b.", True), ("Let me look. " + call, True), (call + call, True),
                     ("x " + call.replace("get_time", "get_date"), False), ("x " + call + " and more", False),
                     ("x <tool_call>\nnot json", False)):
        state = GrammarState(tok, constraint)
        ids = llm.tokenizer.hf.encode(text, add_special_tokens=False)
        assert (state.matcher.validate_tokens(ids) == len(ids)) == ok, text
