"""Prometheus metrics of one server, named as vLLM names them (prefix `tokenleap:`).

Gauges (requests running and waiting), counters (prompt and generation tokens, finished
requests by reason, speculative decoding's drafts, draft tokens and accepted tokens, accepted
tokens per draft position) and histograms (time to first token, inter-token latency, end-to-end
latency), every series labelled `model_name` as in vLLM, so vLLM's dashboards read them. Each
server owns its `CollectorRegistry` (no global state): several servers can live in one process.
The engine thread records; the `/metrics` route renders (prometheus_client is thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from tokenleap.types import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "tokenleap:"

# vLLM's buckets
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
    640.0, 2560.0
)
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0
)
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0
)


class ServerMetrics:
    """The server's metrics; `running` / `waiting` are read when /metrics is scraped."""

    def __init__(self, model_name: str, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc., as vLLM exposes
        r = self.registry
        label = ["model_name"]
        self.model_name = model_name

        def gauge(name: str, doc: str, read: Callable[[], int]) -> None:
            Gauge(PREFIX + name, doc, label, registry=r).labels(model_name).set_function(read)

        gauge("num_requests_running", "Requests in the running batch (prefilling or decoding).", running)
        gauge("num_requests_waiting", "Requests waiting for a batch slot.", waiting)
        self.prompt_tokens = (
            Counter(PREFIX + "prompt_tokens", "Prefilled prompt tokens.", label, registry=r).labels(model_name)
        )
        self.generation_tokens = (
            Counter(PREFIX + "generation_tokens", "Generated tokens.", label, registry=r).labels(model_name)
        )
        self._success = Counter(
            PREFIX + "request_success", "Finished requests, by finish reason.", label + ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from arrival to the first token.",
            label,
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between output tokens (a step's time spread over the tokens it produced).",
            label,
            buckets=_ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from arrival to the end of the request.",
            label,
            buckets=_E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.num_drafts = Counter(
            PREFIX + "spec_decode_num_drafts", "Speculative steps that verified a draft.", label, registry=r
        ).labels(model_name)
        self.num_draft_tokens = Counter(
            PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed.", label, registry=r
        ).labels(model_name)
        self.num_accepted_tokens = Counter(
            PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", label, registry=r
        ).labels(model_name)
        self._accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position.",
            label + ["position"],
            registry=r,
        )
        for reason in ("stop", "length", "abort"):  # present (at 0) from the start, as in vLLM
            self._success.labels(model_name, reason)
        # plain totals of the finished requests' speculation, for /health (a person reading it, not a scraper)
        self._spec_totals = {"requests": 0, "target_forwards": 0, "decode_tokens": 0, "drafts": 0, "draft_tokens": 0,
                             "accepted_tokens": 0}

    def on_tokens(self, num_tokens: int, seconds: float) -> None:
        """`num_tokens` new output tokens produced by a step of `seconds` (inter-token latency)."""
        if num_tokens <= 0:
            return
        self.generation_tokens.inc(num_tokens)
        per_token = seconds / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(per_token)

    def on_finished(self, out: RequestOutput | None, reason: str, e2e_seconds: float) -> None:
        """A request left the server (`out` is None when it never reached the engine)."""
        self._success.labels(self.model_name, reason).inc()
        self.e2e.observe(e2e_seconds)
        if out is None:
            return
        s = out.metrics.spec
        t = self._spec_totals
        t["requests"] += 1
        t["target_forwards"] += out.metrics.num_forward_passes
        t["decode_tokens"] += out.metrics.num_decode_tokens
        t["drafts"] += s.num_drafts
        t["draft_tokens"] += s.num_draft_tokens
        t["accepted_tokens"] += s.num_accepted_tokens
        if s.num_drafts:
            self.num_drafts.inc(s.num_drafts)
            self.num_draft_tokens.inc(s.num_draft_tokens)
            self.num_accepted_tokens.inc(s.num_accepted_tokens)
            for pos, n in enumerate(s.accepted_per_position):
                self._accepted_per_pos.labels(self.model_name, str(pos)).inc(n)

    def speculation(self) -> dict[str, float]:
        """The finished requests' speculation so far: counts, the acceptance rate of draft tokens
        and the mean acceptance length (tokens per target forward after prefill; 1.0 is plain decoding)."""
        t = dict(self._spec_totals)
        return {
            **t,
            "acceptance_rate": round(t["accepted_tokens"] / t["draft_tokens"], 4) if t["draft_tokens"] else 0.0,
            "mean_acceptance_length": round(t["decode_tokens"] / t["target_forwards"], 4)
            if t["target_forwards"]
            else 0.0,
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)
