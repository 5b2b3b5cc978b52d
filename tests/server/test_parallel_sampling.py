"""The server schedules as the library does (one scheduler, engine/scheduler.py): a request for n
samples prefills its prompt once and forks the KV cache for the others, and its n completions
are the ones `LLM.generate` returns for the same seed and parameters, whole or streamed; with
best_of the extra samples are forks too."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tokenleap import LLM, SamplingParams
from tokenleap.engine.request import Request
from tokenleap.server import BackgroundServer

from .conftest import MODEL, wait_idle

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a quiet village by the sea,"


@pytest.fixture()
def counted(server: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[Any]]]:
    """The server engine's prefill chunks (by request id) and forks (by sample index), recorded on
    the engine thread."""
    engine = server.state.loop.engine
    seen: dict[str, list[Any]] = {"prefill": [], "fork": []}
    prefill_step, fork = engine.prefill_step, engine.fork

    def counting_prefill(req: Request) -> bool:
        seen["prefill"].append(req.request_id)
        return prefill_step(req)

    def counting_fork(parent: Request, i: int, **kw: Any) -> Request:
        seen["fork"].append(i)
        return fork(parent, i, **kw)

    monkeypatch.setattr(engine, "prefill_step", counting_prefill)
    monkeypatch.setattr(engine, "fork", counting_fork)
    yield seen
    wait_idle(server)


def test_n_samples_prefill_once_and_equal_the_library(client: openai.OpenAI, server: BackgroundServer, server_llm: LLM,
                                                      counted: dict[str, list[Any]]) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=3, seed=21, temperature=0.9, top_p=0.95, max_tokens=12,
                                  extra_body={"ignore_eos": True})
    assert len(set(counted["prefill"])) == 1 and counted["prefill"][0] == r.id + "-0"  # one prompt prefilled, once
    assert counted["fork"] == [1, 2]
    wait_idle(server)  # the engine thread is idle: the library may use the same engine now
    offline = server_llm.generate(
        PROMPT,
        SamplingParams(n=3, seed=21, temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [c.text for c in offline.outputs]
    assert len({c.text for c in r.choices}) > 1  # sampled apart
    assert r.usage is not None and r.usage.completion_tokens == 3 * 12


def test_streamed_n_samples_and_best_of_prefill_once(client: openai.OpenAI, server: BackgroundServer, server_llm: LLM,
                                                     counted: dict[str, list[Any]]) -> None:
    messages = [{"role": "user", "content": "Name a colour and a fruit."}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, n=2, seed=5, temperature=0.8, max_tokens=10, stream=True
        )
    )
    texts = ["", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert len(set(counted["prefill"])) == 1 and counted["fork"] == [1]
    wait_idle(server)
    offline = server_llm.chat(messages, SamplingParams(n=2, seed=5, temperature=0.8, max_tokens=10), use_tqdm=False)[0]
    assert texts == [c.text for c in offline.outputs]
    counted["prefill"].clear()
    counted["fork"].clear()
    best = client.completions.create(model=MODEL, prompt=PROMPT, n=1, best_of=3, seed=2, temperature=1.0, max_tokens=4)
    assert len(best.choices) == 1 and len(set(counted["prefill"])) == 1 and counted["fork"] == [1, 2]
