"""Continuous batching in the engine: batched steps give each request exactly its solo output;
the batch draft planner speculates less as the batch grows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

import tokenleap
from tokenleap import SpecConfig
from tokenleap.engine.engine import Engine
from tokenleap.engine.request import Request
from tokenleap.engine.speculation import CostCurve, plan_batch_drafts
from tokenleap.models.base import ModelOutput, SeqInput
from tokenleap.models.llama import LlamaModel
from tokenleap.sampling import SamplingParams

# --------------------------------------------------------------------------- planner


def _linear_curve(per_row: float, rows: int = 64) -> CostCurve:
    """A forward of n rows costs 1 + per_row * (n - 1) single-row forwards."""
    return CostCurve(tuple(1.0 + per_row * (n - 1) for n in range(1, rows + 1)))


def test_planner_single_request_takes_long_drafts_when_rows_are_cheap() -> None:
    ks = plan_batch_drafts(_linear_curve(0.02), [0.8], [16], [0])
    assert ks[0] >= 8


def test_planner_stops_speculating_when_acceptance_is_low() -> None:
    assert plan_batch_drafts(_linear_curve(0.1), [0.05, 0.05], [8, 8], [0, 0]) == [0, 0]


def test_planner_favours_the_predictable_request() -> None:
    ks = plan_batch_drafts(_linear_curve(0.08), [0.9, 0.3], [8, 8], [0, 0])
    assert ks[0] > ks[1]


def test_planner_speculates_less_as_the_batch_grows() -> None:
    """Rows cost little up to 8, then each row costs as much as a whole single-row forward
    (the forward is compute-bound): a batch of 16 should not draft at all."""
    curve = CostCurve(tuple(1.0 + 0.05 * (n - 1) if n <= 8 else 1.35 + 0.9 * (n - 8) for n in range(1, 200)))
    small = sum(plan_batch_drafts(curve, [0.7] * 2, [8] * 2, [0] * 2))
    large = sum(plan_batch_drafts(curve, [0.7] * 16, [8] * 16, [0] * 16))
    assert small >= 4 and large == 0


def test_planner_respects_budgets_floors_and_fixed_requests() -> None:
    ks = plan_batch_drafts(_linear_curve(0.01), [0.99, None, 0.99], [3, 5, 0], [0, 0, 0])
    assert ks == [3, 5, 0]
    ks = plan_batch_drafts(_linear_curve(0.01), [0.99], [8], [4])
    assert ks[0] == 0 or ks[0] >= 4


def test_curve_extrapolates_past_the_measured_rows() -> None:
    curve = CostCurve((1.0, 1.1, 1.3))
    assert curve.rows_cost(3) == 1.3 and curve.rows_cost(5) == pytest.approx(1.7)


def test_curve_interpolates_between_contexts() -> None:
    curve = CostCurve((1.0, 1.1, 1.2), long=(1.0, 1.5, 2.0), short_context=100, long_context=1100)
    assert curve.cost(2, context=50) == pytest.approx(1.2)
    assert curve.cost(2, context=600) == pytest.approx(1.6)
    assert curve.cost(2, context=1100) == pytest.approx(2.0)
    assert curve.cost(2, context=2100) == pytest.approx(2.8)  # extrapolated
    assert curve.cost(0, context=5000) == 1.0


def test_planner_drafts_less_at_long_context() -> None:
    curve = CostCurve(tuple(1.0 + 0.02 * n for n in range(32)), long=tuple(1.0 + 0.3 * n for n in range(32)))
    short = plan_batch_drafts(curve, [0.6], [16], [0], context=100)
    long = plan_batch_drafts(curve, [0.6], [16], [0], context=1500)
    assert short[0] > long[0]


# --------------------------------------------------------------------------- batched steps, real model


def _drive(engine: Engine, requests: list[Request], join_every: int = 0) -> None:
    """Run requests with continuous batching: all start together, or one joins every
    `join_every` steps; finished requests leave between steps."""
    waiting, running, step = list(requests), [], 0
    while waiting or running:
        if waiting and (not join_every or step % join_every == 0 or not running):
            req = waiting.pop(0)
            engine.start(req)
            running.append(req)
            if not join_every:
                continue
        running = [r for r in running if not r.finished]
        if running:
            engine.step_batch(running)
        for r in running:
            if r.finished:
                engine.finish(r)
        step += 1


@pytest.mark.slow
@pytest.mark.parametrize("join_every", [0, 3], ids=["together", "staggered"])
def test_batched_greedy_outputs_equal_solo_outputs(llm: tokenleap.LLM, questions: list[str], join_every: int) -> None:
    """Requests batched together (plain, ngram and suffix speculation mixed, different lengths)
    produce exactly the tokens each produces alone with plain decoding."""
    engine = llm.engine
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (40, 24, 33, 40, 17)]
    prompts = [llm.chat_token_ids([{"role": "user", "content": q}]) for q in questions[:5]]
    specs: list[SpecConfig | bool] = [
        False,
        SpecConfig(method="ngram"),
        SpecConfig(method="suffix"),
        False,
        SpecConfig(method="ngram", adaptive=False),
    ]
    solo = [engine.run(engine.add_request(p, sp, speculative=False)).output_ids for p, sp in zip(prompts, params)]
    batch = [engine.add_request(p, sp, speculative=s) for p, sp, s in zip(prompts, params, specs)]
    _drive(engine, batch, join_every)
    for i, (req, ref) in enumerate(zip(batch, solo)):
        assert req.output_ids == ref, f"request {i} ({specs[i]}) differs from its solo output"
        assert req.released and req.kv.capacity == 0


@pytest.mark.slow
def test_batched_seeded_sampling_is_reproducible(llm: tokenleap.LLM, questions: list[str]) -> None:
    """A seeded sampled request gives the same text batched with others as alone."""
    engine = llm.engine
    prompt = llm.chat_token_ids([{"role": "user", "content": questions[1]}])
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24)
    alone = engine.run(engine.add_request(prompt, sampled, speculative=SpecConfig(method="ngram"))).output_ids
    others = [
        engine.add_request(
            llm.chat_token_ids([{"role": "user", "content": q}]), SamplingParams(max_tokens=20, temperature=0.0)
        )
        for q in questions[2:5]
    ]
    req = engine.add_request(prompt, sampled, speculative=SpecConfig(method="ngram"))
    _drive(engine, [req, *others])
    assert req.output_ids == alone


def test_cost_curve_times_a_subset_of_row_counts_and_interpolates(tiny_model: LlamaModel) -> None:
    """A 64-token cap times 19 row counts a round, not 65; the counts between are linear in the
    measured neighbours and the curve never falls."""
    from tokenleap.engine import speculation

    assert speculation.timed_row_counts(65) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 65]
    assert speculation.timed_row_counts(5) == [1, 2, 3, 4, 5]
    timed: list[int] = []
    forward_batch = tiny_model.forward_batch

    def counting(seqs: Sequence[SeqInput], **kw: Any) -> ModelOutput:
        timed.append(int(seqs[0].input_ids.shape[0]))
        return forward_batch(seqs, **kw)

    tiny_model.forward_batch = counting
    try:
        rel = speculation._time_rows(tiny_model, 16, 33, repeats=1)
    finally:
        del tiny_model.forward_batch
    counts = speculation.timed_row_counts(33)
    assert timed[-len(counts):] == counts and len(timed) <= len(counts) + 1  # (+ the context's prefill)
    assert len(rel) == 33 and rel[0] == 1.0
    assert all(b >= a for a, b in zip(rel, rel[1:]))
    assert rel[9] == pytest.approx(rel[7] + (rel[11] - rel[7]) / 2)  # 10 rows: halfway between 8 and 12
