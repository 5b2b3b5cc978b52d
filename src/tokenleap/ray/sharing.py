"""Drafter statistics shared across replicas: every replica's global suffix tree and n-gram pools
learn from the answers of all replicas, not only its own.

A small Ray actor, the hub (`StatsHub`), keeps the last `capacity` answers (prompt and output
token ids) in a bounded ring with increasing sequence numbers. Each replica's `Sharer`
publishes the answers its engine finished (fire and forget: a lost or late publish costs
acceptance, never correctness) and, every `period` seconds on a background thread, pulls the
answers after its cursor that other replicas published. Those are handed to the engine thread
(`EngineLoop.call_soon`) and fed to every drafter that learns from answers (`learn(prompt,
output)`), between steps, exactly as a request that ended locally would be. A replica that falls
behind (its cursor older than the ring) skips what was dropped and still drafts, only worse.
Verification keeps greedy output identical to plain decoding whatever a drafter learned.

The hub also holds each replica's latest rendered /metrics text (`put_metrics` /
`all_metrics`), which the ingress merges with a `replica` label (`tokenleap.ray.metrics`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from tokenleap.drafters.base import LearnsAcrossRequests, SharedStore
from tokenleap.server.loop import EngineLoop, Job
from tokenleap.types import RequestOutput

logger = logging.getLogger(__name__)

HUB_NAME = "tokenleap-stats-hub"


class StatsHub:
    """The hub's state (run as a Ray actor by `hub_actor`; plain class so it is testable alone)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._ring: deque[tuple[int, str, list[int], list[int]]] = deque(maxlen=capacity)
        self._next = 0
        self._metrics: dict[str, tuple[float, str]] = {}

    def publish(self, replica: str, prompt_ids: list[int], output_ids: list[int]) -> int:
        self._ring.append((self._next, replica, prompt_ids, output_ids))
        self._next += 1
        return self._next

    def since(self, cursor: int, replica: str, limit: int = 256) -> tuple[int, list[tuple[list[int], list[int]]], int]:
        """Others' answers numbered >= cursor (at most `limit`): (new cursor, answers, answers
        skipped because the ring dropped them before this replica pulled)."""
        oldest = self._ring[0][0] if self._ring else self._next
        skipped = max(0, oldest - cursor)
        start = end = max(cursor, oldest)
        out: list[tuple[list[int], list[int]]] = []
        for seq, who, prompt, output in self._ring:
            if seq < start:
                continue
            if len(out) >= limit:
                break
            end = seq + 1
            if who != replica:
                out.append((prompt, output))
        return end, out, skipped

    def head(self) -> int:
        return self._next

    def put_metrics(self, replica: str, text: str) -> None:
        self._metrics[replica] = (time.time(), text)

    def drop_metrics(self, replica: str) -> None:
        self._metrics.pop(replica, None)

    def all_metrics(self, max_age: float = 30.0) -> dict[str, str]:
        now = time.time()
        for rid in [r for r, (t, _) in self._metrics.items() if now - t > max_age]:
            del self._metrics[rid]  # a replica gone without saying so
        return {r: text for r, (_, text) in self._metrics.items()}


def hub_actor(app_name: str = "tokenleap", capacity: int = 1024) -> Any:
    """The hub actor of Serve app `app_name` (named and detached, so replicas started later and
    the ingress find it), created on first use; it restarts if its process dies."""
    import ray

    cls = ray.remote(num_cpus=0, max_restarts=-1)(StatsHub)
    return cls.options(
        name=f"{HUB_NAME}-{app_name}", namespace="tokenleap", get_if_exists=True, lifetime="detached"
    ).remote(capacity)


def _store_of(drafter: Any) -> Any:
    """What a drafter's `learn` writes to: the n-gram pool or dynamic statistics that drafters
    of one engine may share (`SharedStore`: ngram-mod, ngram-cache), else the drafter itself."""
    return drafter.shared_store if isinstance(drafter, SharedStore) else drafter


class Sharer:
    """One replica's side: publish finished answers, pull and ingest others'."""

    def __init__(self, hub: Any, replica: str, loop: EngineLoop, *, share: bool = True, period: float = 0.5,
                 metrics_text: Any = None) -> None:
        self.hub, self.replica, self.loop, self.share, self.period = hub, replica, loop, share, period
        self.metrics_text = metrics_text  # () -> str, pushed to the hub every period
        self.cursor = 0
        self.num_published = self.num_ingested = self.num_skipped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenleap-sharer", daemon=True)
        if share:
            loop.finish_listeners.append(self._on_finish)
            try:  # start at the hub's head: answers older than this replica are not replayed
                import ray

                self.cursor = ray.get(hub.head.remote(), timeout=10)
            except Exception:
                logger.warning("the stats hub did not answer; starting from its beginning")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _on_finish(self, job: Job, out: RequestOutput | None, reason: str) -> None:
        if out is None or not out.outputs or not out.outputs[0].token_ids:
            return
        try:
            self.hub.publish.remote(self.replica, list(job.prompt_ids), list(out.outputs[0].token_ids))
            self.num_published += 1
        except Exception as exc:  # loss-tolerant: a lost answer only costs acceptance
            logger.debug("publishing an answer failed: %s", exc)

    def pull_once(self, timeout: float = 10.0) -> int:
        """Fetch others' new answers and queue them for the engine thread; returns how many."""
        import ray

        cursor, answers, skipped = ray.get(self.hub.since.remote(self.cursor, self.replica), timeout=timeout)
        self.cursor, self.num_skipped = cursor, self.num_skipped + skipped
        if answers:
            self.loop.call_soon(lambda: self._ingest(answers))
        return len(answers)

    def _ingest(self, answers: list[tuple[list[int], list[int]]]) -> None:  # engine thread
        stores: set[int] = set()
        for d in self.loop.engine.drafters():
            if not isinstance(d, LearnsAcrossRequests):
                continue
            store = _store_of(d)
            if id(store) in stores:  # drafters sharing one pool / statistics table learn once
                continue
            stores.add(id(store))
            for prompt, output in answers:
                d.learn(prompt, output)
        self.num_ingested += len(answers)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                if self.share:
                    while self.pull_once() >= 256:  # catch up in pages
                        pass
                if self.metrics_text is not None:
                    self.hub.put_metrics.remote(self.replica, self.metrics_text())
            except Exception as exc:  # the hub restarting, a slow cluster: try again next period
                logger.debug("stats sharing: %s", exc)
