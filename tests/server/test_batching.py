"""The engine loop under load and abuse: 16 concurrent streams each equal to the library's
output, disconnects and timeouts that free their requests, a full queue answered with 429, an
engine failure that fails only its requests, /metrics that move as they should, and shutdowns
that leave no request holding a cache."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
import openai
import pytest

from tokenleap import LLM
from tokenleap.engine.request import Request
from tokenleap.server import BackgroundServer, ServerConfig

from .conftest import MODEL, metrics, reference_chat, wait_idle

pytestmark = pytest.mark.slow

PREFIXES = ("", "Briefly: ", "In one sentence: ", "Answer simply. ")
LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def _prompts(questions: Sequence[str], n: int) -> list[str]:
    return [PREFIXES[i // len(questions) % len(PREFIXES)] + questions[i % len(questions)] for i in range(n)]


def test_16_concurrent_streams_match_library(server: BackgroundServer, llm: LLM, questions: list[str]) -> None:
    prompts = _prompts(questions, 16)
    expected = [reference_chat(llm, p, 12)[0] for p in prompts]
    peak = 0

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                      temperature=0, max_tokens=12, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main() -> list[str]:
        nonlocal peak
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        task = asyncio.gather(*(one(client, p) for p in prompts))
        while not task.done():
            peak = max(peak, server.state.loop.num_running)
            await asyncio.sleep(0.01)
        return await task

    got = asyncio.run(main())
    assert got == expected
    assert peak > 1  # requests were batched, not run one after another


FAULTY = "Count from one to twenty, one number per line."


@pytest.mark.parametrize("fault", ["propose", "forward", "nan-temperature"])
def test_one_failing_request_among_8_streams(server: BackgroundServer, server_llm: LLM, llm: LLM, questions: list[str],
                                             monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """A request whose drafter raises, or whose rows make the batched forward fail (the batch is
    rolled back and retried request by request), ends with an error; the streams batched with it
    finish with exactly their solo text. A NaN temperature is refused before it reaches the batch."""
    good = _prompts(questions, 8 if fault == "nan-temperature" else 7)
    expected = [reference_chat(llm, p, 16)[0] for p in good]
    loop = server.state.loop
    engine = loop.engine
    bad_ids = server_llm.chat_token_ids([{"role": "user", "content": FAULTY}])
    batched_failures = 0

    def bad_request_running() -> Any:
        return next((r for r in loop._live.values() if r.prompt_ids == bad_ids and len(r.output_ids) >= 3), None)

    if fault == "propose":
        real_propose = engine._propose

        def propose(req: Any, k: int) -> Any:
            if req.prompt_ids == bad_ids and len(req.output_ids) >= 3:
                raise RuntimeError("simulated drafter failure")
            return real_propose(req, k)

        monkeypatch.setattr(engine, "_propose", propose)
    elif fault == "forward":
        real_forward = engine.model.forward_batch

        def forward_batch(seqs: Any, **kwargs: Any) -> Any:
            nonlocal batched_failures
            bad = bad_request_running()
            if bad is not None and any(s.kv is bad.kv for s in seqs):
                batched_failures += len(seqs) > 1
                raise RuntimeError("simulated kernel failure")
            return real_forward(seqs, **kwargs)

        monkeypatch.setattr(engine.model, "forward_batch", forward_batch)

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str | Exception:
        try:
            stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                          temperature=0, max_tokens=16, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        except openai.APIError as exc:
            return exc

    async def nan_request() -> httpx.Response:
        await asyncio.sleep(0.5)  # the streams are running
        body = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": NaN}'
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})

    async def main() -> tuple[list[str | Exception], Any]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        if fault == "nan-temperature":
            return tuple(await asyncio.gather(asyncio.gather(*(one(client, p) for p in good)), nan_request()))  # type: ignore[return-value]
        return tuple(await asyncio.gather(asyncio.gather(*(one(client, p) for p in good)), one(client, FAULTY)))  # type: ignore[return-value]

    got, odd = asyncio.run(main())
    assert got == expected
    if fault == "nan-temperature":
        assert odd.status_code == 400 and "finite" in odd.json()["error"]["message"]
    else:
        assert isinstance(odd, openai.APIError) and "internal error: decoding failed" in str(odd), odd
        assert "simulated" not in str(odd)
    if fault == "forward":
        assert batched_failures >= 1  # the batch failed as a whole and was retried one by one
    wait_idle(server)


def test_long_prompt_prefill_is_interleaved_with_running_streams(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt is prefilled one chunk per loop iteration, with a decode step of the
    running stream between chunks: the stream does not stall for the whole prefill."""
    engine = server.state.loop.engine
    calls: list[tuple[str, int]] = []  # appended on the engine thread only
    prefill_step, step_batch = engine.prefill_step, engine.step_batch

    def logged_prefill(req: Request) -> bool:
        calls.append(("prefill", len(req.prompt_ids)))
        return prefill_step(req)

    def logged_step(reqs: Sequence[Request]) -> None:
        calls.append(("step", len(reqs)))
        return step_batch(reqs)

    monkeypatch.setattr(engine, "prefill_step", logged_prefill)
    monkeypatch.setattr(engine, "step_batch", logged_step)
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 120  # > 1000 tokens: several chunks
    with httpx.Client(base_url=server.url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 200, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)  # the first stream is running
            reply = http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 2, "temperature": 0})
            assert reply.status_code == 200
    wait_idle(server)
    chunks = [i for i, (kind, n) in enumerate(calls) if kind == "prefill" and n > engine.prefill_chunk]
    assert len(chunks) >= 4
    between = [calls[a + 1 : b] for a, b in zip(chunks, chunks[1:])]
    assert all(any(kind == "step" for kind, _ in gap) for gap in between), calls


def _abort_count(url: str) -> float:
    return metrics(url)[("tokenleap:request_success_total", (("finished_reason", "abort"),))]


def test_disconnect_mid_stream_frees_the_request(server: BackgroundServer) -> None:
    before = _abort_count(server.url)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert server.state.loop.num_live == 1
        # leaving the block closes the connection mid-stream
    wait_idle(server)
    assert _abort_count(server.url) == before + 1


def test_disconnect_while_waiting_for_a_whole_answer(server: BackgroundServer) -> None:
    before = _abort_count(server.url)
    with pytest.raises(httpx.ReadTimeout):
        # 2000 tokens cannot come within the 0.5 s read timeout (a fast host did 400 in under 1 s)
        httpx.post(
            server.url + "/v1/completions", json={**LONG, "max_tokens": 2000}, timeout=httpx.Timeout(60, read=0.5)
        )
    wait_idle(server)
    assert _abort_count(server.url) == before + 1


def test_metrics_move(client: openai.OpenAI, server: BackgroundServer) -> None:
    before = metrics(server.url)
    prompt = "one two three four five six seven eight nine ten one two three four five six seven eight nine ten one two"
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
    after = metrics(server.url)
    spec = r.model_extra["speculative"]
    assert r.usage is not None

    def delta(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert delta("tokenleap:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("tokenleap:generation_tokens_total") == r.usage.completion_tokens
    assert delta("tokenleap:request_success_total", (("finished_reason", r.choices[0].finish_reason),)) == 1
    assert delta("tokenleap:time_to_first_token_seconds_count") == 1
    assert delta("tokenleap:e2e_request_latency_seconds_count") == 1
    assert delta("tokenleap:inter_token_latency_seconds_count") == r.usage.completion_tokens - 1
    assert delta("tokenleap:spec_decode_num_drafts_total") == spec["num_drafts"] > 0
    assert delta("tokenleap:spec_decode_num_draft_tokens_total") == spec["num_draft_tokens"]
    assert delta("tokenleap:spec_decode_num_accepted_tokens_total") == spec["num_accepted_tokens"] > 0
    per_pos = sum(
        delta(name, labels)
        for (name, labels) in after
        if name == "tokenleap:spec_decode_num_accepted_tokens_per_pos_total"
    )
    assert per_pos == spec["num_accepted_tokens"]
    assert after[("tokenleap:num_requests_running", ())] == 0 and after[("tokenleap:num_requests_waiting", ())] == 0
    assert after[("process_resident_memory_bytes", ())] > 0


def test_queue_full_gets_429(server_llm: LLM, server: BackgroundServer) -> None:
    with BackgroundServer(server_llm, ServerConfig(port=0, log_level="warning", max_num_seqs=1, max_queue=1)) as srv:
        loop = srv.state.loop
        with httpx.Client(base_url=srv.url, timeout=60) as a, httpx.Client(base_url=srv.url, timeout=60) as b:
            with a.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as ra:
                a_lines = ra.iter_lines()  # (kept: dropping the iterator would close the connection)
                next(a_lines)  # A is running
                with b.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as rb:
                    assert rb.status_code == 200
                    deadline = time.monotonic() + 10
                    while loop.num_waiting != 1:  # B is queued behind A
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
                    r = httpx.post(srv.url + "/v1/completions", json={**LONG, "max_tokens": 4})
                    assert r.status_code == 429
                    assert r.json()["error"]["type"] == "rate_limit_error"
                    with pytest.raises(openai.RateLimitError):
                        openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0).completions.create(
                            model=MODEL, prompt="Hi"
                        )
                    assert metrics(srv.url)[("tokenleap:num_requests_waiting", ())] == 1
                    assert metrics(srv.url)[("tokenleap:num_requests_running", ())] == 1
        wait_idle(srv)  # both streams were closed early: A aborted running, B aborted while queued
        counts = metrics(srv.url)
        assert counts[("tokenleap:request_success_total", (("finished_reason", "abort"),))] == 2
        assert httpx.post(srv.url + "/v1/completions", json={**LONG, "max_tokens": 4}).status_code == 200


def test_timeout(server_llm: LLM, server: BackgroundServer) -> None:
    with BackgroundServer(server_llm, ServerConfig(port=0, log_level="warning", timeout=0.15)) as srv:
        # 400 tokens in 150 ms would be 2700 tok/s: out of reach even for a fully accepted draft
        r = httpx.post(srv.url + "/v1/completions", json=LONG, timeout=60)
        assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError, match="timed out"):
            for _ in client.completions.create(
                model=MODEL,
                prompt="Once upon a time",
                max_tokens=400,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                pass
        wait_idle(srv)
        ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
        assert ok.choices[0].finish_reason in ("stop", "length")


def test_engine_failure_fails_only_its_requests(
    server_llm: LLM, server: BackgroundServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server_llm.engine
    real = engine.step_batch
    calls = {"n": 0}

    def flaky(reqs: Sequence[Request]) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated kernel failure")
        return real(reqs)

    monkeypatch.setattr(engine, "step_batch", flaky)
    with BackgroundServer(server_llm, ServerConfig(port=0, log_level="critical")) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={**LONG, "max_tokens": 8}, timeout=60)
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "internal error: decoding failed"
        assert "Traceback" not in r.text and "simulated" not in r.text
        wait_idle(srv)
        r = httpx.post(srv.url + "/v1/completions", json={**LONG, "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_graceful_shutdown_finishes_in_flight_requests(server_llm: LLM, server: BackgroundServer) -> None:
    srv = BackgroundServer(server_llm, ServerConfig(port=0, log_level="critical", shutdown_timeout=30))
    chunks: list[str] = []
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 24, "stream": True}) as r:
            lines = r.iter_lines()
            chunks.append(next(lines))
            stopper = threading.Thread(target=srv.stop)
            stopper.start()
            chunks.extend(lines)
    stopper.join(60)
    assert [c for c in chunks if c][-1] == "data: [DONE]"  # the stream ran to its end during the shutdown
    assert '"finish_reason":"length"' in chunks[-4] + chunks[-3] + chunks[-2]
    assert srv.state.loop.num_live == 0 and not srv.state.loop.alive
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health")


def test_shutdown_cancels_what_does_not_finish_in_time(server_llm: LLM, server: BackgroundServer) -> None:
    srv = BackgroundServer(server_llm, ServerConfig(port=0, log_level="critical", shutdown_timeout=0.3))
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 4000, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            srv.stop()
            with pytest.raises(httpx.HTTPError):
                for _ in lines:
                    pass
    assert srv.state.loop.num_live == 0
    assert srv.state.loop.num_added == srv.state.loop.num_freed == 1
