"""The engine loop: one background thread that owns the engine, with continuous batching.

The engine is single-threaded, so every engine call happens on this thread. HTTP handlers
(asyncio) `submit` jobs into a bounded waiting queue (full: `QueueFull`, a 429) and read
`StreamEvent`s from an `asyncio.Queue` per request, filled thread-safely with
`loop.call_soon_threadsafe`. Each iteration of the thread, in the manner of Orca's
iteration-level scheduling (Yu et al., OSDI 2022) and vLLM's continuous batching:

    sweep   -> drop aborted / timed-out requests (engine.finish(req, "abort"))
    admit   -> at most one waiting request: add_request + drafter begin
    prefill -> one chunk (`Engine.prefill_chunk` tokens) of the oldest prefilling request; after
               its last chunk, its first token, and it joins the batch
    step    -> engine.step_batch(running): one step (>= 1 token) for every running request; a
               request that fails is rolled back and ends with an error, the others go on (a
               failed batched forward: each is retried alone)
    emit    -> text deltas to their consumers; finished requests are freed and leave

so requests join and leave the batch between steps, and a long prompt delays running streams
by one chunk per step (Sarathi-style chunked prefill, Agrawal et al., 2023), not by its whole
prefill. Every request that reached the engine is passed to `engine.finish`
exactly once whatever happens (finish, error, disconnect, timeout, shutdown); `num_live` counts
those not yet freed, which is how tests see that nothing leaks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tokenleap.config import SpecConfig
from tokenleap.engine.engine import Engine, StepFailures
from tokenleap.engine.request import Request
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
    """What a handler asks the engine for."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculative: SpecConfig | bool  # True: the server's default config, False: plain decoding
    prompt: str | None = None


@dataclass(frozen=True)
class StreamEvent:
    kind: Literal["delta", "done", "error"]
    text: str = ""  # delta: new final text
    output: RequestOutput | None = None  # done: the finished request
    status: int = 0  # error: HTTP status
    message: str = ""  # error: message for the client


class RequestHandle:
    """One submitted job as both threads see it: events flow out, an abort flag flows in."""

    def __init__(self, job: Job, owner: EngineLoop, aloop: asyncio.AbstractEventLoop, deadline: float | None) -> None:
        self.job = job
        self.events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.arrival = time.monotonic()
        self.deadline = deadline
        self.aborted = False  # set by the consumer; the engine thread acts on it between steps
        self.closed = False  # the last event was sent (engine thread)
        self.req: Request | None = None  # engine thread only
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


class EngineLoop:
    """Owns `engine` on a background thread; see the module docstring."""

    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None, *, max_batch: int = 16, max_queue: int = 64,
                 timeout: float | None = None, log_requests: bool = False, cost_curve_cap: int | None = None) -> None:
        self.engine = engine
        self.cost_curve_cap = cost_curve_cap  # measure the cost curve at start for drafts up to this
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.timeout = timeout
        self.log_requests = log_requests
        self._cond = threading.Condition()
        self._waiting: deque[RequestHandle] = deque()  # guarded by _cond
        self._running: list[RequestHandle] = []  # engine thread only
        self._prefilling: list[RequestHandle] = []  # admitted, prompt not fully run (engine thread)
        self._admitting = 0
        self._live: dict[str, Request] = {}  # added to the engine, not yet finished (engine thread)
        self._draining = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.num_added = 0
        self.num_freed = 0
        self._calls: deque[Callable[[], None]] = deque()  # run on the engine thread between steps (guarded by _cond)
        # called on the engine thread with each request's output as it finishes (None: it never ran)
        self.finish_listeners: list[Callable[[Job, RequestOutput | None, str], None]] = []

    # ------------------------------------------------------------------ consumer side (any thread)

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self._prefilling) + self._admitting

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_live(self) -> int:
        """Requests holding engine state (KV cache, drafter state); 0 when idle."""
        return len(self._live)

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
        """Queue a job; raises `QueueFull` or `ServerClosed` instead of queueing."""
        deadline = time.monotonic() + self.timeout if self.timeout else None
        handle = RequestHandle(job, self, aloop, deadline)
        with self._cond:
            if not self.accepting:
                raise ServerClosed("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"too many requests waiting ({len(self._waiting)}); try again later")
            self._waiting.append(handle)
            self._cond.notify()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        with self._cond:
            if handle.closed or handle.aborted:
                return
            handle.aborted = True
            if handle in self._waiting:  # never reached the engine: just drop it
                self._waiting.remove(handle)
                handle.closed = True
                self._record_finish(handle, None, "abort")
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
        try:
            while True:
                with self._cond:
                    while not (self._waiting or self._running or self._prefilling or self._stopping or self._calls):
                        self._cond.wait()
                    if self._stopping:
                        break
                    calls, self._calls = self._calls, deque()
                    self._expire_waiting()
                    room = len(self._running) + len(self._prefilling) < self.max_batch
                    new = self._waiting.popleft() if self._waiting and room else None
                    if new is not None:
                        self._admitting = 1
                for fn in calls:
                    try:
                        fn()
                    except Exception:
                        logger.exception("a call on the engine thread failed")
                self._sweep()
                if new is not None:
                    self._admit(new)
                busy = bool(self._running or self._prefilling)
                if self._prefilling:
                    self._prefill_one()
                if self._running:
                    self._step()
                if busy and not (self._running or self._prefilling or self._waiting):
                    trim_free_memory()  # idle again: hand the freed caches back to the OS
        except BaseException:  # a bug in the loop itself: fail everything rather than hang clients
            logger.exception("the engine loop crashed")
            raise
        finally:
            self._cancel_all()

    def _expire_waiting(self) -> None:  # under _cond
        now = time.monotonic()
        for h in [h for h in self._waiting if h.deadline is not None and now > h.deadline]:
            self._waiting.remove(h)
            self._record_finish(h, None, "abort")
            h.emit(StreamEvent("error", status=504, message=f"request timed out after {self.timeout:g} s in the queue"))

    def _sweep(self) -> None:
        """Remove aborted and timed-out requests from the batch, freeing them."""
        now = time.monotonic()

        def keep(handles: list[RequestHandle]) -> list[RequestHandle]:
            kept = []
            for h in handles:
                if h.aborted:
                    self._release(h, "abort")
                    h.emit(StreamEvent("error", status=499, message="request cancelled"))
                elif h.deadline is not None and now > h.deadline:
                    self._release(h, "abort")
                    h.emit(StreamEvent("error", status=504, message=f"request timed out after {self.timeout:g} s"))
                else:
                    kept.append(h)
            return kept

        self._running = keep(self._running)
        self._prefilling = keep(self._prefilling)

    def _admit(self, h: RequestHandle) -> None:
        """Hand a waiting job to the engine (cheap: no model work) and queue its prefill."""
        job = h.job
        if h.aborted:  # cancelled between leaving the queue and here
            self._admitting = 0
            self._record_finish(h, None, "abort")
            return
        try:
            try:
                req = self.engine.add_request(job.prompt_ids, job.params, prompt=job.prompt, request_id=job.request_id,
                                              speculative=job.speculative)
            except Exception as exc:
                self._record_finish(h, None, "abort")
                h.emit(self._error_event(exc, "could not start the request"))
                return
            h.req = req
            self._live[req.request_id] = req
            self.num_added += 1
            try:
                self.engine.begin(req)
            except Exception as exc:
                self._release(h, "abort")
                h.emit(self._error_event(exc, "could not start the request"))
                return
            self._prefilling.append(h)
        finally:
            self._admitting = 0

    def _prefill_one(self) -> None:
        """One prompt chunk of the oldest prefilling request; after its last, its first token."""
        h = self._prefilling[0]
        req = h.req
        assert req is not None
        try:
            done = self.engine.prefill_step(req)
        except Exception as exc:
            self._prefilling.pop(0)
            self._release(h, "abort")
            h.emit(self._error_event(exc, "prefill failed"))
            return
        if not done:
            return
        self._prefilling.pop(0)
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(req.prompt_ids))
            self.metrics.ttft.observe(now - h.arrival)
        h._last_token = now
        self._progress(h, now, first=True)
        if req.finished:
            self._complete(h)
        elif h.aborted:
            self._release(h, "abort")
        else:
            self._running.append(h)

    def _step(self) -> None:
        batch = self._running
        failed = self._step_isolated(batch)
        now = time.monotonic()
        still = []
        for h in batch:
            if h in failed:
                self._release(h, "abort")
                h.emit(self._error_event(failed[h], "decoding failed"))
                continue
            self._progress(h, now)
            if h.req is not None and h.req.finished:
                self._complete(h)
            else:
                still.append(h)
        self._running = still

    def _step_isolated(self, batch: list[RequestHandle]) -> dict[RequestHandle, Exception]:
        """One step of `batch`; returns the requests that failed (rolled back by the engine) with
        their errors, the others were stepped. A failure the engine cannot pin on one request (the
        batched forward) rolls the whole batch back: each request is then retried alone, and only
        those that fail on their own are lost. Their outputs do not change: a request's rows are
        computed the same whatever they are batched with."""
        try:
            self.engine.step_batch([h.req for h in batch])  # type: ignore[misc]  # running handles hold their request (set at admission)
            return {}
        except StepFailures as exc:
            by_req = {id(h.req): h for h in batch}
            return {by_req[id(req)]: e for req, e in exc.failures}
        except Exception as exc:
            if len(batch) == 1:
                return {batch[0]: exc}
            logger.warning("a batched step of %d requests failed (%s: %s); retrying each alone", len(batch), type(exc).__name__, exc)
            failed: dict[RequestHandle, Exception] = {}
            for h in batch:
                failed.update(self._step_isolated([h]))
            return failed

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

    def _complete(self, h: RequestHandle) -> None:
        out = self._release(h, None)
        h.emit(StreamEvent("done", output=out))

    def _release(self, h: RequestHandle, reason: str | None) -> RequestOutput | None:
        """engine.finish the request (once) and record it; returns its output."""
        req = h.req
        if req is None or req.request_id not in self._live:
            return None
        del self._live[req.request_id]
        try:
            self.engine.finish(req, reason)
        except Exception:
            logger.exception("freeing request %s failed", req.request_id)
        self.num_freed += 1
        out = req.to_output()
        self._record_finish(h, out, req.finish_reason or reason or "abort")
        return out

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
            self._stopping = self._draining = True
        for h in waiting:
            self._record_finish(h, None, "abort")
            h.emit(StreamEvent("error", status=503, message="the server is shutting down"))
        for h in self._running + self._prefilling:
            self._release(h, "abort")
            h.emit(StreamEvent("error", status=503, message="the server is shutting down"))
        self._running, self._prefilling = [], []
        for req in list(self._live.values()):  # an admission interrupted mid-way
            del self._live[req.request_id]
            try:
                self.engine.finish(req, "abort")
            except Exception:
                logger.exception("freeing request %s failed", req.request_id)
            self.num_freed += 1
