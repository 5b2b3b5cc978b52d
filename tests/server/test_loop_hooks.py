"""EngineLoop's hooks for code that extends the server (tokenleap.ray uses them): finish
listeners see every finished request's job and output on the engine thread, and `call_soon`
runs a function on the engine thread between steps."""

from __future__ import annotations

import threading

import openai

from tokenleap.server import BackgroundServer
from tokenleap.server.loop import Job
from tokenleap.types import RequestOutput

from .conftest import MODEL


def test_finish_listener_and_call_soon(server: BackgroundServer, client: openai.OpenAI) -> None:
    loop = server.state.loop
    seen: list[tuple[str, list[int], str, str]] = []

    def listen(job: Job, out: RequestOutput | None, reason: str) -> None:
        seen.append(
            (threading.current_thread().name, list(out.outputs[0].token_ids) if out else [], reason, job.request_id)
        )

    loop.finish_listeners.append(listen)
    try:
        r = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=5, temperature=0)
    finally:
        loop.finish_listeners.remove(listen)
    assert len(seen) == 1
    thread, ids, reason, request_id = seen[0]
    assert (
        thread == "tokenleap-engine"
        and len(ids) == r.usage.completion_tokens
        and reason == "length"
        and request_id == r.id
    )
    ran = threading.Event()
    where: list[str] = []
    loop.call_soon(lambda: (where.append(threading.current_thread().name), ran.set()))
    assert ran.wait(10) and where == ["tokenleap-engine"]
    loop.call_soon(lambda: 1 / 0)  # a failing call is logged and dropped; the loop goes on
    done = threading.Event()
    loop.call_soon(done.set)
    assert done.wait(10) and loop.alive
