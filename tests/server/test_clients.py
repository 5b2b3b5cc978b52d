"""Real clients against the real default model (greedy, max_tokens 64), each answer the same with
the server's speculation (suffix) and without it: LangChain's `ChatOpenAI` (`bind_tools` with a
forced tool, `with_structured_output`) and instructor's JSON-schema and tools modes. instructor is
not a dependency (it pins an older `openai`): its two modes are sent here as the bodies it sends
(captured from instructor 1.17: `response_format` json_schema with the model's pydantic schema;
`tools` with one function and a named `tool_choice`) and parsed as it parses them.

The schemas say nothing of `additionalProperties`: the server's strict reading (the default) is
what makes a small model's object end, so a forced call always parses and validates.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel

from tokenleap.server import BackgroundServer

from .conftest import MODEL

pytestmark = pytest.mark.slow

OFF = {"speculative": {"method": "none"}}


class Person(BaseModel):
    """A person."""

    name: str
    age: int


class Weather(BaseModel):
    """Get the current weather of a city."""

    city: str
    unit: Literal["celsius", "fahrenheit"]


class Book(BaseModel):
    """A book."""

    title: str
    author: str
    year: int


class Todo(BaseModel):
    """A task on a to-do list."""

    task: str
    done: bool


class Location(BaseModel):
    """A place."""

    city: str
    country: str


CASES: list[tuple[type[BaseModel], str]] = [
    (Person, "John is 30 years old. Extract the person."),
    (Weather, "What is the weather in Paris?"),
    (Book, "1984 was written by George Orwell in 1949. Extract the book."),
    (Todo, "I still have to buy milk. Make a to-do item."),
    (Location, "I live in Lyon, France. Where do I live?"),
]


@pytest.fixture(scope="module")
def chat_openai(server: BackgroundServer) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")

    def make(**extra: Any) -> Any:
        return langchain_openai.ChatOpenAI(
            model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=64, max_retries=0,
            timeout=120, extra_body=extra or None
        )

    return make


@pytest.mark.parametrize(("schema", "question"), CASES, ids=[c[0].__name__ for c in CASES])
def test_langchain_forced_tool(chat_openai: Any, schema: type[BaseModel], question: str) -> None:
    calls = []
    for extra in ({}, OFF):
        msg = chat_openai(**extra).bind_tools([schema], tool_choice=schema.__name__).invoke(question)
        assert msg.content == "" and len(msg.tool_calls) == 1, msg
        call = msg.tool_calls[0]
        assert call["name"] == schema.__name__
        schema.model_validate(call["args"])
        assert msg.response_metadata["finish_reason"] == "tool_calls"
        calls.append(call["args"])
    assert calls[0] == calls[1]  # lossless speculation


def test_langchain_structured_output(chat_openai: Any) -> None:
    for method in ("json_schema", "function_calling"):
        answers = [
            chat_openai(**extra).with_structured_output(Person, method=method).invoke(CASES[0][1])
            for extra in ({}, OFF)
        ]
        assert isinstance(answers[0], Person) and answers[0] == answers[1], (method, answers)


def _instructor_json_schema(schema: type[BaseModel], question: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": question}],
        "model": MODEL,
        "max_tokens": 64,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": schema.__name__, "schema": schema.model_json_schema()},
        },
    }


def _instructor_tools(schema: type[BaseModel], question: str) -> dict[str, Any]:
    description = f"Correctly extracted `{schema.__name__}` with all the required parameters with correct types"
    parameters = {k: v for k, v in schema.model_json_schema().items() if k not in ("title", "description")}
    return {
        "messages": [{"role": "user", "content": question}],
        "model": MODEL,
        "max_tokens": 64,
        "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": schema.__name__}},
        "tools": [
            {
                "type": "function",
                "function": {"name": schema.__name__, "description": description, "parameters": parameters},
            }
        ],
    }


@pytest.mark.parametrize(("schema", "question"), CASES, ids=[c[0].__name__ for c in CASES])
def test_instructor_modes(client: openai.OpenAI, schema: type[BaseModel], question: str) -> None:
    modes = (("json_schema", _instructor_json_schema),) + (
        (("tools", _instructor_tools),) if schema in (Person, Book) else ()
    )
    for mode, body in modes:
        parsed = []
        for extra in ({}, OFF):
            kwargs = body(schema, question)
            r = client.chat.completions.create(**kwargs, extra_body=extra)
            choice = r.choices[0]
            if mode == "tools":
                assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, r
                parsed.append(schema.model_validate_json(choice.message.tool_calls[0].function.arguments))
            else:
                assert choice.finish_reason == "stop", r
                parsed.append(schema.model_validate_json(choice.message.content or ""))
        assert parsed[0] == parsed[1], (mode, parsed)


def test_lenient_mode_reads_schemas_as_json_schema(client: openai.OpenAI) -> None:
    """`json_schema_mode: lenient` (a request's own switch): undeclared properties allowed again,
    so the issue's runaway object comes back; strict (default) closes the object."""
    body = _instructor_json_schema(Person, "Describe a person named John.")
    strict = client.chat.completions.create(**{**body, "max_tokens": 48})
    assert set(json.loads(strict.choices[0].message.content or "")) <= {"name", "age"}
    lenient = client.chat.completions.create(**{**body, "max_tokens": 48}, extra_body={"json_schema_mode": "lenient"})
    assert lenient.choices[0].message.content != strict.choices[0].message.content


def test_forced_tool_cut_by_max_tokens(client: openai.OpenAI) -> None:
    """A named call cut by max_tokens: finish "length", no raw call text in the content."""
    r = client.chat.completions.create(**{**_instructor_tools(Book, CASES[2][1]), "max_tokens": 6})
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls and not choice.message.content
    stream = client.chat.completions.create(**{**_instructor_tools(Book, CASES[2][1]), "max_tokens": 6}, stream=True)
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "<tool_call>" not in content


def test_parallel_tool_calls_and_allowed_tools(client: openai.OpenAI) -> None:
    tools = _instructor_tools(Weather, "What is the weather in Paris and in Rome?")["tools"] + \
        _instructor_tools(Location, "x")["tools"]
    base = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris and in Rome?"}],
        "max_tokens": 64,
        "temperature": 0,
        "tools": tools,
    }
    single = client.chat.completions.create(**base, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert single.finish_reason in ("tool_calls", "length")
    assert len(single.message.tool_calls or []) <= 1
    allowed = {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "Location"}}]},
    }
    only = client.chat.completions.create(**base, extra_body={"tool_choice": allowed}).choices[0]
    assert all(c.function.name == "Location" for c in only.message.tool_calls or []) and only.finish_reason in (
        "tool_calls",
        "length",
    )
