"""BatchScheduler (offline continuous batching) on the tiny model: outputs equal one-at-a-time
runs, the running set stays bounded, jobs are drawn and requests created lazily, everything is
freed on completion, early stop and error."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tokenleap.engine.engine import Engine
from tokenleap.engine.request import Request
from tokenleap.engine.scheduler import BatchJob, BatchScheduler
from tokenleap.errors import TokenleapError
from tokenleap.kernels import CpuKernels
from tokenleap.models.llama import LlamaModel
from tokenleap.sampling import SamplingParams
from tokenleap.tokenizer import Tokenizer


class CountingEngine(Engine):
    """An engine that counts the requests holding a KV cache (added, not yet finished)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.live: set[str] = set()
        self.peak_live = 0
        self.num_added = 0

    def add_request(self, *args: object, **kwargs: object) -> Request:
        req = super().add_request(*args, **kwargs)  # type: ignore[arg-type]
        self.live.add(req.request_id)
        self.num_added += 1
        self.peak_live = max(self.peak_live, len(self.live))
        return req

    def finish(self, req: Request, reason: str | None = None) -> None:
        super().finish(req, reason)
        self.live.discard(req.request_id)


@pytest.fixture
def engine(tiny_model: LlamaModel, tokenizer: Tokenizer) -> CountingEngine:
    # 4-token prefill chunks: prompts of 5-19 tokens take 2-5 chunks, interleaved with steps
    return CountingEngine(tiny_model, tokenizer, prefill_chunk=4)


def _jobs(n: int) -> list[BatchJob]:
    jobs = []
    for i in range(n):
        prompt = [(7 * i + 3 * j) % 250 + 3 for j in range(5 + (i * 5) % 15)]
        if i % 3 == 2:
            params = SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=3 + i, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=2 + (i * 7) % 13, ignore_eos=i % 2 == 0)
        jobs.append(BatchJob(prompt, params))
    return jobs


def _solo(engine: Engine, job: BatchJob) -> list[int]:
    return engine.run(engine.add_request(job.prompt_ids, job.params)).output_ids


@pytest.mark.parametrize("max_num_seqs", [1, 3, 16])
def test_batched_outputs_equal_one_at_a_time(engine: CountingEngine, kernels: CpuKernels, max_num_seqs: int) -> None:
    """Greedy and seeded sampled requests of mixed prompt and output lengths: each gets exactly
    its one-at-a-time tokens, whatever the bound on the running set."""
    jobs = _jobs(10)
    solo = [_solo(engine, job) for job in jobs]
    engine.peak_live = 0
    scheduler = BatchScheduler(engine, jobs, max_num_seqs)
    got: dict[int, list[int]] = {}
    for index, req in scheduler.run():
        assert req.finished and req.released and req.kv.capacity == 0
        assert index not in got
        got[index] = req.output_ids
    assert [got[i] for i in range(len(jobs))] == solo
    assert engine.peak_live == scheduler.peak_live <= max_num_seqs
    if max_num_seqs < len(jobs):
        assert scheduler.peak_live == max_num_seqs
    assert not engine.live and scheduler.num_live == 0 and scheduler.done
    assert scheduler.num_output_tokens == sum(map(len, solo))


def test_jobs_are_drawn_lazily_and_the_running_set_is_bounded(engine: CountingEngine) -> None:
    drawn = 0

    def jobs() -> Iterator[BatchJob]:
        nonlocal drawn
        for job in _jobs(12):
            drawn += 1
            yield job

    scheduler = BatchScheduler(engine, jobs(), max_num_seqs=3)
    steps = 0
    while not scheduler.done:
        scheduler.step()
        steps += 1
        assert scheduler.num_live <= 3 and len(engine.live) <= 3
        assert drawn <= scheduler.num_admitted + 1  # at most one job looked at ahead
        assert engine.num_added == scheduler.num_admitted
    assert drawn == engine.num_added == scheduler.num_finished == 12 and not engine.live
    assert scheduler.peak_live == 3 and scheduler.peak_kv_bytes > 0


def test_finished_requests_come_out_as_they_finish(engine: CountingEngine) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    jobs = [BatchJob([5, 6, 7], long), BatchJob([8, 9, 10], long), BatchJob([11, 12], SamplingParams(max_tokens=1))]
    order = [index for index, _ in BatchScheduler(engine, jobs, max_num_seqs=3).run()]
    assert order[0] == 2 and sorted(order) == [0, 1, 2]


def test_stopping_early_frees_every_live_request(engine: CountingEngine) -> None:
    jobs = [BatchJob([5 + i, 6, 7], SamplingParams(temperature=0.0, max_tokens=4 + 4 * i, ignore_eos=True)) for i in range(12)]
    scheduler = BatchScheduler(engine, jobs, max_num_seqs=4)
    it = scheduler.run()
    index, req = next(it)
    assert req.released and len(engine.live) > 0
    it.close()
    assert not engine.live and scheduler.num_live == 0 and scheduler.done
    assert engine.num_added < 12  # the rest were never created


def test_an_error_in_a_step_frees_every_live_request(engine: CountingEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = BatchScheduler(engine, _jobs(8), max_num_seqs=4)
    calls = 0
    step_batch = engine.step_batch

    def failing(reqs: list[Request]) -> None:
        nonlocal calls
        calls += 1
        if calls == 6:
            raise RuntimeError("boom")
        step_batch(reqs)

    monkeypatch.setattr(engine, "step_batch", failing)
    with pytest.raises(RuntimeError, match="boom"):
        for _ in scheduler.run():
            pass
    assert not engine.live and scheduler.num_live == 0


def test_no_jobs_and_bad_bound(engine: CountingEngine) -> None:
    scheduler = BatchScheduler(engine, [], max_num_seqs=2)
    assert scheduler.done and list(scheduler.run()) == [] and scheduler.step() == []
    with pytest.raises(TokenleapError, match="max_num_seqs must be >= 1"):
        BatchScheduler(engine, [], max_num_seqs=0)
