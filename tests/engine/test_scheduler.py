"""The scheduler on the tiny model. BatchScheduler (offline continuous batching): outputs equal
one-at-a-time runs, the running set stays bounded, jobs are drawn and requests created lazily,
everything is freed on completion, early stop and error. Scheduler as the server drives it:
n samples share one prefill (a head drafter's forked samples get the prompt's features too),
failures isolated to their request, abort and close."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tokenleap import SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.engine.engine import Engine
from tokenleap.engine.request import Request
from tokenleap.engine.scheduler import BatchJob, BatchScheduler, Scheduler
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
    jobs = [
        BatchJob([5 + i, 6, 7], SamplingParams(temperature=0.0, max_tokens=4 + 4 * i, ignore_eos=True))
        for i in range(12)
    ]
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


def test_one_policy_for_any_driver_n_samples_share_one_prefill(
    engine: CountingEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Scheduler` directly, as the server drives it (its own tags, its own request ids): a job of
    n samples is prefilled once, its other samples fork the cache, sample i equals a request
    seeded seed + i alone, and the n samples count against `max_num_seqs` when admitted."""
    params = SamplingParams(n=3, temperature=0.9, top_k=20, seed=40, max_tokens=6, ignore_eos=True)
    prompt = [(5 * j) % 250 + 3 for j in range(11)]  # 3 prefill chunks of 4
    solo = [_solo(engine, BatchJob(prompt, dataclasses.replace(params, n=1, seed=40 + i))) for i in range(3)]
    prefilled: list[str] = []
    forks = 0
    prefill_step, fork = engine.prefill_step, engine.fork

    def counting_prefill(req: Request) -> bool:
        prefilled.append(req.request_id)
        return prefill_step(req)

    def counting_fork(parent: Request, i: int, **kw: str | None) -> Request:
        nonlocal forks
        forks += 1
        return fork(parent, i, **kw)

    monkeypatch.setattr(engine, "prefill_step", counting_prefill)
    monkeypatch.setattr(engine, "fork", counting_fork)
    sched: Scheduler[str] = Scheduler(engine, max_num_seqs=4)
    assert sched.has_room(3)
    sched.add("job-a", prompt, params, request_ids=["a-0", "a-1", "a-2"])
    assert not sched.has_room(1)  # one prompt prefilled at a time
    started: list[tuple[str, Request]] = []
    finished: dict[int, Request] = {}
    while sched.num_live:
        out = sched.step()
        started += out.started
        finished.update((r.sample_index, r) for tag, r in out.finished if tag == "job-a")
        if sched.prefilling is None and sched.num_live:
            assert sched.has_room(1) and not sched.has_room(2)  # 3 live samples of 4 seats
    assert prefilled == ["a-0"] * 3 and forks == 2
    assert sorted(r.request_id for _, r in started) == ["a-0", "a-1", "a-2"]
    assert [finished[i].output_ids for i in range(3)] == solo
    assert sched.num_added == sched.num_freed == 3 and not engine.live


def test_isolated_failures_end_only_their_request(engine: CountingEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `isolate_failures` (the server): a batched step that fails is retried request by
    request; the request that fails alone is freed and reported, the others finish with their
    solo tokens. Aborting the prompt being prefilled, and closing, free what is live."""
    jobs = _jobs(4)
    solo = [_solo(engine, job) for job in jobs]
    sched: Scheduler[int] = Scheduler(engine, max_num_seqs=4, isolate_failures=True)
    step_batch = engine.step_batch
    bad: list[Request] = []

    def failing(reqs: list[Request]) -> None:
        if any(r is b and len(r.output_ids) >= 2 for r in reqs for b in bad):
            raise RuntimeError("simulated kernel failure")
        step_batch(reqs)

    monkeypatch.setattr(engine, "step_batch", failing)
    got: dict[int, list[int]] = {}
    failed: list[tuple[int, Exception]] = []
    waiting = list(enumerate(jobs))
    while waiting or sched.num_live:
        if waiting and sched.has_room():
            index, job = waiting.pop(0)
            req = sched.add(
                index,
                job.prompt_ids,
                dataclasses.replace(job.params, max_tokens=12, ignore_eos=True) if index == 1 else job.params,
            )
            if index == 1:
                bad.append(req)
        out = sched.step()
        got.update((i, r.output_ids) for i, r in out.finished)
        failed += [(i, exc) for i, _, exc in out.failed]
    assert [i for i, _ in failed] == [1] and "simulated" in str(failed[0][1])
    assert {i: got[i] for i in (0, 2, 3)} == {i: solo[i] for i in (0, 2, 3)}
    assert sched.num_added == sched.num_freed == 4 and not engine.live
    # an abort while prefilling, and close
    sched.add(7, jobs[0].prompt_ids, jobs[0].params)
    parent = sched.prefilling
    assert parent is not None and sched.abort(parent[1]) and not sched.abort(parent[1])
    assert parent[1].finish_reason == "abort" and sched.num_live == 0
    sched.add(8, jobs[1].prompt_ids, jobs[1].params)
    sched.step()
    assert [tag for tag, _ in sched.close()] == [8] and sched.close() == [] and not engine.live
    assert sched.num_added == sched.num_freed == 6


def test_forked_samples_of_a_head_drafter_draft_from_the_first_step(
    tiny_model: LlamaModel, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """A drafter reading the target's hidden states (a Medusa head) gets the prompt's features in
    every forked sample, kept from the one prefill: each sample drafts from its first step, and
    greedy samples equal plain decoding."""
    g = torch.Generator().manual_seed(0)
    h, vocab = tiny_model.config.hidden_size, tiny_model.config.vocab_size
    tensors = {}
    for i in range(3):
        tensors[f"medusa_head.{i}.0.linear.weight"] = torch.randn(h, h, generator=g) * h**-0.5
        tensors[f"medusa_head.{i}.0.linear.bias"] = torch.randn(h, generator=g) * 0.1
        tensors[f"medusa_head.{i}.1.weight"] = torch.randn(vocab, h, generator=g) * h**-0.5
    (tmp_path / "config.json").write_text(
        json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": "tiny"})
    )
    save_file(tensors, str(tmp_path / "model.safetensors"))
    spec = SpecConfig(method="medusa", model=str(tmp_path), num_speculative_tokens=3, adaptive=False)
    engine = Engine(
        tiny_model,
        tokenizer,
        spec=spec,
        drafter=default_registry().create(spec.method, spec, target=tiny_model),
        prefill_chunk=4,
    )
    params = SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    plain = Engine(tiny_model, tokenizer)
    want = plain.run(plain.add_request(prompt, dataclasses.replace(params, n=1))).output_ids
    first_drafts: dict[int, int] = {}
    sched: Scheduler[None] = Scheduler(engine)
    sched.add(None, prompt, params)
    done: list[Request] = []
    while sched.num_live:
        out = sched.step()
        for _, req in out.stepped:
            first_drafts.setdefault(req.sample_index, req.metrics.spec.num_drafts)
        done += [r for _, r in out.finished]
    assert first_drafts == {0: 1, 1: 1, 2: 1}  # every sample drafted in its first step
    assert sorted(r.sample_index for r in done) == [0, 1, 2] and all(r.output_ids == want for r in done)
