"""Server test fixtures: a real server (uvicorn on a background thread, a free loopback port)
over the real default model with suffix speculation by default, the official `openai` clients
pointed at it, and helpers to read /metrics and to wait until the server holds no request."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenleap import LLM, SamplingParams
from tokenleap.server import BackgroundServer, ServerConfig

MODEL = "smollm2-135m-instruct"
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="session")
def server_llm() -> LLM:
    """The model the servers serve (its own instance: references come from the `llm` fixture,
    so computing them never touches the engine a server thread owns)."""
    return LLM(speculative_config={"method": "suffix"})


@pytest.fixture(scope="session")
def server(server_llm: LLM) -> Iterator[BackgroundServer]:
    srv = BackgroundServer(server_llm, ServerConfig(port=0, log_level="warning", max_request_bytes=BODY_LIMIT))
    yield srv
    srv.stop()
    assert srv.state.loop.num_live == 0


@pytest.fixture()
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def wait_idle(srv: BackgroundServer, timeout: float = 30.0) -> None:
    """Wait until the server runs, queues and holds no request (nothing leaked)."""
    loop = srv.state.loop
    deadline = time.monotonic() + timeout
    while loop.num_live or loop.num_running or loop.num_waiting:
        assert time.monotonic() < deadline, (
            f"server not idle: live={loop.num_live} running={loop.num_running} waiting={loop.num_waiting}"
        )
        time.sleep(0.02)
    assert loop.num_added == loop.num_freed


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every server test: the shared server holds no request."""
    yield
    if "server" in request.fixturenames:
        wait_idle(request.getfixturevalue("server"))


def metrics(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels without model_name): value}."""
    text = httpx.get(url + "/metrics", headers=headers).raise_for_status().text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def reference_chat(llm: LLM, question: str, max_tokens: int) -> tuple[str, list[int], str]:
    """The library's plain greedy answer: text, token ids, finish reason."""
    out = llm.chat(
        [{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False
    )[0]
    c = out.outputs[0]
    return c.text, c.token_ids, c.finish_reason or ""


def reference_completion(llm: LLM, prompt: str | list[int], max_tokens: int) -> tuple[str, list[int], str]:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
    c = out.outputs[0]
    return c.text, c.token_ids, c.finish_reason or ""
