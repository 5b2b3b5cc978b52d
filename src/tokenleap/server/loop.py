"""The engine loop: one background thread that owns the engine and drives the scheduler.

The engine is single-threaded, so every engine call happens on this thread. HTTP handlers
(asyncio) `submit` jobs into a bounded waiting queue (full: `QueueFull`, a 429) and read
`StreamEvent`s from an `asyncio.Queue` per sample, filled thread-safely with
`loop.call_soon_threadsafe`. The scheduling policy is the library's (`engine/scheduler.py`, the
one `LLM.generate` uses: admission under `max_num_seqs`, one prefill chunk between batched decode
steps, `n > 1` prefilled once with the other samples forking its KV cache, failures isolated to
their requests); this loop keeps only threads, queues, deadlines, aborts, streaming and metrics.
Each iteration of the thread:

    sweep   -> drop aborted / timed-out requests (`Scheduler.abort`)
    admit   -> the oldest waiting job, when the scheduler has room for its samples
    prefill -> `Scheduler.prefill`: one chunk of the prompt being prefilled; after its last, the
               first tokens of its samples, which join the batch
    decode  -> `Scheduler.decode`: one step (>= 1 token) for every running request; a request that
               fails is rolled back and ends with an error, the others go on
    emit    -> text deltas to their consumers; finished requests are freed and leave

so requests join and leave the batch between steps, and a long prompt delays running streams
by one chunk per step (Sarathi-style chunked prefill, Agrawal et al., 2023), not by its whole
prefill. Every request that reached the engine is passed to `engine.finish` exactly once
whatever happens (finish, error, disconnect, timeout, shutdown); `num_live` counts those not
yet freed, which is how tests see that nothing leaks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tokenleap.config import DEFAULT_MAX_NUM_SEQS
from tokenleap.drafters.spec import SpecConfig
from tokenleap.engine.engine import Engine
from tokenleap.engine.request import Request
from tokenleap.engine.scheduler import Scheduler, SchedulerOutput
from tokenleap.errors import TokenleapError
from tokenleap.kv.cache import trim_free_memory
from tokenleap.sampling import SamplingParams
from tokenleap.server.metrics import ServerMetrics
from tokenleap.types import RequestOutput

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is at its bound."""


class ServerClosed(Exception):
    """The loop is draining or stopped and takes no new requests."""


@dataclass(frozen=True)
class Job:
    """What a handler asks the engine for: `params.n` samples of one prompt."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculative: SpecConfig | bool  # True: the server's default config, False: plain decoding
    prompt: str | None = None


def sample_jobs(job: Job) -> list[Job]:
    """A job's samples as each is seen from outside (its handle, finish listeners): sample i is
    `{request_id}-{i}` with n = 1, seeded seed + i as the library seeds its samples (a job of one
    sample: itself)."""
    p = job.params
    if p.n == 1:
        return [job]
    return [
        dataclasses.replace(
            job,
            request_id=f"{job.request_id}-{i}",
            params=dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + i),
        )
        for i in range(p.n)
    ]


@dataclass(frozen=True)
class StreamEvent:
    kind: Literal["delta", "done", "error"]
    text: str = ""  # delta: new final text
    output: RequestOutput | None = None  # done: the finished request
    status: int = 0  # error: HTTP status
    message: str = ""  # error: message for the client


class RequestHandle:
    """One sample of a submitted job as both threads see it: events flow out, an abort flag flows in."""

    def __init__(
        self, job: Job, owner: EngineLoop, aloop: asyncio.AbstractEventLoop, deadline: float | None, group: _Group
    ) -> None:
        self.job = job  # this sample's view (`sample_jobs`)
        self.events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.arrival = time.monotonic()
        self.deadline = deadline
        self.aborted = False  # set by the consumer; the engine thread acts on it between steps
        self.closed = False  # recorded as finished; its last event was sent (engine thread, or abort while waiting)
        self.req: Request | None = None  # engine thread only
        self.group = group
        self._owner = owner
        self._aloop = aloop
        self._tokens_seen = 0
        self._last_token = 0.0

    def abort(self) -> None:
        """The consumer is gone (disconnect, cancellation): free the request. Idempotent;
        a no-op once the request has finished."""
        self._owner.abort(self)

    def emit(self, event: StreamEvent) -> None:
        if event.kind != "delta":
            self.closed = True
        try:
            self._aloop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass


class _Group:
    """One job's handles, one per sample: queued together, admitted together (the scheduler's tag)."""

    def __init__(self, job: Job, deadline: float | None) -> None:
        self.job = job
        self.deadline = deadline
        self.handles: list[RequestHandle] = []
        self.waiting = True  # in the waiting queue (guarded by the loop's _cond)

    def handle(self, req: Request) -> RequestHandle:
        return self.handles[req.sample_index]

    def all_aborted(self) -> bool:
        return all(h.aborted or h.closed for h in self.handles)


class EngineLoop:
    """Owns `engine` on a background thread; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics | None = None,
        *,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_queue: int = 64,
        timeout: float | None = None,
        log_requests: bool = False,
        cost_curve_cap: int | None = None,
    ) -> None:
        self.engine = engine
        self.scheduler: Scheduler[_Group] = Scheduler(engine, max_num_seqs, isolate_failures=True)  # engine thread only
        self.cost_curve_cap = cost_curve_cap  # measure the cost curve at start for drafts up to this
        self.metrics = metrics
        self.max_num_seqs = max_num_seqs
        self.max_queue = max_queue
        self.timeout = timeout
        self.log_requests = log_requests
        self._cond = threading.Condition()
        self._waiting: deque[_Group] = deque()  # guarded by _cond
        self._num_waiting = 0  # samples waiting, not aborted (guarded by _cond)
        self._admitting = 0
        self._draining = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._calls: deque[Callable[[], None]] = deque()  # run on the engine thread between steps (guarded by _cond)
        # called on the engine thread with each request's output as it finishes (None: it never ran)
        self.finish_listeners: list[Callable[[Job, RequestOutput | None, str], None]] = []

    # ------------------------------------------------------------------ consumer side (any thread)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_live + self._admitting

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_live(self) -> int:
        """Requests holding engine state (KV cache, drafter state); 0 when idle."""
        return self.scheduler.num_live

    @property
    def num_added(self) -> int:
        return self.scheduler.num_added

    @property
    def num_freed(self) -> int:
        return self.scheduler.num_freed

    @property
    def _live(self) -> dict[str, Request]:
        """The live requests by id (engine thread)."""
        return {r.request_id: r for r in self.scheduler.live_requests()}

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def accepting(self) -> bool:
        return self.alive and not self._draining

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop was already started")
        # measured now, not on the engine thread while requests run (it takes seconds)
        if self.cost_curve_cap is not None:
            self.engine.ensure_cost_curve(self.cost_curve_cap)
        elif self.engine.spec is not None and self.engine.spec.adaptive:
            self.engine.cost_curve()
        self._thread = threading.Thread(target=self._run, name="tokenleap-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job, aloop: asyncio.AbstractEventLoop) -> RequestHandle:
        """Queue a job of one sample; raises `QueueFull` or `ServerClosed` instead of queueing."""
        if job.params.n != 1:
            raise ValueError("submit takes a job of one sample; submit_samples takes any")
        return self.submit_samples(job, aloop)[0]

    def submit_samples(self, job: Job, aloop: asyncio.AbstractEventLoop) -> list[RequestHandle]:
        """Queue a job of `job.params.n` samples, one handle each (sample i's as `sample_jobs`
        names it); its prompt is prefilled once. Raises `QueueFull` (its samples do not all fit in
        the queue) or `ServerClosed` instead of queueing."""
        deadline = time.monotonic() + self.timeout if self.timeout else None
        group = _Group(job, deadline)
        group.handles = [RequestHandle(sample, self, aloop, deadline, group) for sample in sample_jobs(job)]
        with self._cond:
            if not self.accepting:
                raise ServerClosed("the server is shutting down")
            if self._num_waiting + len(group.handles) > self.max_queue:
                raise QueueFull(f"too many requests waiting ({self._num_waiting}); try again later")
            self._waiting.append(group)
            self._num_waiting += len(group.handles)
            self._cond.notify()
        return group.handles

    def abort(self, handle: RequestHandle) -> None:
        with self._cond:
            if handle.closed or handle.aborted:
                return
            handle.aborted = True
            group = handle.group
            if group.waiting:  # never reached the engine: just drop it
                self._num_waiting -= 1
                self._close(handle, None, "abort")
                if group.all_aborted():
                    self._waiting.remove(group)
                    group.waiting = False
            self._cond.notify()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread before its next step (it may touch the engine and its
        drafters); an exception it raises is logged and dropped."""
        with self._cond:
            self._calls.append(fn)
            self._cond.notify()

    def drain(self) -> None:
        """Refuse new requests; the ones queued or running go on."""
        with self._cond:
            self._draining = True

    def stop(self, join_timeout: float | None = 30.0) -> None:
        """Cancel everything queued or running (freeing it) and end the thread. Idempotent."""
        with self._cond:
            self._draining = self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(join_timeout)
            if self._thread.is_alive():
                logger.error("the engine thread did not stop within %.0f s", join_timeout)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        sched = self.scheduler
        try:
            while True:
                with self._cond:
                    while not (self._waiting or sched.num_live or self._stopping or self._calls):
                        self._cond.wait()
                    if self._stopping:
                        break
                    calls, self._calls = self._calls, deque()
                    self._expire_waiting()
                    new = None
                    if self._waiting and sched.has_room(len(self._waiting[0].handles)):
                        new = self._waiting.popleft()
                        new.waiting = False
                        self._num_waiting -= sum(not h.closed for h in new.handles)
                        self._admitting = 1
                for fn in calls:
                    try:
                        fn()
                    except Exception:
                        logger.exception("a call on the engine thread failed")
                self._sweep()
                if new is not None:
                    self._admit(new)
                busy = sched.num_live > 0
                if busy:
                    self._prefilled(sched.prefill())
                    self._decoded(sched.decode())
                if busy and not (sched.num_live or self._waiting):
                    trim_free_memory()  # idle again: hand the freed caches back to the OS
        except BaseException:  # a bug in the loop itself: fail everything rather than hang clients
            logger.exception("the engine loop crashed")
            raise
        finally:
            self._cancel_all()

    def _expire_waiting(self) -> None:  # under _cond
        now = time.monotonic()
        for group in [g for g in self._waiting if g.deadline is not None and now > g.deadline]:
            self._waiting.remove(group)
            group.waiting = False
            for h in group.handles:
                if not h.closed:
                    self._num_waiting -= 1
                    self._close(
                        h,
                        None,
                        "abort",
                        StreamEvent(
                            "error", status=504, message=f"request timed out after {self.timeout:g} s in the queue"
                        ),
                    )

    def _sweep(self) -> None:
        """Free aborted and timed-out requests. A job still being prefilled is dropped when all
        its samples are aborted or it timed out (a sample aborted alone is freed once forked)."""
        now = time.monotonic()
        cancelled = StreamEvent("error", status=499, message="request cancelled")
        for group, req in self.scheduler.live():
            h = group.handle(req)
            timed_out = group.deadline is not None and now > group.deadline
            if self.scheduler.prefilling is not None and self.scheduler.prefilling[1] is req:
                if timed_out or group.all_aborted():
                    self.scheduler.abort(req)
                    event = (
                        StreamEvent("error", status=504, message=f"request timed out after {self.timeout:g} s")
                        if timed_out
                        else cancelled
                    )
                    self._close_group(group, event)
            elif h.aborted:
                self._abort(h, req, cancelled)
            elif timed_out:
                self._abort(
                    h, req, StreamEvent("error", status=504, message=f"request timed out after {self.timeout:g} s")
                )

    def _admit(self, group: _Group) -> None:
        """Hand a waiting job to the scheduler (cheap: no model work); it is prefilled next."""
        try:
            if group.all_aborted():  # cancelled between leaving the queue and here
                self._close_group(group, None)
                return
            job = group.job
            try:
                req = self.scheduler.add(
                    group,
                    job.prompt_ids,
                    job.params,
                    prompt=job.prompt,
                    request_ids=[h.job.request_id for h in group.handles],
                    speculative=job.speculative,
                )
            except Exception as exc:
                self._close_group(group, self._error_event(exc, "could not start the request"))
                return
            group.handles[0].req = req
        finally:
            self._admitting = 0

    def _prefilled(self, out: SchedulerOutput[_Group]) -> None:
        """After a prefill chunk: failures end their job's samples; started samples get their
        first token out (or are freed if their consumer is gone)."""
        for group, _req, exc in out.failed:
            if not all(h.closed for h in group.handles):
                self._close_group(group, self._error_event(exc, "prefill failed"))
        now = time.monotonic()
        for group, req in out.started:
            h = group.handle(req)
            h.req = req
            if h.closed or h.aborted:  # aborted while its job waited or was prefilled
                self.scheduler.abort(req)
                self._close(h, req.to_output(), "abort", StreamEvent("error", status=499, message="request cancelled"))
                continue
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(req.prompt_ids))
                self.metrics.ttft.observe(now - h.arrival)
            h._last_token = now
            self._progress(h, now, first=True)
        self._completed(out)

    def _decoded(self, out: SchedulerOutput[_Group]) -> None:
        for group, req, exc in out.failed:
            self._close(group.handle(req), req.to_output(), "abort", self._error_event(exc, "decoding failed"))
        now = time.monotonic()
        for group, req in out.stepped:
            self._progress(group.handle(req), now)
        self._completed(out)

    def _completed(self, out: SchedulerOutput[_Group]) -> None:
        for group, req in out.finished:
            h = group.handle(req)
            o = req.to_output()
            self._close(h, o, req.finish_reason or "abort", StreamEvent("done", output=o))

    def _progress(self, h: RequestHandle, now: float, first: bool = False) -> None:
        req = h.req
        assert req is not None
        new = len(req.output_ids) - h._tokens_seen
        if new > 0:
            if self.metrics is not None:
                if first:
                    self.metrics.generation_tokens.inc(new)
                else:
                    self.metrics.on_tokens(new, now - h._last_token)
            h._tokens_seen = len(req.output_ids)
        h._last_token = now
        delta = req.take_delta()
        if delta:
            h.emit(StreamEvent("delta", text=delta))

    def _abort(self, h: RequestHandle, req: Request, event: StreamEvent) -> None:
        """Free a live request and end its sample with `event`."""
        self.scheduler.abort(req)
        self._close(h, req.to_output(), "abort", event)

    def _close_group(self, group: _Group, event: StreamEvent | None) -> None:
        """End every sample of a job not ended yet (their requests already freed, or never made)."""
        for h in group.handles:
            self._close(h, h.req.to_output() if h.req is not None else None, "abort", event)

    def _close(
        self, h: RequestHandle, out: RequestOutput | None, reason: str, event: StreamEvent | None = None
    ) -> None:
        """Record a sample's end (once) and send its last event."""
        if h.closed:
            return
        h.closed = True
        self._record_finish(h, out, reason)
        if event is not None:
            h.emit(event)

    def _record_finish(self, h: RequestHandle, out: RequestOutput | None, reason: str) -> None:
        e2e = time.monotonic() - h.arrival
        if self.metrics is not None:
            self.metrics.on_finished(out, reason, e2e)
        for listen in self.finish_listeners:
            try:
                listen(h.job, out, reason)
            except Exception:
                logger.exception("a finish listener failed")
        if self.log_requests and out is not None:
            m = out.metrics
            s = m.spec
            logger.info(
                "%s: %d prompt + %d generated tokens in %.2f s, finish %s; acceptance length %.2f, drafts %d, "
                "draft tokens %d, accepted %d", h.job.request_id, m.num_prompt_tokens, m.num_generation_tokens, e2e,
                reason, m.mean_acceptance_length, s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
            spec = h.req.spec if h.req is not None else None
            if spec is not None:  # llama.cpp's statistics lines: the method's, and a chain's members'
                for line in s.llama_cpp_lines("+".join(spec.chain) if spec.chain else spec.method):
                    logger.info("%s: %s", h.job.request_id, line)

    @staticmethod
    def _error_event(exc: Exception, what: str) -> StreamEvent:
        if isinstance(exc, TokenleapError):
            return StreamEvent("error", status=400, message=str(exc))
        logger.error("%s: %s", what, exc, exc_info=exc)
        return StreamEvent("error", status=500, message=f"internal error: {what}")

    def _cancel_all(self) -> None:
        """On stop: fail whatever is queued or running, freeing every live request."""
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
            for group in waiting:
                group.waiting = False
            self._num_waiting = 0
            self._stopping = self._draining = True
        shutdown = StreamEvent("error", status=503, message="the server is shutting down")
        for group in waiting:
            self._close_group(group, shutdown)
        for group, _req in self.scheduler.close():
            self._close_group(group, shutdown)
