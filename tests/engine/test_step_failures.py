"""A batched step that fails is transactional: a request whose drafter or verification fails is
rolled back to its state before the step (cache, generator, controller; nothing appended) while
the others are stepped; a failed batched forward rolls every request back. Either way the
surviving requests' outputs equal their solo outputs (real model, greedy and seeded sampling)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

import tokenleap
from tokenleap import SpecConfig
from tokenleap.drafters.base import Draft, DraftRequest
from tokenleap.drafters.ngram import NgramDrafter
from tokenleap.engine.engine import Engine, StepFailures
from tokenleap.engine.request import Request
from tokenleap.sampling import SamplingParams

pytestmark = pytest.mark.slow


class FaultyDrafter:
    """Prompt lookup that raises in `propose` (or `accept`) from its `after`-th call on."""

    name = "faulty"
    needs_hidden_states = False

    def __init__(self, where: str, after: int = 3) -> None:
        self.where, self.after, self.calls = where, after, 0
        self.lookup = NgramDrafter()

    def begin(self, request: DraftRequest) -> None: ...

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        if self.where == "propose":
            self.calls += 1
            if self.calls >= self.after:
                raise RuntimeError("drafter bug")
        draft = self.lookup.propose(request_id, tokens, max_tokens)
        return draft if draft.tokens else Draft([tokens[-1]])  # always something to verify

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        if self.where == "accept":
            self.calls += 1
            if self.calls >= self.after:
                raise RuntimeError("drafter bug")

    def end(self, request_id: str) -> None: ...


def _state(req: Request) -> tuple[Any, ...]:
    return (req.kv.length, list(req.output_ids), req.text, req.generator.get_state().clone(), req.finished)


def _prompts(llm: tokenleap.LLM, questions: list[str]) -> list[list[int]]:
    return [llm.chat_token_ids([{"role": "user", "content": q}]) for q in questions[:4]]


PARAMS = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0.8, seed=7, max_tokens=24),
          SamplingParams(temperature=0, max_tokens=20), SamplingParams(temperature=0, max_tokens=24)]
SPECS: list[SpecConfig | bool] = [SpecConfig(method="ngram", adaptive=False, num_speculative_tokens=4),
                                  SpecConfig(method="ngram", adaptive=False, num_speculative_tokens=4), False,
                                  SpecConfig(method="suffix")]


def _solo(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [engine.run(engine.add_request(p, sp, speculative=s)).output_ids for p, sp, s in zip(prompts, PARAMS, SPECS)]


def _start(engine: Engine, prompts: list[list[int]], faulty: SpecConfig) -> list[Request]:
    reqs = [engine.add_request(p, sp, speculative=s) for p, sp, s in zip(prompts, PARAMS, SPECS)]
    reqs.append(engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=24), speculative=faulty))
    for r in reqs:
        engine.start(r)
    return reqs


def _finish(engine: Engine, reqs: list[Request]) -> None:
    running = [r for r in reqs if not r.finished]
    while running:
        engine.step_batch(running)
        running = [r for r in running if not r.finished]
    for r in reqs:
        engine.finish(r)


@pytest.mark.parametrize("where", ["propose", "accept"])
def test_a_failing_drafter_fails_only_its_request(llm: tokenleap.LLM, questions: list[str], where: str) -> None:
    engine = llm.engine
    prompts = _prompts(llm, questions)
    solo = _solo(engine, prompts)
    faulty = SpecConfig(method="custom", drafter=FaultyDrafter(where), adaptive=False, num_speculative_tokens=4)
    reqs = _start(engine, prompts, faulty)
    bad = reqs[-1]
    failed = None
    for _ in range(10):
        before = _state(bad)
        try:
            engine.step_batch(reqs)
        except StepFailures as exc:
            failed = exc
            break
    assert failed is not None and [r for r, _ in failed.failures] == [bad]
    assert "drafter bug" in str(failed.failures[0][1])
    after = _state(bad)
    assert after[:3] == before[:3] and bool((after[3] == before[3]).all())  # rolled back
    _finish(engine, reqs[:-1])
    engine.finish(bad, "abort")
    assert [r.output_ids for r in reqs[:-1]] == solo


def test_a_failing_forward_rolls_the_whole_batch_back(llm: tokenleap.LLM, questions: list[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    prompts = _prompts(llm, questions)
    solo = _solo(engine, prompts)
    reqs = _start(engine, prompts, SpecConfig(method="ngram", prompt_lookup_max=3))
    for _ in range(3):
        engine.step_batch(reqs)
    model = engine.model
    real = model.forward_batch

    def broken(seqs: Any, **kwargs: Any) -> Any:
        for s in seqs:  # the cache is half written when the forward dies
            s.kv.reserve(len(s.input_ids))
            s.kv.commit(len(s.input_ids))
        raise RuntimeError("kernel failure")

    before = [_state(r) for r in reqs]
    monkeypatch.setattr(model, "forward_batch", broken)
    with pytest.raises(RuntimeError, match="kernel failure"):
        engine.step_batch(reqs)
    monkeypatch.setattr(model, "forward_batch", real)
    for b, r in zip(before, reqs):
        a = _state(r)
        assert a[:3] == b[:3] and bool((a[3] == b[3]).all())
    _finish(engine, reqs)
    assert [r.output_ids for r in reqs[:-1]] == solo
