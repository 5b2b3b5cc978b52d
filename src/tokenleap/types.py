"""Small shared records returned by the library: request outputs, completions and timings.

Shaped like vLLM's `RequestOutput` / `CompletionOutput` so code written for vLLM's offline API
reads the same fields (`outputs[0].text`, `.token_ids`, `.finish_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_forward_passes: int = 0  # target forwards after prefill (steps)

    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens after the first, per second of decoding (prefill excluded)."""
        if self.decode_seconds <= 0 or self.num_generation_tokens <= 1:
            return 0.0
        return (self.num_generation_tokens - 1) / self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second end to end (prefill included)."""
        total = self.prefill_seconds + self.decode_seconds
        return self.num_generation_tokens / total if total > 0 else 0.0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_reason: str | int | None = None  # the stop string or token that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
