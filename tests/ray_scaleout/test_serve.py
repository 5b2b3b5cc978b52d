"""tokenleap serve on Ray Serve (2 replicas): the openai client through the ingress gets the
single server's answers, errors and API key; session affinity; statistics sharing; /metrics
labelled per replica; Ray Data equals LLM.generate. The fault-injection test is last (it kills a
replica and waits for its replacement)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tokenleap import LLM, SamplingParams

from .conftest import API_KEY, AUTH, MODEL, replica_stats, sessions_on_each_replica, wait_for

pytestmark = pytest.mark.slow

QUESTION = "List the first five prime numbers and say why 1 is not prime."


def _client(url: str, session: str | None = None, key: str = API_KEY) -> openai.OpenAI:
    headers = {"x-session-id": session} if session else None
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120, default_headers=headers)


def _reference(llm: LLM, question: str, max_tokens: int) -> tuple[str, list[int]]:
    out = llm.chat(
        [{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False
    )[0]
    return out.outputs[0].text, list(out.outputs[0].token_ids)


def test_plain_and_streaming_equal_single_server_answers(ray_server: str, llm: LLM) -> None:
    text, _ = _reference(llm, QUESTION, 40)
    c = _client(ray_server)
    r = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=40, temperature=0
    )
    assert r.choices[0].message.content == text
    assert r.usage is not None and r.usage.completion_tokens > 0
    chunks = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=40,
                                       temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    plain = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=40,
                                      temperature=0, extra_body={"speculative": {"method": "none"}})
    assert plain.choices[0].message.content == text
    comp = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    ref = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert comp.choices[0].text == ref.outputs[0].text


def test_errors_and_api_key(ray_server: str) -> None:
    c = _client(ray_server)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=0)
    assert "n must be in [1, 128]" in str(exc.value)
    with pytest.raises(openai.AuthenticationError):
        _client(ray_server, key="wrong").models.list()
    r = httpx.post(
        ray_server + "/v1/chat/completions", content=b"{not json", headers={**AUTH, "content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(ray_server + "/v1/completions", content=b"x" * (70 * 1024), headers=AUTH)
    assert r.status_code == 413
    assert httpx.get(ray_server + "/health").status_code == 200  # never behind the key
    assert [m.id for m in c.models.list().data] == [MODEL]


def test_session_affinity(ray_server: str) -> None:
    by_replica = sessions_on_each_replica(ray_server)
    assert len(by_replica) == 2
    for rid, session in by_replica.items():
        c = _client(ray_server, session)
        for _ in range(3):
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "Say yes."}], max_tokens=4, temperature=0
            )
            assert raw.headers["x-tokenleap-replica"] == rid
    # no header: the conversation's first messages are the key, so a conversation stays put
    convo = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    seen = set()
    for turn in range(3):
        msgs = (
            convo
            + [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": f"Another ({turn})?"}][: 2 * turn]
        )
        raw = _client(ray_server).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, max_tokens=4, temperature=0
        )
        seen.add(raw.headers["x-tokenleap-replica"])
    assert len(seen) == 1


def test_sharing_teaches_the_other_replica_and_greedy_stays_identical(ray_server: str, llm: LLM) -> None:
    (r1, s1), (r2, s2) = sorted(sessions_on_each_replica(ray_server).items())
    question = "Write a Python function that returns the factorial of n, with a docstring."
    text, ids = _reference(llm, question, 48)
    before = replica_stats(ray_server, s2)
    first = _client(ray_server, s1).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=48, temperature=0
    )
    assert first.choices[0].message.content == text
    after = wait_for(lambda: (st := replica_stats(ray_server, s2))["ingested"] > before["ingested"] and st)
    # r2's global suffix tree learned r1's answer
    assert after["cached_outputs"]["suffix"] > before["cached_outputs"]["suffix"]
    raw = httpx.post(
        ray_server + "/v1/chat/completions",
        headers={**AUTH, "x-session-id": s2},
        json={"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 48, "temperature": 0},
    )
    body = raw.raise_for_status().json()
    assert raw.headers["x-tokenleap-replica"] == r2
    assert body["choices"][0]["message"]["content"] == text
    # r2 never answered this question itself, yet drafts it from r1's answer
    assert body["speculative"]["num_accepted_tokens"] >= len(ids) // 2


def test_metrics_labelled_per_replica(ray_server: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def replicas() -> set[str]:
        text = httpx.get(ray_server + "/metrics").raise_for_status().text
        return {
            s.labels["replica"]
            for f in text_string_to_metric_families(text)
            if f.name == "tokenleap:generation_tokens"
            for s in f.samples
        }

    assert wait_for(lambda: len(replicas()) == 2, timeout=30)


def test_ray_data_equals_llm_generate(ray_server: str, llm: LLM, questions: list[str]) -> None:
    import ray.data

    from tokenleap.ray import build_processor

    prompts = [q[:200] for q in questions[:6]]
    params = SamplingParams(temperature=0, max_tokens=24)
    proc = build_processor(
        MODEL, speculative_config={"method": "suffix"}, sampling_params=params, batch_size=3, concurrency=1
    )
    rows = proc(ray.data.from_items([{"prompt": p, "i": i} for i, p in enumerate(prompts)])).take_all()
    got = {int(r["i"]): (r["generated_text"], list(r["generated_token_ids"])) for r in rows}
    ref = llm.generate(prompts, params, use_tqdm=False)
    assert got == {i: (o.outputs[0].text, list(o.outputs[0].token_ids)) for i, o in enumerate(ref)}


def test_zz_killed_replica_is_replaced_and_the_other_finishes(ray_server: str, llm: LLM) -> None:
    import threading

    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    (victim, s_victim), (survivor, s_survivor) = sorted(sessions_on_each_replica(ray_server).items())
    question = "Tell a long story about a lighthouse keeper and a storm."
    text, _ = _reference(llm, question, 96)
    results: dict[str, list] = {"victim": [], "survivor": []}

    def stream(name: str, session: str) -> None:
        try:
            chunks = _client(ray_server, session).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=96, temperature=0, stream=True
            )
            results[name].append("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))
        except openai.APIError as exc:  # the clean end of a killed replica's stream
            results[name].append(exc)

    def whole(session: str) -> None:  # not streamed: nothing is sent before the end, so it can be retried
        try:
            r = _client(ray_server, session).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=96, temperature=0)
            results["whole"].append(r.choices[0].message.content)
        except openai.APIError as exc:
            results["whole"].append(exc)

    results["whole"] = []
    threads = [
        threading.Thread(target=stream, args=(n, s))
        for n, s in (("victim", s_victim), ("survivor", s_survivor))
        for _ in range(2)
    ]
    threads.append(threading.Thread(target=whole, args=(s_victim,)))
    for t in threads:
        t.start()
    wait_for(lambda: replica_stats(ray_server, s_victim)["live"] >= 1, timeout=30, every=0.05)
    info = replica_stats(ray_server, s_victim)
    ray.kill(ray.get_actor(info["actor"], namespace=SERVE_NAMESPACE), no_restart=True)
    for t in threads:
        t.join(180)
    assert results["survivor"] == [text, text]
    assert len(results["victim"]) == 2
    for r in results["victim"]:  # each ends: a clean error, or (finished first) the right answer
        assert isinstance(r, openai.APIError) or r == text
    assert results["whole"] == [text]  # retried on the surviving replica
    # Serve replaces the replica; the new one serves
    def replaced() -> bool:
        try:
            return victim not in sessions_on_each_replica(ray_server, tries=16)
        except (AssertionError, httpx.HTTPError):  # one replica only, for now
            return False

    wait_for(replaced, timeout=240, every=1.0)
    r = _client(ray_server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0
    )
    assert r.choices[0].message.content == _reference(llm, QUESTION, 16)[0]
