"""Sampling parameters and the logits -> probabilities pipeline.

Mirrors vLLM's `SamplingParams` (temperature, top-k, top-p / nucleus sampling of Holtzman et
al., 2020, min-p of Nguyen et al., 2024, seed, max_tokens, stop, penalties, min_tokens). The
processors apply in vLLM v1's order: context processors first (`processors.py`: min_tokens,
repetition, frequency and presence penalties; they also change greedy decoding), then
temperature -> min-p -> top-k -> top-p; the same functions serve plain decoding and speculative
verification, so both sample from exactly the same distribution.
Temperature 0 means greedy (argmax, first index on ties), and so does any temperature below
`SAMPLING_EPS` (vLLM's `_SAMPLING_EPS`): dividing logits by such a number overflows to inf and
the probabilities become NaN. Non-finite parameters are rejected.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenleap.errors import TokenleapError
from tokenleap.structured import StructuredOutputsParams

SAMPLING_EPS = 1e-5  # temperatures below this decode greedily (as in vLLM)
MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_N = 128  # completions per prompt


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI: subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted once per occurrence in the output
    # CTRL / vLLM: divides positive (multiplies negative) logits of prompt and output tokens
    repetition_penalty: float = 1.0
    # EOS and stop_token_ids are masked (and stop strings not checked) until this many tokens are out
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text
    skip_special_tokens: bool = True  # leave special tokens (<|im_end|>, ...) out of the text
    logprobs: int | None = None  # per output token, its log-probability and the top N others' (0: only its own)
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's: JSON schema / regex / choice / grammar
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's former name for the same
    # completions per prompt (parallel sampling: one prefill, n samples; with a seed, sample i uses seed + i)
    n: int = 1

    def __post_init__(self) -> None:
        so = self.structured_outputs if self.structured_outputs is not None else self.guided_decoding
        if isinstance(so, dict):
            so = StructuredOutputsParams(**so)
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise TokenleapError(
                "structured_outputs must be a StructuredOutputsParams (or a dict of its fields), "
                f"got {type(so).__name__}"
            )
        object.__setattr__(self, "structured_outputs", so)
        object.__setattr__(self, "guided_decoding", None)
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise TokenleapError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise TokenleapError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise TokenleapError(f"top_k must be >= 1, or 0 / -1 to disable, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise TokenleapError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise TokenleapError(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise TokenleapError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise TokenleapError(f"{name} must be in [-2, 2], got {v}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise TokenleapError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise TokenleapError(f"n must be an integer in [1, {MAX_N}], got {self.n}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not math.isfinite(rp) or rp <= 0:
            raise TokenleapError(f"repetition_penalty must be > 0 and finite, got {rp}")
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, int)
            or not 0 <= self.min_tokens <= self.max_tokens
        ):
            raise TokenleapError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or below `SAMPLING_EPS`."""
        return self.temperature < SAMPLING_EPS


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`[n, V]` float logits -> `[n, V]` probabilities after temperature, min-p, top-k, top-p
    (vLLM v1's order: min-p is an argmax-invariant processor applied right after temperature,
    before top-k / top-p).

    Only for `temperature >= SAMPLING_EPS`; greedy decoding takes the argmax of the raw logits.
    """
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if params.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        threshold = params.min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def make_generator(seed: int | None) -> torch.Generator:
    """A per-request generator: seeded when asked, else from fresh OS entropy."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from `[V]` logits under `params`."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = logits_to_probs(logits.unsqueeze(0), params)[0]
    return int(torch.multinomial(probs, 1, generator=generator))


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise TokenleapError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
