"""Continuous batching for offline generation: a bounded running set over a stream of prompts.

Iteration-level scheduling as in Orca (Yu et al., OSDI 2022) and vLLM, with Sarathi-style
chunked prefill (Agrawal et al., 2023), the policy of the server's engine loop without its
threads, queues and deadlines. Each `BatchScheduler.step`:

    admit   -> when no prompt is being prefilled and fewer than `max_num_seqs` requests are
               live, create the next job's request (its KV cache is allocated here, not before)
    prefill -> one chunk (`Engine.prefill_chunk` tokens) of that prompt; after its last chunk,
               its first token, and it joins the batch (chunks follow one another while the
               batch is empty: there is no decoding to interleave with)
    decode  -> `engine.step_batch(running)`: one target forward for every running request
    retire  -> finished requests are freed at once (`engine.finish`) and returned

A job with `params.n > 1` (parallel sampling) is admitted when its n samples fit; its prompt is
prefilled once, and the other samples fork the prefilled KV cache (`Engine.fork`). Each sample
finishes on its own and is returned with the job's index (`Request.sample_index` tells which).

So at most `max_num_seqs` requests hold a KV cache whatever the number of jobs, jobs are
drawn from their iterable only when admitted, and a request's tokens do not depend on what
it is batched with (the engine's row-invariant kernels and fixed prefill chunk offsets): the
output is the one-at-a-time output.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tokenleap.engine.engine import Engine
from tokenleap.engine.request import Request
from tokenleap.errors import TokenleapError
from tokenleap.kv.cache import trim_free_memory
from tokenleap.sampling import SamplingParams


@dataclass(frozen=True)
class BatchJob:
    """One prompt to complete; `prompt_ids` already checked (`Engine.check_prompt`)."""

    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the prompt text, reported back in the output


class BatchScheduler:
    """Run `jobs` through `engine` with at most `max_num_seqs` live requests; see the module
    docstring. Drive it with `step()` until `done`, or iterate over `run()`; `close()` frees
    whatever is still live (after an error, or when the caller stops early)."""

    def __init__(self, engine: Engine, jobs: Iterable[BatchJob], max_num_seqs: int = 16) -> None:
        if max_num_seqs < 1:
            raise TokenleapError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self._jobs: Iterator[tuple[int, BatchJob]] = enumerate(jobs)
        self._next: tuple[int, BatchJob] | None = None  # drawn from `_jobs`, not yet admitted
        self._exhausted = False  # `_jobs` has nothing more
        self._prefilling: tuple[int, Request] | None = None
        self._running: list[tuple[int, Request]] = []
        self.num_admitted = 0
        self.num_finished = 0
        self._finished_tokens = 0
        self.peak_live = 0  # most requests holding a KV cache at once
        self.peak_kv_bytes = 0  # most KV-cache bytes held at once (measured after each step)

    @property
    def num_live(self) -> int:
        """Requests holding engine state (a KV cache, drafter state)."""
        return len(self._running) + (self._prefilling is not None)

    @property
    def done(self) -> bool:
        """Every job has been admitted and has finished."""
        return self.num_live == 0 and not self._has_waiting()

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, by finished and running requests."""
        live = sum(len(r.output_ids) for _, r in self._running)
        return self._finished_tokens + live

    def live_requests(self) -> list[Request]:
        reqs = [r for _, r in self._running]
        if self._prefilling is not None:
            reqs.append(self._prefilling[1])
        return reqs

    def step(self) -> list[tuple[int, Request]]:
        """One iteration (admit, prefill a chunk, one batched decode step). Returns the requests
        that finished in it, with their job index, already freed."""
        finished: list[tuple[int, Request]] = []
        if self._prefilling is None and self._has_room():
            self._admit()
        while self._prefilling is not None:
            self._prefill_chunk(finished)
            if self._running:
                break  # one chunk between decode steps
            if self._prefilling is None and self._has_room():
                self._admit()  # nothing running yet: keep filling
        self._record_peaks()
        if self._running:
            self.engine.step_batch([r for _, r in self._running])
            self._record_peaks()
            still = []
            for index, req in self._running:
                if req.finished:
                    self._retire(index, req, finished)
                else:
                    still.append((index, req))
            self._running = still
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
        live = self.live_requests()
        self._running, self._prefilling = [], None
        self._next, self._exhausted = None, True
        for req in live:
            self.engine.finish(req, "abort")
        if live:
            trim_free_memory()

    # ------------------------------------------------------------------ internals

    def _has_room(self) -> bool:
        """Whether the next job's samples (`params.n` of them) fit beside the live requests (a job
        larger than `max_num_seqs` runs alone)."""
        if not self._has_waiting():
            return False
        assert self._next is not None
        return self.num_live == 0 or self.num_live + self._next[1].params.n <= self.max_num_seqs

    def _has_waiting(self) -> bool:
        if self._next is None and not self._exhausted:
            self._next = next(self._jobs, None)
            self._exhausted = self._next is None
        return self._next is not None

    def _admit(self) -> None:
        """Create the next job's request (allocating its KV cache) and start its prefill."""
        if not self._has_waiting():
            return
        assert self._next is not None
        (index, j), self._next = self._next, None
        req = self.engine.add_request(j.prompt_ids, j.params, prompt=j.prompt)
        self._prefilling = (index, req)
        self.num_admitted += 1
        try:
            self.engine.begin(req)
        except BaseException:
            self._prefilling = None
            self.engine.finish(req, "abort")
            raise

    def _prefill_chunk(self, finished: list[tuple[int, Request]]) -> None:
        assert self._prefilling is not None
        index, req = self._prefilling
        if not self.engine.prefill_step(req):
            return
        self._prefilling = None
        family = [req]
        try:
            for i in range(1, req.params.n):  # parallel sampling: the other samples share this prefill
                family.append(self.engine.fork(req, i))
        except BaseException:
            for r in family:
                self.engine.finish(r, "abort")
            raise
        finally:
            req.prompt_logits = None
        for r in family:
            if r.finished:  # the first token already ended it (EOS, max_tokens=1)
                self._retire(index, r, finished)
            else:
                self._running.append((index, r))

    def _retire(self, index: int, req: Request, finished: list[tuple[int, Request]]) -> None:
        self.engine.finish(req)
        self.num_finished += 1
        self._finished_tokens += len(req.output_ids)
        finished.append((index, req))

    def _record_peaks(self) -> None:
        live = self.live_requests()
        self.peak_live = max(self.peak_live, len(live))
        self.peak_kv_bytes = max(self.peak_kv_bytes, sum(r.kv.nbytes() for r in live))
