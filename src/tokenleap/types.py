"""Small shared records returned by the library: request outputs, completions and timings.

Shaped like vLLM's `RequestOutput` / `CompletionOutput` so code written for vLLM's offline API
reads the same fields (`outputs[0].text`, `.token_ids`, `.finish_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Speculation counters in the words of vLLM and llama.cpp."""

    num_drafts: int = 0  # steps that verified a non-empty draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # accepted count at draft position i
    drafted_per_position: list[int] = field(default_factory=list)  # drafts that reached position i
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # llama.cpp's per-implementation counters: calls of begin (a new prompt), generation (propose)
    # and accumulation (accept), their durations, and the drafts of which at least one token was kept
    num_begin_calls: int = 0
    num_propose_calls: int = 0
    num_accept_calls: int = 0
    begin_seconds: float = 0.0
    accept_seconds: float = 0.0
    num_accepted_drafts: int = 0
    # a chain's members by name, each with its own counters as llama.cpp keeps them per
    # implementation: its calls and their durations, and the drafts of its that were verified
    members: dict[str, SpecStats] = field(default_factory=dict)

    def member(self, name: str) -> SpecStats:
        """The counters of the chain member `name` (made on first use)."""
        return self.members.setdefault(name, SpecStats())

    def llama_cpp_line(self, name: str) -> str:
        """llama.cpp's statistics line for the implementation `name` (its underscore spelling)."""

        def ms(total: float, calls: int) -> str:
            return f"{1e3 * total / calls:.3f}" if calls else "0.000"

        return (
            f"statistics {name.replace('-', '_')}: #calls(b,g,a) = {self.num_begin_calls} {self.num_propose_calls} "
            f"{self.num_accept_calls}, #gen drafts = {self.num_drafts}, #acc drafts = {self.num_accepted_drafts}, "
            f"#gen tokens = {self.num_draft_tokens}, #acc tokens = {self.num_accepted_tokens}, dur(b,g,a) = "
            f"{ms(self.begin_seconds, self.num_begin_calls)}, {ms(self.draft_seconds, self.num_propose_calls)}, "
            f"{ms(self.accept_seconds, self.num_accept_calls)} ms"
        )

    def llama_cpp_lines(self, name: str) -> list[str]:
        """`llama_cpp_line(name)`, then one line per chain member, in chain order."""
        return [self.llama_cpp_line(name), *(s.llama_cpp_line(m) for m, s in self.members.items())]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def record(self, draft_len: int, num_accepted: int, depth: int | None = None) -> None:
        """One verified draft of `draft_len` tokens (a tree: nodes, `depth` its deepest path,
        the positions it could reach) of which `num_accepted` were kept."""
        if draft_len == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += draft_len
        self.num_accepted_tokens += num_accepted
        self.num_accepted_drafts += num_accepted > 0
        reach = draft_len if depth is None else depth
        grow = reach - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(reach):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


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
    num_decode_tokens: int = 0  # tokens committed by those forwards (a final EOS included)
    spec: SpecStats = field(default_factory=SpecStats)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per target forward after prefill (1.00 for plain decoding)."""
        if self.num_forward_passes == 0:
            return 0.0
        return self.num_decode_tokens / self.num_forward_passes

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


@dataclass(frozen=True)
class Logprob:
    """vLLM's: a token's log-probability under the target's raw distribution (before penalties,
    temperature and truncation: vLLM's default `raw_logprobs`), its rank there (1 = likeliest)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_reason: str | int | None = None  # the stop string or token that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # per output token: itself and the top `SamplingParams.logprobs`
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
