"""The scheduling policy: continuous batching over a bounded running set, for every caller.

Iteration-level scheduling as in Orca (Yu et al., OSDI 2022) and vLLM, with Sarathi-style
chunked prefill (Agrawal et al., 2023). `Scheduler` is the one policy; two drivers feed it jobs:
`BatchScheduler` below (offline, `LLM.generate`: a lazy iterable of jobs, run synchronously)
and the server's `EngineLoop` (server/loop.py: a thread, a bounded waiting queue, deadlines,
aborts and streaming, and nothing of the policy). Each iteration:

    admit   -> when no prompt is being prefilled and the job's samples fit beside the live
               requests under `max_num_seqs` (`has_room`; a job larger than the bound runs
               alone), `add` creates its request (its KV cache is allocated here, not before)
               and registers it with its drafter
    prefill -> one chunk (`Engine.prefill_chunk` tokens) of that prompt (`prefill`); after its
               last chunk, its first token. A job with `params.n > 1` (parallel sampling) is
               prefilled once: its other samples fork the prefilled KV cache (`Engine.fork`).
               They join the batch
    decode  -> `engine.step_batch(running)` (`decode`): one target forward for every running request
    retire  -> finished requests are freed at once (`engine.finish`) and returned

So at most `max_num_seqs` requests hold a KV cache, and a request's tokens do not depend on
what it is batched with (the engine's row-invariant kernels and fixed prefill chunk offsets):
the output is the one-at-a-time output, whichever driver runs it. Every request the scheduler
creates is passed to `engine.finish` exactly once (finished, failed, aborted with `abort`, or
left when `close` is called); `num_added` / `num_freed` count them.

Failures: by default an exception goes up and the driver closes the scheduler (offline
generation fails as a whole). With `isolate_failures` (the server), a request whose prefill,
fork or step fails is freed and reported in `SchedulerOutput.failed` with its exception while
the others go on; a failed batched forward, which the engine cannot pin on one request, is
retried request by request, and only those that fail alone are lost (the others' outputs do
not change: a request's rows are computed the same whatever they are batched with).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tokenleap.config import DEFAULT_MAX_NUM_SEQS
from tokenleap.drafters.spec import SpecConfig
from tokenleap.engine.engine import Engine
from tokenleap.engine.request import Request
from tokenleap.engine.undo import StepFailures
from tokenleap.errors import TokenleapError
from tokenleap.kv.cache import trim_free_memory
from tokenleap.sampling import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")  # what the driver tags a job with (offline: its index; the server: its handles)


@dataclass
class SchedulerOutput(Generic[T]):
    """What one `prefill` / `decode` / `step` did, each request with its job's tag."""

    # got their first token (a prefill's last chunk, or a fork of it)
    started: list[tuple[T, Request]] = field(default_factory=list)
    stepped: list[tuple[T, Request]] = field(default_factory=list)  # decoded one step (finished ones included)
    finished: list[tuple[T, Request]] = field(default_factory=list)  # ended, already freed
    # rolled back and freed (`isolate_failures` only)
    failed: list[tuple[T, Request, Exception]] = field(default_factory=list)

    def extend(self, other: SchedulerOutput[T]) -> SchedulerOutput[T]:
        self.started += other.started
        self.stepped += other.stepped
        self.finished += other.finished
        self.failed += other.failed
        return self


class Scheduler(Generic[T]):
    """The policy of the module docstring over `engine`, with at most `max_num_seqs` requests
    live. The driver admits (`has_room`, then `add`) and calls `prefill` then `decode` (or
    `step`, both) each iteration; `abort` frees one request, `close` every live one."""

    def __init__(
        self, engine: Engine, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, *, isolate_failures: bool = False
    ) -> None:
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise TokenleapError(f"max_num_seqs must be >= 1, got {max_num_seqs!r}")
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.isolate_failures = isolate_failures
        self._prefilling: tuple[T, Request, Sequence[str] | None] | None = None
        self._running: list[tuple[T, Request]] = []
        self.num_admitted = 0  # jobs admitted
        self.num_added = 0  # requests created (a job's samples each count)
        self.num_freed = 0  # requests passed to engine.finish
        self.num_finished = 0  # requests that finished (not aborted or failed)
        self._finished_tokens = 0
        self.peak_live = 0  # most requests holding a KV cache at once
        self.peak_kv_bytes = 0  # most KV-cache bytes held at once (measured after each phase)

    # ------------------------------------------------------------------ state

    @property
    def num_live(self) -> int:
        """Requests holding engine state (a KV cache, drafter state)."""
        return len(self._running) + (self._prefilling is not None)

    @property
    def num_running(self) -> int:
        """Requests past their prefill, decoded each step."""
        return len(self._running)

    @property
    def prefilling(self) -> tuple[T, Request] | None:
        """The job whose prompt is being prefilled, if any (its first sample's request)."""
        return None if self._prefilling is None else self._prefilling[:2]

    def live(self) -> list[tuple[T, Request]]:
        """Every live request with its tag: the running ones, then the one being prefilled."""
        live = list(self._running)
        if self._prefilling is not None:
            live.append(self._prefilling[:2])
        return live

    def live_requests(self) -> list[Request]:
        return [r for _, r in self.live()]

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far by the requests that finished and the running ones."""
        return self._finished_tokens + sum(len(r.output_ids) for _, r in self._running)

    # ------------------------------------------------------------------ admission

    def has_room(self, n: int = 1) -> bool:
        """Whether a job of `n` samples may be admitted now: no prompt is being prefilled, and
        its samples fit beside the live requests (or nothing is live: a job larger than
        `max_num_seqs` runs alone)."""
        return self._prefilling is None and (self.num_live == 0 or self.num_live + n <= self.max_num_seqs)

    def add(self, tag: T, prompt_ids: Sequence[int], params: SamplingParams, *, prompt: str | None = None,
            request_ids: Sequence[str] | None = None, speculative: SpecConfig | bool = True) -> Request:
        """Admit a job (`params.n` samples of one prompt): create its first sample's request
        (allocating its KV cache), register it with its drafter and make it the prompt being
        prefilled. `request_ids`: one per sample (default: the engine's). Call it only when
        `has_room(params.n)`; an error leaves nothing allocated."""
        if self._prefilling is not None:
            raise RuntimeError("a prompt is still being prefilled: admit one job at a time (has_room)")
        if request_ids is not None and len(request_ids) != params.n:
            raise ValueError(f"{len(request_ids)} request ids for {params.n} samples")
        req = self.engine.add_request(
            prompt_ids,
            params,
            prompt=prompt,
            request_id=request_ids[0] if request_ids else None,
            speculative=speculative,
        )
        self.num_added += 1
        try:
            self.engine.begin(req)
        except BaseException:
            self._free(req, "abort")
            raise
        self.num_admitted += 1
        self._prefilling = (tag, req, request_ids)
        return req

    # ------------------------------------------------------------------ an iteration

    def prefill(self) -> SchedulerOutput[T]:
        """One chunk of the prompt being prefilled; after its last, its first token, and the
        forks of its other samples. They are `started` and join the batch (or are `finished`
        already: EOS or max_tokens=1)."""
        out: SchedulerOutput[T] = SchedulerOutput()
        if self._prefilling is None:
            return out
        tag, req, request_ids = self._prefilling
        try:
            done = self.engine.prefill_step(req)
        except BaseException as exc:
            self._prefilling = None
            self._fail([(tag, req)], exc, out)
            return out
        if done:
            self._prefilling = None
            family = [req]
            try:
                for i in range(1, req.params.n):  # parallel sampling: the other samples share this prefill
                    family.append(self.engine.fork(req, i, request_id=request_ids[i] if request_ids else None))
                    self.num_added += 1
            except BaseException as exc:
                self._fail([(tag, r) for r in family], exc, out)
                return out
            finally:
                req.prompt_logits = None
                req.prompt_features = []
            for r in family:
                out.started.append((tag, r))
                if r.finished:
                    self._retire(tag, r, out)
                else:
                    self._running.append((tag, r))
        self._record_peaks()
        return out

    def decode(self) -> SchedulerOutput[T]:
        """One batched decoding step of every running request; the finished ones are freed."""
        out: SchedulerOutput[T] = SchedulerOutput()
        if not self._running:
            return out
        batch = self._running
        failed = self._step(batch)
        still = []
        for tag, req in batch:
            exc = failed.get(id(req))
            if exc is not None:
                self._free(req, "abort")
                out.failed.append((tag, req, exc))
                continue
            out.stepped.append((tag, req))
            if req.finished:
                self._retire(tag, req, out)
            else:
                still.append((tag, req))
        self._running = still
        self._record_peaks()
        return out

    def step(self) -> SchedulerOutput[T]:
        """`prefill`, then `decode`."""
        return self.prefill().extend(self.decode())

    # ------------------------------------------------------------------ ending requests

    def abort(self, req: Request) -> bool:
        """Free a live request (finish reason "abort"); False if it is not live here. Aborting
        the request being prefilled aborts its job (its other samples do not exist yet)."""
        if self._prefilling is not None and self._prefilling[1] is req:
            self._prefilling = None
        else:
            kept = [(t, r) for t, r in self._running if r is not req]
            if len(kept) == len(self._running):
                return False
            self._running = kept
        self._free(req, "abort")
        return True

    def close(self) -> list[tuple[T, Request]]:
        """Free every live request (finish reason "abort" unless it had finished) and return
        them with their tags. Idempotent."""
        live = self.live()
        self._running, self._prefilling = [], None
        for _, req in live:
            self._free(req, "abort")
        return live

    # ------------------------------------------------------------------ internals

    def _step(self, batch: list[tuple[T, Request]]) -> dict[int, Exception]:
        """Step `batch`; returns the failed requests' exceptions by `id(request)` (isolating
        failures; else they go up)."""
        reqs = [r for _, r in batch]
        if not self.isolate_failures:
            self.engine.step_batch(reqs)
            return {}
        try:
            self.engine.step_batch(reqs)
            return {}
        except StepFailures as exc:
            return {id(req): e for req, e in exc.failures}
        except Exception as exc:
            if len(batch) == 1:
                return {id(reqs[0]): exc}
            logger.warning(
                "a batched step of %d requests failed (%s: %s); retrying each alone",
                len(batch),
                type(exc).__name__,
                exc,
            )
            failed: dict[int, Exception] = {}
            for item in batch:
                failed.update(self._step([item]))
            return failed

    def _fail(self, seqs: list[tuple[T, Request]], exc: BaseException, out: SchedulerOutput[T]) -> None:
        for _, req in seqs:
            self._free(req, "abort")
        if not self.isolate_failures or not isinstance(exc, Exception):
            raise exc
        out.failed += [(tag, req, exc) for tag, req in seqs]

    def _retire(self, tag: T, req: Request, out: SchedulerOutput[T]) -> None:
        self._free(req, None)
        self.num_finished += 1
        self._finished_tokens += len(req.output_ids)
        out.finished.append((tag, req))

    def _free(self, req: Request, reason: str | None) -> None:
        self.num_freed += 1
        try:
            self.engine.finish(req, reason)
        except Exception:
            if not self.isolate_failures:
                raise
            logger.exception("freeing request %s failed", req.request_id)

    def _record_peaks(self) -> None:
        live = self.live_requests()
        self.peak_live = max(self.peak_live, len(live))
        self.peak_kv_bytes = max(self.peak_kv_bytes, sum(r.kv.nbytes() for r in live))


@dataclass(frozen=True)
class BatchJob:
    """One prompt to complete; `prompt_ids` already checked (`Engine.check_prompt`)."""

    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the prompt text, reported back in the output


class BatchScheduler:
    """The offline driver of `Scheduler`: run `jobs` through `engine` with at most
    `max_num_seqs` live requests, drawing each job from its iterable only when it is admitted.
    Drive it with `step()` until `done`, or iterate over `run()`; `close()` frees whatever is
    still live (after an error, or when the caller stops early). A job with `params.n > 1`
    comes back as its samples, each with the job's index (`Request.sample_index` tells which)."""

    def __init__(self, engine: Engine, jobs: Iterable[BatchJob], max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> None:
        self.scheduler: Scheduler[int] = Scheduler(engine, max_num_seqs)
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self._jobs: Iterator[tuple[int, BatchJob]] = enumerate(jobs)
        self._next: tuple[int, BatchJob] | None = None  # drawn from `_jobs`, not yet admitted
        self._exhausted = False  # `_jobs` has nothing more

    @property
    def num_live(self) -> int:
        return self.scheduler.num_live

    @property
    def num_admitted(self) -> int:
        return self.scheduler.num_admitted

    @property
    def num_finished(self) -> int:
        return self.scheduler.num_finished

    @property
    def num_output_tokens(self) -> int:
        return self.scheduler.num_output_tokens

    @property
    def peak_live(self) -> int:
        return self.scheduler.peak_live

    @property
    def peak_kv_bytes(self) -> int:
        return self.scheduler.peak_kv_bytes

    @property
    def done(self) -> bool:
        """Every job has been admitted and has finished."""
        return self.scheduler.num_live == 0 and not self._has_waiting()

    def live_requests(self) -> list[Request]:
        return self.scheduler.live_requests()

    def step(self) -> list[tuple[int, Request]]:
        """One iteration (admit, prefill a chunk, one batched decode step). Returns the requests
        that finished in it, with their job index, already freed."""
        if self._has_waiting():
            assert self._next is not None
            index, job = self._next
            if self.scheduler.has_room(job.params.n):
                self._next = None
                self.scheduler.add(index, job.prompt_ids, job.params, prompt=job.prompt)
        finished = self.scheduler.step().finished
        if finished and self.done:
            trim_free_memory()  # the last caches go back to the OS
        return finished

    def run(self) -> Iterator[tuple[int, Request]]:
        """Step until done, yielding each finished request (with its job index) as it finishes.
        Stopping early (closing the generator) or an error frees every live request."""
        try:
            while not self.done:
                yield from self.step()
        finally:
            self.close()

    def close(self) -> None:
        """Free every live request (finish reason "abort" unless it had finished). Idempotent."""
        self._next, self._exhausted = None, True
        if self.scheduler.close():
            trim_free_memory()

    def _has_waiting(self) -> bool:
        if self._next is None and not self._exhausted:
            self._next = next(self._jobs, None)
            self._exhausted = self._next is None
        return self._next is not None
